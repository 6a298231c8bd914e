"""Batch inference over an OpenAI batch-format JSONL file: resumable, and nothing is lost.

    python -m keyserve.cluster.batch_job --input in.jsonl --output out.jsonl
    keyserve batch --input in.jsonl --output out.jsonl --model /path/to/hf --max-num-seqs 32

Each input line is ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" |
"/v1/completions", "body": {...}}``; each gets exactly one final output line ``{"id",
"custom_id", "response": {"status_code", "request_id", "body"}, "error"}``. A permanent
failure (a bad line, a bad body, a prompt too long: 4xx) is that line's final record. A
transient one (408, 429, 5xx: the engine busy, a failed step, a timeout) is retried with
exponential backoff; if it still fails it is left without a record and the job exits 3, so a
rerun tries it again. A rerun skips lines that have their record, so any number of kills
(``kill -9`` included) and reruns end with exactly one record per line. A repeated
``custom_id`` is reported as an error under ``<custom_id>#line-<n>`` and never shadows the
first line with that id; a line without one under ``line-<n>`` (see ``batch_io``).
Exit status: 0 every line has its record, 2 bad arguments or the output is in use, 3 some
lines are left for a rerun.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keyserve.cluster.batch_io import DUPLICATE_CODE, InputLine, OutputBusyError, OutputLog, read_input
from keyserve.cluster.batch_retry import RetryPolicy, is_transient
from keyserve.cluster.cli_args import add_model_fields, flag_errors
from keyserve.cluster.errors import APIError, to_api_error
from keyserve.cluster.help_format import PlainHelpFormatter
from keyserve.cluster.json_body import loads_marked
from keyserve.cluster.openai_serving import OpenAIServing
from keyserve.config import ServeConfig
from keyserve.engine.async_engine import EngineDeadError

URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
# ServeConfig fields without a batch flag, and why; every engine field has one.
NO_FLAG = {
    "api_key": "no HTTP: the job calls the engine in its own process",
    "retry_after_s": "no HTTP clients to tell; the job retries transient failures itself",
    "max_queued_requests": "set from --concurrency (the requests the job keeps in flight)",
    "served_model_name": "records name the model the job loads",
    "request_timeout_s": "--timeout-s (default: none) sets it for the job",
}
EXIT_UNFINISHED = 3
# Nobody watches a batch job's tokens stream: decode in rounds of 4 steps (multi-step
# scheduling, core/multi_step.py), the orchestration paid once per round. The outputs are the
# same at any value; --num-scheduler-steps 1 turns it off.
BATCH_SCHEDULER_STEPS = 4


@dataclass
class BatchSummary:
    total: int = 0  # non-blank lines in the input
    skipped: int = 0  # already had their record
    succeeded: int = 0  # recorded with status 200
    failed: int = 0  # recorded with a permanent error
    unfinished: int = 0  # no record yet: a transient failure outlasted the retries, or the engine died
    retries: int = 0  # attempts after a transient failure
    seconds: float = 0.0


def _record(custom_id: str, status: int | None, body: dict | None, error: dict | None) -> dict:
    response = None
    if status is not None:
        request_id = body.get("id") if status == 200 and body else None
        response = {"status_code": status, "request_id": request_id, "body": body}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response,
            "error": error}


async def process_line(serving: Any, line: InputLine) -> dict:
    """One input line -> its output record (one attempt); never raises."""
    key, lineno = line.key, line.lineno
    if line.duplicate_of is not None:
        return _record(key, None, None, {"code": DUPLICATE_CODE, "message":
                       f"line {lineno}: custom_id repeats the one of line {line.duplicate_of}; "
                       f"this line is reported as {key!r} and was not run"})
    try:
        line.raw.encode("utf-8")
    except UnicodeEncodeError:
        return _record(key, None, None, {"code": "invalid_utf8", "message": f"line {lineno}: not UTF-8 text"})
    try:  # parsed as the server parses a body: check_json (in handle) reports what it marks
        obj = loads_marked(line.raw)
    except (json.JSONDecodeError, APIError) as e:  # APIError: nested too deep to parse
        return _record(key, None, None, {"code": "invalid_json", "message": f"line {lineno}: {e}"})
    if not isinstance(obj, dict) or not isinstance(obj.get("custom_id"), str) or not obj["custom_id"]:
        return _record(key, None, None, {"code": "missing_custom_id",
                                         "message": f"line {lineno}: needs a non-empty string custom_id"})
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
    except asyncio.CancelledError:
        if _cancelling():
            raise  # this job is being cancelled
        # An inner future was cancelled (e.g. the engine shut down under the request): transient.
        err = APIError(503, "the request was cancelled inside the engine", "server_error",
                       code="request_cancelled")
        return _record(key, err.status, err.body(), None)


def _cancelling() -> bool:
    """Whether the current task itself is being cancelled (Python 3.11+ can tell; before, assume so)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return cancelling is None or cancelling() > 0


