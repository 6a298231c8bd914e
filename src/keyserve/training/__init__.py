"""Draft training: distilling a small draft model for speculative decoding, offline
(``keyserve distill-draft``, ``python -m keyserve.training.acceptance``).

This is a tool, not part of serving: the runtime packages (config, core, kernels, model,
engine, actors, cluster) never import it; serving reads what it writes through
``keyserve.model.draft_model.load_draft``. Only ``keyserve.cli`` imports it, inside the
``distill-draft`` command.

The pipeline: build a varied prompt set offline (``prompts``), let the target answer it while
recording its top-k next-token distributions (``generate``), pick the draft's pruned LM-head
vocabulary from those answers (``vocab``), train the draft against the recorded distributions
(``train``), and write a draft directory (``export``). ``distill`` wires these together;
``dense`` is the plain-attention Llama (autograd, padded batches) they share with
``acceptance``, which measures a draft against its target.
"""
