"""keyserve: a Ray-distributed LLM serving cluster with paged KV, KV budgets and speculative sampling."""

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):  # lazy: importing a submodule (keyserve.config) must load nothing else
    if name == "LLM":
        from keyserve.llm import LLM

        return LLM
    if name == "SamplingParams":
        from keyserve.core.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