def _engine_alive(serving: Any) -> bool:
    return bool(getattr(serving.engine, "is_alive", True))


def _describe(record: dict) -> str:
    response = record["response"]
    error = (response.get("body") or {}).get("error") or {}
    return f"{response['status_code']} {error.get('code') or ''}: {error.get('message', '')[:200]}"


async def settle(serving: Any, line: InputLine, policy: RetryPolicy, summary: BatchSummary,
                 stopping: asyncio.Event) -> dict | None:
    """The line's final record, or None when it must be left for a rerun (a transient
    failure outlasted ``policy``, or the engine is gone)."""
    for attempt in range(1, policy.max_attempts + 1):
        record = await process_line(serving, line)
        if not is_transient(record):
            return record
        if not _engine_alive(serving):
            stopping.set()
            print(f"batch: line {line.lineno} ({line.key!r}): the engine is gone "
                  f"({_describe(record)}); stopping, a rerun resumes", file=sys.stderr)
            return None
        if attempt == policy.max_attempts or stopping.is_set():
            print(f"batch: line {line.lineno} ({line.key!r}): {_describe(record)} "
                  f"after {attempt} attempt(s); left for a rerun", file=sys.stderr)
            return None
        summary.retries += 1
        await asyncio.sleep(policy.delay(attempt))
    return None


async def run_batch(serving: Any, input_path: Path, output: Path | OutputLog, concurrency: int,
                    progress: bool = True, policy: RetryPolicy = RetryPolicy()) -> BatchSummary:
    """Run every input line that has no final record in the output, ``concurrency`` at a time
    (``output``: a path, or an ``OutputLog`` the caller opened and closes)."""
    from tqdm.auto import tqdm

    start = time.monotonic()
    lines = read_input(input_path)
    with (OutputLog(output) if isinstance(output, Path) else nullcontext(output)) as log:
        if log.unreadable:
            print(f"batch: {log.path}: {log.unreadable} line(s) are not records; ignored",
                  file=sys.stderr)
        todo = [line for line in lines if not log.has(line)]
        summary = BatchSummary(total=len(lines), skipped=len(lines) - len(todo))
        bar = tqdm(total=len(lines), initial=summary.skipped, desc="batch", unit="req",
                   disable=not progress, mininterval=1.0, file=sys.stderr)
        slots = asyncio.Semaphore(concurrency)
        stopping = asyncio.Event()

        async def one(line: InputLine) -> None:
            try:
                record = await settle(serving, line, policy, summary, stopping)
                if record is None:
                    summary.unfinished += 1
                    return
                log.append(record)
                ok = record["error"] is None and record["response"]["status_code"] == 200
                summary.succeeded += ok
                summary.failed += not ok
                bar.update(1)
            finally:
                slots.release()

        tasks: set[asyncio.Task] = set()
        try:
            for i, line in enumerate(todo):
                await slots.acquire()
                if stopping.is_set():
                    slots.release()
                    summary.unfinished += len(todo) - i
                    break
                task = asyncio.create_task(one(line))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.gather(*tasks)
        finally:
            bar.close()
    summary.seconds = time.monotonic() - start
    return summary


