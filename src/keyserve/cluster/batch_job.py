"""Batch inference over an OpenAI batch-format JSONL file, resumable.

    ray job submit -- python -m keyserve.cluster.batch_job --input in.jsonl --output out.jsonl
    keyserve batch --input in.jsonl --output out.jsonl --model /path/to/hf --max-num-seqs 32

Each input line is ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" |
"/v1/completions", "body": {...}}``; each gets exactly one output line ``{"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error"}`` — an error (bad line, bad
body, prompt too long) is recorded on its line and the job goes on. Lines run concurrently
through one engine (continuous batching) and are written as they finish, each with one
``write`` to a file opened for appending, so a killed job leaves whole lines; a rerun skips
the ids already in the output (a torn last line is dropped and redone). A line without a
usable ``custom_id`` is reported under ``line-<n>`` (its 1-based line number).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keyserve.cluster.cli_args import add_model_fields, model_kwargs
from keyserve.cluster.help_format import PlainHelpFormatter
from keyserve.config import ServeConfig

URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
_NOT_FOR_BATCH = {"api_key", "retry_after_s", "max_queued_requests", "served_model_name", "request_timeout_s"}


@dataclass
class BatchSummary:
    total: int = 0  # lines in the input
    skipped: int = 0  # already in the output
    succeeded: int = 0
    failed: int = 0
    seconds: float = 0.0


def line_key(lineno: int, raw: str) -> str:
    """The custom_id of an input line, or ``line-<n>`` when it has no usable one."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError:
        return f"line-{lineno}"
    cid = obj.get("custom_id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) and cid else f"line-{lineno}"


def completed_ids(output: Path) -> set[str]:
    """custom_ids already written; truncates a torn (newline-less) last line first."""
    if not output.exists():
        return set()
    data = output.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with open(output, "r+b") as f:
            f.truncate(cut)
        data = data[:cut]
    ids = set()
    for line in data.splitlines():
        try:
            cid = json.loads(line).get("custom_id")
        except (json.JSONDecodeError, AttributeError):
            continue
        if isinstance(cid, str):
            ids.add(cid)
    return ids


class LineWriter:
    """Appends whole lines: one ``os.write`` per line on an O_APPEND descriptor."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict) -> None:
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]

    def close(self) -> None:
        os.fsync(self.fd)
        os.close(self.fd)


def _record(custom_id: str, status: int | None, body: dict | None, error: dict | None) -> dict:
    response = None
    if status is not None:
        request_id = body.get("id") if status == 200 and body else None
        response = {"status_code": status, "request_id": request_id, "body": body}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response,
            "error": error}


async def process_line(serving: Any, lineno: int, raw: str) -> dict:
    """One input line -> its output record; never raises."""
    from keyserve.cluster.errors import APIError, to_api_error

    key = line_key(lineno, raw)
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return _record(key, None, None, {"code": "invalid_json", "message": f"line {lineno}: {e}"})
    if not isinstance(obj, dict) or not isinstance(obj.get("custom_id"), str):
        return _record(key, None, None, {"code": "missing_custom_id",
                                         "message": f"line {lineno}: needs a string custom_id"})
    url, method, body = obj.get("url"), obj.get("method", "POST"), obj.get("body")
    if url not in URLS or str(method).upper() != "POST":
        return _record(key, None, None, {"code": "invalid_url", "message":
                       f"line {lineno}: url must be POST {' or '.join(URLS)}, got {method} {url}"})
    if isinstance(body, dict) and body.get("stream"):
        err = APIError(400, "stream is not supported in batch jobs", param="stream")
        return _record(key, err.status, err.body(), None)
    try:
        response = await serving.handle(URLS[url], body)
        return _record(key, 200, response, None)
    except APIError as e:
        return _record(key, e.status, e.body(), None)
    except Exception as e:  # noqa: BLE001 — a bug must cost one line, not the job
        err = to_api_error(e)
        return _record(key, err.status, err.body(), None)


async def run_batch(serving: Any, input_path: Path, output_path: Path, concurrency: int,
                    progress: bool = True) -> BatchSummary:
    """Process every input line not yet in the output, ``concurrency`` at a time."""
    from tqdm.auto import tqdm

    start = time.monotonic()
    done = completed_ids(output_path)
    with open(input_path, encoding="utf-8") as f:
        lines = [(i, line) for i, line in enumerate(f, 1) if line.strip()]
    todo = [(i, line) for i, line in lines if line_key(i, line) not in done]
    summary = BatchSummary(total=len(lines), skipped=len(lines) - len(todo))
    writer = LineWriter(output_path)
    bar = tqdm(total=len(lines), initial=summary.skipped, desc="batch", unit="req",
               disable=not progress, mininterval=1.0, file=sys.stderr)
    seen: set[str] = set()
    slots = asyncio.Semaphore(concurrency)

    async def one(lineno: int, raw: str) -> None:
        try:
            key = line_key(lineno, raw)
            if key in seen:  # a repeated custom_id: recorded as an error on its own line
                record = _record(key, None, None, {"code": "duplicate_custom_id",
                                                   "message": f"line {lineno}: custom_id {key!r} repeats"})
            else:
                seen.add(key)
                record = await process_line(serving, lineno, raw)
            writer.write(record)
            ok = record["error"] is None and record["response"]["status_code"] == 200
            summary.succeeded += ok
            summary.failed += not ok
            bar.update(1)
        finally:
            slots.release()

    tasks: set[asyncio.Task] = set()
    try:
        for lineno, raw in todo:
            await slots.acquire()
            task = asyncio.create_task(one(lineno, raw))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
    finally:
        bar.close()
        writer.close()
    summary.seconds = time.monotonic() - start
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m keyserve.cluster.batch_job", description=__doc__,
                                formatter_class=PlainHelpFormatter)
    p.add_argument("--input", required=True, type=Path, help="OpenAI batch-format JSONL")
    p.add_argument("--output", required=True, type=Path, help="results JSONL (appended; rerun resumes)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="requests in flight (default: 2 x max_num_seqs)")
    p.add_argument("--timeout-s", type=float, default=None, help="per-request limit (default: none)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_model_fields(p, ServeConfig, exclude=_NOT_FOR_BATCH)
    return p


async def _main(args: argparse.Namespace) -> BatchSummary:
    from keyserve.cluster.openai_serving import OpenAIServing

    kwargs = model_kwargs(args, ServeConfig)
    concurrency = args.concurrency or 2 * (kwargs.get("max_num_seqs") or 64)
    config = ServeConfig(**kwargs, max_queued_requests=concurrency, request_timeout_s=args.timeout_s)
    serving = OpenAIServing.from_config(config)
    try:
        await serving.engine.wait_ready()
        return await run_batch(serving, args.input, args.output, concurrency, not args.no_progress)
    finally:
        serving.engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    from pydantic import ValidationError

    args = build_parser().parse_args(argv)
    if not args.input.exists():
        print(f"batch: input {args.input} does not exist", file=sys.stderr)
        return 2
    try:
        summary = asyncio.run(_main(args))
    except (ValidationError, ValueError, FileNotFoundError) as e:
        print(f"batch: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"input": str(args.input), "output": str(args.output), **summary.__dict__}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
