"""The batch job's two files: the input lines with the unique key each one is reported under,
and the output log, which a ``kill -9`` at any moment leaves readable.

Keys are a function of the whole input file (not of what finished first), so a rerun after a
crash computes the same keys and finds each line's record again:

- a line's key is its ``custom_id`` the first time that id appears;
- a later line with the same ``custom_id`` is a *duplicate*: it is reported under
  ``<custom_id>#line-<n>`` (``n`` its 1-based line number), never under the id it repeats;
- a line without a usable ``custom_id`` (bad JSON, missing, empty, not a string) is reported
  under ``line-<n>``;
- a synthetic key that happens to equal a ``custom_id`` of the file gets ``#2``, ``#3``, ...
  appended until it is unique.

The output is one JSON record per line, appended with a single ``write`` per record and
``fdatasync``-ed before the next, on a descriptor held under an exclusive ``flock`` (a second
job on the same output is refused). On open, a last line without its newline (the writer was
killed mid-write) is cut off, unless it is a whole record that only lacks the newline.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from dataclasses import dataclass
from pathlib import Path

from keyserve.cluster.errors import APIError
from keyserve.cluster.json_body import loads_marked

DUPLICATE_CODE = "duplicate_custom_id"


class OutputBusyError(RuntimeError):
    """Another process holds the output file (a second batch job on the same output)."""


@dataclass(frozen=True)
class InputLine:
    """One non-blank input line and the key its output record carries."""

    lineno: int  # 1-based line number in the input file
    raw: str  # the line as read (with its newline)
    key: str  # the custom_id of its output record; unique over the file
    duplicate_of: int | None = None  # line number of the first line with the same custom_id


def custom_id_of(raw: str) -> str | None:
    """The line's ``custom_id`` if it is a non-empty string in a JSON object, else None."""
    try:  # as process_line parses it: an int of > 4300 digits does not hide the custom_id
        obj = loads_marked(raw)
    except (ValueError, APIError):  # bad JSON; APIError: nested too deep to parse
        return None
    cid = obj.get("custom_id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) and cid else None


def read_input(path: Path) -> list[InputLine]:
    """Every non-blank line of ``path`` with its key (see the module docstring)."""
    # utf-8-sig: a byte-order mark (Windows editors write one) is not part of the first line
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as f:
        raw_lines = [(i, line) for i, line in enumerate(f, 1) if line.strip()]
    ids = [custom_id_of(raw) for _, raw in raw_lines]
    taken = {cid for cid in ids if cid is not None}
    first_line: dict[str, int] = {}
    out = []
    for (lineno, raw), cid in zip(raw_lines, ids):
        if cid is not None and cid not in first_line:
            first_line[cid] = lineno
            out.append(InputLine(lineno, raw, cid))
            continue
        base = f"{cid}#line-{lineno}" if cid is not None else f"line-{lineno}"
        key, n = base, 2
        while key in taken:
            key, n = f"{base}#{n}", n + 1
        taken.add(key)
        out.append(InputLine(lineno, raw, key, first_line.get(cid) if cid is not None else None))
    return out


def _record_mark(line: bytes) -> tuple[str, bool] | None:
    """(custom_id, is a duplicate_custom_id error) of one output line, None if unreadable."""
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError):  # bad JSON or UTF-8, or an int of > 4300 digits
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("custom_id"), str):
        return None
    if "response" not in rec or "error" not in rec:  # an input line, say, is not a record
        return None
    error = rec.get("error")
    return rec["custom_id"], isinstance(error, dict) and error.get("code") == DUPLICATE_CODE


class OutputLog:
    """The results file: locked, repaired on open, appended one durable record at a time."""

    def __init__(self, path: Path, durable: bool = True) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.durable = durable
        self.fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self.fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise OutputBusyError(f"another batch job is writing {path}") from None
            raise
        self.unreadable = 0  # whole lines that are not records (left in place, ignored)
        self._marks = self._scan()

    def _scan(self) -> set[tuple[str, bool]]:
        size = os.fstat(self.fd).st_size
        data = os.pread(self.fd, size, 0) if size else b""
        end = data.rfind(b"\n") + 1
        tail = data[end:]
        if tail:
            if _record_mark(tail) is not None:
                os.write(self.fd, b"\n")  # a whole record that only lacks its newline
                end = len(data)
            else:
                os.ftruncate(self.fd, end)  # torn by a kill mid-write: the line is redone
            os.fsync(self.fd)
        marks = set()
        for line in data[:end].splitlines():
            if not line.strip():
                continue
            mark = _record_mark(line)
            if mark is None:
                self.unreadable += 1
            else:
                marks.add(mark)
        return marks

    def has(self, line: InputLine) -> bool:
        """Whether ``line`` already has its final record. A ``duplicate_custom_id`` error counts
        only for a duplicate line, so one written under the original's id (by an older version)
        never stands in for the original."""
        return (line.key, line.duplicate_of is not None) in self._marks

    def append(self, record: dict) -> None:
        try:
            data = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (e.g. in a custom_id): \u-escape it
            data = (json.dumps(record) + "\n").encode("ascii")
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]
        if self.durable:
            os.fdatasync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.fsync(self.fd)
            os.close(self.fd)  # releases the lock
            self.fd = -1

    def __enter__(self) -> "OutputLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
