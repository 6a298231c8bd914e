"""keyserve.model: our Llama-family decoder over the paged KV cache, and its loader.

``load_model(name_or_path)`` gives a ``LoadedModel`` (model, config, tokenizer, path);
``allocate_kv_cache`` sizes the per-layer paged caches its ``forward`` reads and writes.
"""

from keyserve.model.config import ModelConfig, RopeConfig
from keyserve.model.kv_cache import allocate_kv_cache, kv_cache_bytes_per_block
from keyserve.model.llama import LlamaForCausalLM
from keyserve.model.loader import LoadedModel, load_model, resolve_model_dir
from keyserve.model.paths import DEFAULT_MODEL_NAME, cache_dir

__all__ = [
    "DEFAULT_MODEL_NAME",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "RopeConfig",
    "allocate_kv_cache",
    "cache_dir",
    "kv_cache_bytes_per_block",
    "load_model",
    "resolve_model_dir",
]
