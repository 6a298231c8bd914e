"""The disk tier: one raw file per radix node, written atomically, every chunk checksummed.

A node's file is its KV in storage order, ``[num_layers, num_chunks, 2, chunk_size,
num_kv_heads, head_dim]`` in the cache dtype, so one layer's first c chunks (its most important
tokens after repacking) are one contiguous byte range. Files appear only complete (written to
a temporary name, then renamed). Checksums (CRC-32 per chunk) stay in memory with the index;
a chunk whose bytes do not match, or a missing file, raises ``CorruptChunk`` and is never served.

``cold_reads`` makes every read come from the device, not the page cache: files are synced when
written and dropped from the cache (``posix_fadvise(DONTNEED)``) before each read. That is what
a store larger than memory pays, and what a benchmark of the disk tier must measure.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
import zlib
from pathlib import Path

import torch


class CorruptChunk(Exception):
    """A stored chunk is missing or its checksum does not match."""

    def __init__(self, node_id: int, layer: int, chunk: int, why: str) -> None:
        super().__init__(f"node {node_id} layer {layer} chunk {chunk}: {why}")
        self.node_id = node_id


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted chunk ids -> (first, count) runs of consecutive ids."""
    runs: list[tuple[int, int]] = []
    for i in ids:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


class DiskTier:
    def __init__(
        self,
        parent: str | None,
        max_bytes: int,
        chunk_shape: tuple[int, int, int, int],  # (2, chunk_size, num_kv_heads, head_dim)
        dtype: torch.dtype,
        cold_reads: bool = False,
    ) -> None:
        if parent is not None:
            Path(parent).mkdir(parents=True, exist_ok=True)
        # A directory of our own: the index lives in memory, so files of another process or an
        # earlier run are never trusted (nor deleted).
        self.root = Path(tempfile.mkdtemp(prefix="keyserve-prefix-", dir=parent))
        self.max_bytes = max_bytes
        self.chunk_shape = chunk_shape
        self.dtype = dtype
        self.cold_reads = cold_reads and hasattr(os, "posix_fadvise")
        self.chunk_bytes = int(torch.Size(chunk_shape).numel()) * torch.empty((), dtype=dtype).element_size()
        self.sizes: dict[int, int] = {}  # node_id -> file bytes
        self.bytes_written = 0
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.root), True)

    @property
    def used_bytes(self) -> int:
        return sum(self.sizes.values())

    def path(self, node_id: int) -> Path:
        return self.root / f"{node_id}.kv"

    def write_node(
        self,
        node_id: int,
        data: torch.Tensor,  # [num_layers, num_chunks, 2, chunk_size, num_kv_heads, head_dim]
    ) -> torch.Tensor:  # [num_layers, num_chunks] int64 CRC-32 of every chunk
        raw = data.detach().to("cpu", self.dtype).contiguous().view(torch.uint8).numpy()
        num_layers, num_chunks = data.shape[:2]
        flat = memoryview(raw).cast("B")
        cb = self.chunk_bytes
        crcs = torch.tensor(
            [zlib.crc32(flat[i * cb : (i + 1) * cb]) for i in range(num_layers * num_chunks)],
            dtype=torch.int64,
        ).view(num_layers, num_chunks)
        final = self.path(node_id)
        fd, tmp = tempfile.mkstemp(prefix=f".{node_id}.", suffix=".tmp", dir=self.root)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(flat)
                if self.cold_reads:  # clean pages only can be dropped before a read
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, final)  # atomic: readers see no file or the whole file
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.sizes[node_id] = len(flat)
        self.bytes_written += len(flat)
        return crcs

    def read_chunks(
        self,
        node_id: int,
        layer: int,
        num_chunks: int,  # chunks per layer in this node's file
        chunk_ids: list[int],  # sorted, storage order
        checksums: torch.Tensor,  # [num_layers, num_chunks] int64
    ) -> torch.Tensor:  # [len(chunk_ids), 2, chunk_size, num_kv_heads, head_dim]
        """Read the given chunks of one layer: one ``pread`` per run of consecutive chunks."""
        cb = self.chunk_bytes
        buf = bytearray(len(chunk_ids) * cb)
        view = memoryview(buf)
        try:
            fd = os.open(self.path(node_id), os.O_RDONLY)
        except OSError as e:
            raise CorruptChunk(node_id, layer, chunk_ids[0] if chunk_ids else -1, f"file: {e}") from e
        try:
            if self.cold_reads:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            at = 0
            for first, count in _runs(chunk_ids):
                want = count * cb
                got = os.pread(fd, want, (layer * num_chunks + first) * cb)
                if len(got) != want:
                    raise CorruptChunk(node_id, layer, first, "file too short")
                view[at : at + want] = got
                at += want
        finally:
            os.close(fd)
        for j, c in enumerate(chunk_ids):
            if zlib.crc32(view[j * cb : (j + 1) * cb]) != int(checksums[layer, c]):
                raise CorruptChunk(node_id, layer, c, "checksum mismatch")
        out = torch.frombuffer(buf, dtype=torch.uint8).view(self.dtype)
        return out.view(len(chunk_ids), *self.chunk_shape)

    def delete(self, node_id: int) -> None:
        self.sizes.pop(node_id, None)
        self.path(node_id).unlink(missing_ok=True)

    def close(self) -> None:
        self.sizes.clear()
        self._cleanup()  # removes the directory (once)
