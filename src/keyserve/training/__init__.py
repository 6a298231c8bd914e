"""Distilling a small draft model for speculative decoding (``keyserve distill-draft``).

The pipeline: build a varied prompt set offline (``prompts``), let the target answer it while
recording its top-k next-token distributions (``generate``), pick the draft's pruned LM-head
vocabulary from those answers (``vocab``), train the draft against the recorded distributions
(``train``), and write a draft directory that ``keyserve.model.draft.load_draft`` reads
(``export``). ``distill`` wires these together; ``dense`` is the plain-attention Llama they share.
"""
