"""Convert a GGUF file once into a Hugging Face directory (config + safetensors + tokenizer).

transformers' own GGUF support does the hard parts -- dequantising the blocks to float32,
undoing llama.cpp's q/k row permutation, mapping metadata to a config and rebuilding the
tokenizer with its chat template -- but it takes tens of seconds. We pay that once and cache
the result, so every later load is a plain safetensors read.

The directory is written under a temporary name next to its destination and renamed into
place, so an interrupted conversion never leaves a directory that looks complete.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from keyserve.model.paths import models_dir

# GGUF ``general.architecture`` values whose transformers model is one we implement.
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2")
CONVERSION_MANIFEST = "keyserve_conversion.json"
_STALE_TMP_SECONDS = 3600


def gguf_architecture(path: Path) -> str:
    """Read ``general.architecture`` from the GGUF header (cheap: the file is memory-mapped)."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("general.architecture")
    if field is None:
        raise ValueError(f"{path} has no general.architecture; is it a GGUF model file?")
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def cache_dir_for_gguf(path: Path) -> Path:
    """A cache directory name unique to this file's path, size and modification time."""
    st = path.stat()
    key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()
    return models_dir() / f"{path.stem}-{hashlib.sha256(key).hexdigest()[:12]}"


def is_converted(out_dir: Path) -> bool:
    return (out_dir / CONVERSION_MANIFEST).is_file()


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> Path:
    """Make ``out_dir`` a Hugging Face copy of ``gguf_path`` unless it already is one."""
    if is_converted(out_dir):
        return out_dir
    if out_dir.exists():
        raise FileExistsError(
            f"{out_dir} exists but is not a finished keyserve conversion (no "
            f"{CONVERSION_MANIFEST}); remove it to convert {gguf_path} again"
        )
    with _gguf_parsed_once():  # the architecture check's parse serves the conversion's reads too
        arch = gguf_architecture(gguf_path)
        if arch not in SUPPORTED_GGUF_ARCHITECTURES:
            raise ValueError(
                f"{gguf_path}: GGUF architecture {arch!r} is not supported; "
                f"keyserve implements {SUPPORTED_GGUF_ARCHITECTURES}"
            )
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(out_dir)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        try:
            _convert_into(gguf_path, tmp, progress)
            try:
                os.rename(tmp, out_dir)
            except OSError:
                if not is_converted(out_dir):  # not a concurrent conversion that won the race
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out_dir


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers reads the GGUF three times (tokenizer, config, weights), each a full parse
    of its metadata (SmolLM2: a 49k-token vocabulary and its merges, ~440k numpy views), and
    builds gguf's tensor-name map once per module (397 times for SmolLM2): measured ~60 % of a
    45-60 s conversion on 2 cores. Inside this block each reader and map is built once
    (transformers imports both from ``gguf`` at call time and only reads them), and so is the
    architecture check's (a full parse too: ~6 s of a first run on 2 cores)."""
    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple, Any] = {}

    def reader(path: Any, *args: Any, **kwargs: Any) -> Any:
        key = (os.path.realpath(str(path)), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real_reader(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


def _convert_into(gguf_path: Path, tmp: Path, progress: bool) -> None:
    """Write the Hugging Face copy into ``tmp``; called inside ``_gguf_parsed_once``."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source_dir, name = str(gguf_path.parent), gguf_path.name
    stages = ["tokenizer", "dequantise weights", "write safetensors", "config"]
    with tqdm(total=len(stages), desc=f"converting {name}", unit="stage", disable=not progress) as bar:

        def stage(i: int) -> None:
            bar.set_postfix_str(stages[i])

        stage(0)
        tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=name)
        tokenizer.save_pretrained(str(tmp))
        bar.update()

        stage(1)
        hf = AutoModelForCausalLM.from_pretrained(source_dir, gguf_file=name, dtype=torch.float32)
        bar.update()

        stage(2)
        tied = bool(getattr(hf.config, "tie_word_embeddings", False))
        tensors = {
            k: v.detach().contiguous()
            for k, v in hf.state_dict().items()
            if not (tied and k == "lm_head.weight")  # shares the embedding's storage
        }
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        bar.update()

        stage(3)
        with open(tmp / "config.json", "w", encoding="utf-8") as f:
            json.dump(_plain_config(hf), f, indent=2, sort_keys=True)
        hf.generation_config.save_pretrained(str(tmp))
        manifest = {
            "source": str(gguf_path.resolve()),
            "source_bytes": gguf_path.stat().st_size,
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        with open(tmp / CONVERSION_MANIFEST, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2)
        bar.update()


def _plain_config(hf: Any) -> dict[str, Any]:
    """The model's config as an ordinary (non-GGUF, float32) ``config.json``."""
    cfg = hf.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_model_name_or_path", None)
    cfg["architectures"] = [type(hf).__name__]
    cfg["dtype"] = "float32"
    return cfg


def _remove_stale_temporaries(out_dir: Path) -> None:
    """Delete temp dirs left by conversions that were killed (older than an hour)."""
    now = time.time()
    for tmp in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):
        try:
            if now - tmp.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass
