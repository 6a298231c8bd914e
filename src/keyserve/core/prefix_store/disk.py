"""The disk tier: one raw file per radix node, written atomically, every chunk checksummed.

A node's file is its KV in storage order, ``[num_layers, num_chunks, 2, chunk_size,
num_kv_heads, head_dim]`` in the cache dtype, so one layer's first c chunks (its most important
tokens after repacking) are one contiguous byte range. With ``low_dtype`` (for example float16
under a float32 cache) the chunks the store marks unimportant are written in that dtype instead,
each in place (a node's chunk offsets are kept with its size), and read back cast to the cache
dtype: the unimportant half of a prefix costs half the bytes to store and to read, and a
request can still bring every token of it. Files appear only complete (written to
a temporary name, then renamed). Checksums (CRC-32 per chunk) stay in memory with the index;
a chunk whose bytes do not match, or a missing file, raises ``CorruptChunk`` and is never served.

``cold_reads`` makes every read come from the device, not the page cache: files are synced when
written and dropped from the cache (``posix_fadvise(DONTNEED)``) before each read. That is what
a store larger than memory pays, and what a benchmark of the disk tier must measure.

Files are written by one background thread (``background_writes``): the caller lays the bytes
out and checksums them, and the write itself (~66 ms for a 100 MB node on the 2-core EPYC, more
with ``cold_reads``' sync) overlaps the engine's next step instead of delaying it. The thread
runs no torch code (so it starts no OpenMP pool of its own). A node is accounted for at once; a
read or delete of a node still being written waits for its write, and a write that failed makes
the node's reads raise ``CorruptChunk`` (the store drops such a node, as for a corrupt file).
At most ``MAX_PENDING_WRITES`` writes wait at a time (each holds its node's bytes in memory).

The private directory ``keyserve-prefix-XXXX`` has a lock file beside it,
``keyserve-prefix-XXXX.lock``, held (``flock``) for the tier's life: the kernel releases it when
the process dies, however it dies. A tier opening in the same ``disk_path`` removes every
sibling directory whose lock it can take: a process killed (``kill -9``, OOM, a SIGTERM with no
handler) never ran its cleanup, and without this each crash left up to ``disk_max_gb`` behind
for good. A live engine's directory (another replica on the node) is never touched.

Reads and deletes treat any error of the file system as a damaged node, never as a failure of
the step: a node file replaced by a directory or a FIFO (an ``open`` that would block forever),
an I/O error, a directory made read-only or removed: the node is dropped and counted.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import shutil
import tempfile
import weakref
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch


log = logging.getLogger(__name__)

MAX_PENDING_WRITES = 2


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


def _flag_runs(flags: list[bool]) -> list[tuple[int, int, bool]]:
    """(start, end, flag) of each run of equal consecutive ``flags``."""
    runs: list[tuple[int, int, bool]] = []
    for i in range(len(flags)):
        if runs and runs[-1][2] == flags[i]:
            runs[-1] = (runs[-1][0], i + 1, flags[i])
        else:
            runs.append((i, i + 1, flags[i]))
    return runs


class DiskTier:
    def __init__(
        self,
        parent: str | None,
        max_bytes: int,
        chunk_shape: tuple[int, int, int, int],  # (2, chunk_size, num_kv_heads, head_dim)
        dtype: torch.dtype,
        cold_reads: bool = False,
        low_dtype: torch.dtype | None = None,
        background_writes: bool = True,
    ) -> None:
        if parent is not None:
            if Path(parent).exists() and not Path(parent).is_dir():
                raise ValueError(f"prefix store disk_path {parent} exists and is not a directory")
            Path(parent).mkdir(parents=True, exist_ok=True)
        # A directory of our own: the index lives in memory, so files of another process or an
        # earlier run are never trusted (nor deleted).
        self.root = Path(tempfile.mkdtemp(prefix="keyserve-prefix-", dir=parent))
        try:
            self._lock_fd = _hold_lock(self.root)
        except BaseException:
            shutil.rmtree(self.root, True)
            raise
        _remove_orphans(self.root.parent, self.root)
        self.max_bytes = max_bytes
        self.chunk_shape = chunk_shape
        self.dtype = dtype
        self.cold_reads = cold_reads and hasattr(os, "posix_fadvise")
        numel = int(torch.Size(chunk_shape).numel())
        self.chunk_bytes = numel * dtype.itemsize
        self.low_dtype = low_dtype if low_dtype != dtype else None
        self.low_chunk_bytes = numel * (self.low_dtype or dtype).itemsize
        # node_id -> (byte offset of every chunk, layer-major, and the end = the file's size;
        # low-precision flags)
        self.layouts: dict[int, tuple[list[int], list[bool]]] = {}
        self.bytes_written = 0
        self._writer = ThreadPoolExecutor(1, "keyserve-disk-writer") if background_writes else None
        self._pending: dict[int, Future] = {}  # node_id -> its write, until read, deleted or drained
        self._failed: dict[int, str] = {}  # node_id -> why its write failed
        self._cleanup = weakref.finalize(self, _remove_dir, self._writer, str(self.root), self._lock_fd)

    @property
    def sizes(self) -> dict[int, int]:
        """node_id -> file bytes."""
        return {node_id: offsets[-1] for node_id, (offsets, _) in self.layouts.items()}

    @property
    def used_bytes(self) -> int:
        return sum(offsets[-1] for offsets, _ in self.layouts.values())

    def path(self, node_id: int) -> Path:
        return self.root / f"{node_id}.kv"

    def node_bytes(self, low: torch.Tensor) -> int:  # low: [num_layers, num_chunks] bool
        """A node's file size, given which of its chunks are stored in ``low_dtype``."""
        num_low = int(low.sum()) if self.low_dtype is not None else 0
        return (low.numel() - num_low) * self.chunk_bytes + num_low * self.low_chunk_bytes

    def write_node(
        self,
        node_id: int,
        data: torch.Tensor,  # [num_layers, num_chunks, 2, chunk_size, num_kv_heads, head_dim]
        low: torch.Tensor | None = None,  # [num_layers, num_chunks] bool: store in low_dtype
    ) -> torch.Tensor:  # [num_layers, num_chunks] int64 CRC-32 of every chunk
        num_layers, num_chunks = data.shape[:2]
        flags = [False] * (num_layers * num_chunks)
        if low is not None and self.low_dtype is not None:
            flags = low.reshape(-1).tolist()
        chunks = data.detach().to("cpu").reshape(num_layers * num_chunks, -1)  # no copy if contiguous
        offsets = [0]
        for f in flags:
            offsets.append(offsets[-1] + (self.low_chunk_bytes if f else self.chunk_bytes))
        if any(flags):  # each chunk in its own dtype, in place: one cast per run, into the file's bytes
            out = torch.empty(offsets[-1], dtype=torch.uint8)
            for a, b, f in _flag_runs(flags):
                dtype = self.low_dtype if f else self.dtype
                out[offsets[a] : offsets[b]].view(dtype).view(b - a, -1).copy_(chunks[a:b])
            raw = out.numpy()
        else:
            raw = chunks.to(self.dtype).contiguous().view(torch.uint8).numpy()
        flat = memoryview(raw).cast("B")
        crcs = torch.tensor(
            [zlib.crc32(flat[offsets[i] : offsets[i + 1]]) for i in range(num_layers * num_chunks)],
            dtype=torch.int64,
        ).view(num_layers, num_chunks)
        self._wait(node_id)  # a node written again (never in the store: its ids are fresh)
        self._failed.pop(node_id, None)
        if self._writer is None:
            _write_file(self.path(node_id), flat, self.cold_reads)
        else:
            while len(self._pending) >= MAX_PENDING_WRITES:
                self._wait(next(iter(self._pending)))
            # ``raw`` (and what it views) stays alive with the job until the write is done
            self._pending[node_id] = self._writer.submit(_write_file, self.path(node_id), flat, self.cold_reads)
        self.layouts[node_id] = (offsets, flags)
        self.bytes_written += len(flat)
        return crcs

    def _wait(self, node_id: int) -> None:
        """Wait for ``node_id``'s write, if one is pending; a failure is remembered (its reads
        raise ``CorruptChunk``)."""
        job = self._pending.pop(node_id, None)
        if job is None:
            return
        try:
            job.result()
        except Exception as e:  # noqa: BLE001 — the node reads as corrupt; the store drops it
            log.warning("prefix store: writing node %d to disk failed: %s", node_id, e)
            self._failed[node_id] = f"its write failed: {e}"

    def drain(self) -> None:
        """Wait for every pending write."""
        for node_id in list(self._pending):
            self._wait(node_id)

    def read_chunks(
        self,
        node_id: int,
        layer: int,
        num_chunks: int,  # chunks per layer in this node's file
        chunk_ids: list[int],  # sorted, storage order
        checksums: torch.Tensor,  # [num_layers, num_chunks] int64
    ) -> tuple[torch.Tensor, int]:  # [len(chunk_ids), 2, chunk_size, num_kv_heads, head_dim], bytes read
        """Read the given chunks of one layer (one ``pread`` per run of consecutive chunks), in
        the cache dtype, and the bytes that took."""
        self._wait(node_id)
        if node_id not in self.layouts:
            raise CorruptChunk(node_id, layer, chunk_ids[0] if chunk_ids else -1, "not on disk")
        if node_id in self._failed:
            raise CorruptChunk(node_id, layer, chunk_ids[0] if chunk_ids else -1, self._failed[node_id])
        offsets, flags = self.layouts[node_id]
        base = layer * num_chunks
        spans = [(offsets[base + c], offsets[base + c + 1]) for c in chunk_ids]
        buf = bytearray(sum(b - a for a, b in spans))
        view = memoryview(buf)
        first_id = chunk_ids[0] if chunk_ids else -1
        try:  # O_NONBLOCK: a FIFO put in the file's place must not block the engine's step
            fd = os.open(self.path(node_id), os.O_RDONLY | os.O_NONBLOCK)
        except OSError as e:
            raise CorruptChunk(node_id, layer, first_id, f"file: {e}") from e
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # a directory, FIFO, device put there
                raise CorruptChunk(node_id, layer, first_id, "not a regular file")
            if self.cold_reads:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            at = 0
            for first, count in _runs(chunk_ids):
                lo, hi = offsets[base + first], offsets[base + first + count]
                try:
                    got = os.pread(fd, hi - lo, lo)
                except OSError as e:  # EIO from a failing disk, ...
                    raise CorruptChunk(node_id, layer, first, f"read: {e}") from e
                if len(got) != hi - lo:
                    raise CorruptChunk(node_id, layer, first, "file too short")
                view[at : at + hi - lo] = got
                at += hi - lo
        finally:
            os.close(fd)
        at = 0
        for c, (a, b) in zip(chunk_ids, spans):
            if zlib.crc32(view[at : at + b - a]) != int(checksums[layer, c]):
                raise CorruptChunk(node_id, layer, c, "checksum mismatch")
            at += b - a
        if not any(flags[base + c] for c in chunk_ids):  # all in the cache dtype: no copy
            whole = torch.frombuffer(buf, dtype=torch.uint8).view(self.dtype)
            return whole.view(len(chunk_ids), *self.chunk_shape), len(buf)
        out = torch.empty(len(chunk_ids), *self.chunk_shape, dtype=self.dtype)
        at = 0
        for a, b, low in _flag_runs([flags[base + c] for c in chunk_ids]):
            nbytes = (b - a) * (self.low_chunk_bytes if low else self.chunk_bytes)
            raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=at)
            out[a:b] = raw.view(self.low_dtype if low else self.dtype).view(b - a, *self.chunk_shape)
            at += nbytes
        return out, len(buf)

    def delete(self, node_id: int) -> None:
        job = self._pending.get(node_id)
        if job is not None and job.cancel():  # not started: nothing reaches the disk
            del self._pending[node_id]
        self._wait(node_id)
        self._failed.pop(node_id, None)
        self.layouts.pop(node_id, None)
        try:
            self.path(node_id).unlink(missing_ok=True)
        except OSError as e:  # a directory in its place, a read-only or removed root, EIO
            log.warning("prefix store: removing node %d's file failed: %s", node_id, e)

    def close(self) -> None:
        self._pending.clear()
        self.layouts.clear()
        self._cleanup()  # waits for the writer, removes the directory (once)


def _write_file(final: Path, data: memoryview, sync: bool) -> None:
    """Write ``data`` to ``final`` atomically (a temporary name, then a rename): readers see no
    file or the whole file. ``sync``: to the device, so its pages can be dropped before reads."""
    final.parent.mkdir(parents=True, exist_ok=True)  # removed under us (a cleaner, an operator)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.stem}.", suffix=".tmp", dir=final.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _lock_path(root: Path) -> Path:
    return root.with_name(root.name + ".lock")


def _hold_lock(root: Path) -> int:
    """Take the lock that marks ``root`` as in use, for as long as this process lives (its fd is
    returned, closed by ``_remove_dir``). The lock file appears under its name already locked
    (locked under a temporary name, then renamed), so ``_remove_orphans`` never sees it free."""
    fd, tmp = tempfile.mkstemp(prefix=".keyserve-lock-", dir=root.parent)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.replace(tmp, _lock_path(root))
    except BaseException:
        os.close(fd)
        Path(tmp).unlink(missing_ok=True)
        raise
    return fd


def _remove_orphans(parent: Path, own: Path) -> None:
    """Remove the private directories in ``parent`` of processes that died without cleaning up:
    those whose lock file no live process holds. Best effort: an error skips the directory."""
    for lock in parent.glob("keyserve-prefix-*.lock"):
        root = lock.with_name(lock.name[: -len(".lock")])
        if root == own:
            continue
        try:
            fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue  # gone already (another tier removed it), or not ours to judge
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # held: a live engine's directory
        try:
            if not _still_at(fd, lock):
                continue  # removed (and maybe made again) meanwhile: not the file we locked
            log.info("prefix store: removing %s, left by a process that died", root)
            lock.unlink(missing_ok=True)  # first: then no new tier can be given this name and lose its lock
            shutil.rmtree(root, True)
        except OSError as e:
            log.warning("prefix store: could not remove %s: %s", root, e)
        finally:
            os.close(fd)


def _still_at(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        return os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
    except OSError:
        return False


def _remove_dir(writer: ThreadPoolExecutor | None, root: str, lock_fd: int) -> None:
    if writer is not None:
        writer.shutdown(wait=True, cancel_futures=True)
    shutil.rmtree(root, True)
    _lock_path(Path(root)).unlink(missing_ok=True)
    os.close(lock_fd)
