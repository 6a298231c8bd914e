"""keyserve: a Ray-distributed LLM serving cluster with paged KV, KV budgets and speculative sampling."""

from keyserve.core.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):  # lazy: importing keyserve must not load torch models or tokenizers
    if name == "LLM":
        from keyserve.llm import LLM

        return LLM
    raise AttributeError(name)