def _positive_seconds(text: str) -> float:
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="keyserve batch", description=__doc__,
                                formatter_class=PlainHelpFormatter,
                                usage="keyserve batch [-h] --input INPUT --output OUTPUT [flags below]")
    p.add_argument("--input", required=True, type=Path, help="OpenAI batch-format JSONL")
    p.add_argument("--output", required=True, type=Path, help="results JSONL (appended; rerun resumes)")
    p.add_argument("--concurrency", type=_positive_int, default=None,
                   help="requests in flight (default: 2 x max_num_seqs)")
    p.add_argument("--timeout-s", type=_positive_seconds, default=None,
                   help="per-request limit; a timeout is transient (retried) (default: none)")
    p.add_argument("--max-attempts", type=int, default=RetryPolicy.max_attempts,
                   help="tries per line per run for transient failures (default: %(default)s)")
    p.add_argument("--retry-backoff-s", type=float, default=RetryPolicy.backoff_s,
                   help="wait before the 2nd try; doubles per try, capped at "
                        f"{RetryPolicy.max_backoff_s:g} s (default: %(default)s)")
    p.add_argument("--no-fsync", action="store_true",
                   help="do not fdatasync each record (a kill -9 still loses nothing; a power cut may)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(batch_flags=add_model_fields(p, ServeConfig, exclude=NO_FLAG, title="server",
                                                defaults={"num_scheduler_steps": BATCH_SCHEDULER_STEPS}))
    return p


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The job's ServeConfig: the model and engine flags, with --concurrency requests queued
    and --timeout-s per request."""
    kwargs = args.batch_flags.values(args)
    concurrency = args.concurrency or 2 * ServeConfig(**kwargs).max_num_seqs
    return ServeConfig(**kwargs, max_queued_requests=concurrency, request_timeout_s=args.timeout_s)


async def _main(args: argparse.Namespace, config: ServeConfig, policy: RetryPolicy) -> BatchSummary:
    concurrency = config.max_queued_requests
    with OutputLog(args.output, durable=not args.no_fsync) as log:  # locked before the model loads
        serving = OpenAIServing.from_config(config)
        try:
            try:
                await serving.engine.wait_ready()
            except EngineDeadError as e:  # it never started: a model that does not load, no Ray cluster
                raise ValueError(str(e)) from e
            return await run_batch(serving, args.input, log, concurrency, not args.no_progress, policy)
        finally:
            serving.engine.shutdown()


def _path_problem(input_path: Path, output: Path) -> str | None:
    """What is wrong with the input and output paths, if anything (checked before the model
    loads, so a typo costs nothing)."""
    if not input_path.exists():
        return f"input {input_path} does not exist"
    if not input_path.is_file():
        return f"input {input_path} is not a file"
    if not os.access(input_path, os.R_OK):
        return f"input {input_path} is not readable"
    if output.is_dir():
        return f"output {output} is a directory; give a file path"
    if output.exists() and os.path.samefile(input_path, output):
        return f"output {output} is the input file: give another path (records are appended to it)"
    parent = output.parent
    while not parent.exists():  # created on start: the nearest existing ancestor must allow it
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent if not output.exists() else output, os.W_OK):
        return f"output {output} cannot be written"
    return None


def main(argv: list[str] | None = None) -> int:
    from pydantic import ValidationError

    args = build_parser().parse_args(argv)
    problem = _path_problem(args.input, args.output)
    if problem is not None:  # before the model loads
        print(f"batch: {problem}", file=sys.stderr)
        return 2
    try:
        config = serve_config(args)
    except ValidationError as e:
        print(f"batch: invalid value: {flag_errors(e, args.batch_flags)}", file=sys.stderr)
        return 2
    try:
        policy = RetryPolicy(max_attempts=args.max_attempts, backoff_s=args.retry_backoff_s,
                             max_backoff_s=max(RetryPolicy.max_backoff_s, args.retry_backoff_s))
        summary = asyncio.run(_main(args, config, policy))
    except (ValidationError, ValueError, FileNotFoundError, OutputBusyError, ConnectionError) as e:
        print(f"batch: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"batch: interrupted; every record written to {args.output} is kept: run the same "
              "command again to finish", file=sys.stderr)
        return 130
    print(json.dumps({"input": str(args.input), "output": str(args.output), **summary.__dict__}), flush=True)
    if summary.unfinished:
        print(f"batch: {summary.unfinished} line(s) have no record yet (transient failures); "
              "run the same command again to retry them", file=sys.stderr)
        return EXIT_UNFINISHED
    return 0


if __name__ == "__main__":
    sys.exit(main())
