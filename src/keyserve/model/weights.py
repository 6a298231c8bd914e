"""Reading checkpoint tensors from safetensors, and refusing pickle checkpoints.

Pickle files (``*.bin``, ``*.pt``) execute code when loaded, so keyserve never opens them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
SHARD_INDEX = "model.safetensors.index.json"


def pickle_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)


def safetensors_files(directory: Path) -> list[Path]:
    """The checkpoint's safetensors files: those the shard index names, else every one."""
    index = directory / SHARD_INDEX
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [directory / n for n in names]
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that do not exist: {missing}")
        return files
    return sorted(directory.glob("*.safetensors"))


def refuse_pickle(path: Path) -> None:
    raise ValueError(
        f"{path} holds only pickle checkpoints ({', '.join(p.name for p in pickle_files(path))}); "
        "keyserve loads weights from *.safetensors only, because unpickling can run arbitrary "
        "code. Convert it first, e.g. with transformers: "
        "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out_dir)"
    )


def iter_safetensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor of the checkpoint, one file at a time."""
    files = safetensors_files(directory)
    if not files:
        if pickle_files(directory):
            refuse_pickle(directory)
        raise FileNotFoundError(f"no *.safetensors weights in {directory}")
    for file in files:
        try:
            f = safe_open(str(file), framework="pt", device="cpu")
        except Exception as e:  # safetensors' own error type names neither the file nor why
            raise ValueError(f"cannot read the weights file {file}: {e} (a truncated or corrupt "
                             "download? its size is {:,} bytes)".format(file.stat().st_size)) from e
        with f:
            for name in f.keys():
                yield name, f.get_tensor(name)
