"""``AsyncLLMEngine``: the in-process engine behind an asyncio interface.

The ``LLMEngine`` is not thread-safe, so one background thread owns it: it loads the model,
runs every engine call that callers submit (add, abort) between steps, and calls ``step()``
whenever there is work. Prompts are tokenised (chat templates applied) and length-checked on
a small tokenizer pool before they reach that thread, so a huge prompt stalls no stream. One step serves the whole batch; its outputs cross
to the event loop in one ``call_soon_threadsafe`` per step, not per token or per request.
Callers ``await add_request(...)`` (which raises the engine's validation errors) and then
iterate the returned stream of ``RequestOutput`` snapshots; the last one is finished.

The Ray tensor-parallel engine will expose this same interface.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from numbers import Integral
from typing import Any, TypeVar

from keyserve.config import EngineConfig
from keyserve.core.sampling_params import SamplingParams
from keyserve.engine.errors import PromptTooLongError, StepFailedError
from keyserve.engine.outputs import RequestOutput
from keyserve.engine.stats import EngineStats

log = logging.getLogger(__name__)
T = TypeVar("T")

# Threads that tokenise prompts and apply chat templates (never the engine thread).
TOKENIZER_THREADS = 2
# Consecutive failing steps after which the engine is declared dead (health turns 503).
MAX_CONSECUTIVE_STEP_FAILURES = 3


class QueueFullError(RuntimeError):
    """The bounded queue of waiting requests is full (HTTP 503 with Retry-After)."""


class RequestTimeoutError(TimeoutError):
    """The request ran past its deadline and was aborted (HTTP 408)."""


class EngineDeadError(RuntimeError):
    """The engine thread is gone or the model failed to load (HTTP 503)."""


class EngineStepError(RuntimeError):
    """A step raised; the requests in flight were aborted (HTTP 500), the engine lives on."""


@dataclass(eq=False)
class _RequestState:
    """One request as its consumer sees it; touched only on the event loop's thread."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    deadline: float | None  # loop.time() after which the request is aborted
    event: asyncio.Event = field(default_factory=asyncio.Event)
    latest: RequestOutput | None = None  # newest snapshot not yet handed out
    error: BaseException | None = None
    finished: bool = False  # the engine is done with it (finished, aborted or failed)
    closed: bool = False  # counted out of the admission limit


class AsyncLLMEngine:
    """Wraps an ``LLMEngine`` (built from ``config`` on the engine thread) for asyncio callers.

    ``max_queued_requests`` bounds the requests admitted beyond the ``max_num_seqs`` that can
    run at once; past it ``add_request`` raises ``QueueFullError``. ``request_timeout_s``
    (queueing included) aborts a request and raises ``RequestTimeoutError`` in its stream.
    ``on_finished`` is called on the event loop with every request's final output.
    """

    def __init__(
        self,
        config: EngineConfig | Callable[[], Any],
        *,
        max_queued_requests: int = 256,
        request_timeout_s: float | None = None,
        on_finished: Callable[[RequestOutput], None] | None = None,
        start: bool = True,
    ) -> None:
        if isinstance(config, EngineConfig):
            from keyserve.engine.llm_engine import LLMEngine

            self._factory: Callable[[], Any] = lambda: LLMEngine(config)
        else:
            self._factory = config
        self.max_queued_requests = max_queued_requests
        self.request_timeout_s = request_timeout_s
        self.on_finished = on_finished
        self.engine: Any = None  # the LLMEngine; only the engine thread may call into it
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], cf.Future | None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._ready = threading.Event()
        self._stopping = False
        self._dead: BaseException | None = None
        self._states: dict[str, _RequestState] = {}  # loop thread only
        self._loops: dict[str, asyncio.AbstractEventLoop] = {}  # engine thread only
        self._final_only: set[str] = set()  # requests that want their last snapshot alone (engine thread)
        self._stats = EngineStats()  # the engine's, published by the engine thread
        self._num_active = 0  # admitted and not yet finished (loop thread only)
        self._tokenizer_pool: cf.ThreadPoolExecutor | None = None  # made on first use
        self._thread = threading.Thread(target=self._run, name="keyserve-engine", daemon=True)
        if start:
            self.start()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if not self._thread.is_alive() and not self._ready.is_set() and self._dead is None:
            self._thread.start()

    @property
    def is_ready(self) -> bool:
        """The model is loaded and the engine thread is running."""
        return self._ready.is_set() and self.is_alive

    @property
    def is_alive(self) -> bool:
        """False once the engine thread has died (or failed to load the model)."""
        return self._dead is None and (self._thread.is_alive() or not self._ready.is_set())

    @property
    def dead_reason(self) -> BaseException | None:
        return self._dead

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait for the model to load; raise EngineDeadError if loading failed."""
        loop = asyncio.get_running_loop()
        ok = await loop.run_in_executor(None, self.wait_ready_blocking, timeout)
        if not ok:
            raise TimeoutError(f"engine not ready after {timeout} s")

    def wait_ready_blocking(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready.wait(0.1):
            if self._dead is not None:
                raise EngineDeadError(f"engine failed to start: {self._dead}") from self._dead
            if deadline is not None and time.monotonic() > deadline:
                return False
        if self._dead is not None:
            raise EngineDeadError(f"engine failed: {self._dead}") from self._dead
        return True

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still in flight fail with EngineDeadError."""
        self._stopping = True
        self._wake.set()
        if self._tokenizer_pool is not None:
            self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ------------------------------------------------------------ engine facts
    @property
    def max_model_len(self) -> int:
        return self._require_engine().max_model_len

    @property
    def tokenizer(self) -> Any:
        return self._require_engine().tokenizer

    @property
    def vocab_size(self) -> int:
        return self._require_engine().vocab_size

    @property
    def max_num_seqs(self) -> int:
        return self._require_engine().limits.max_num_seqs

    @property
    def has_draft(self) -> bool:
        return self._require_engine().limits.speculative

    def stats(self) -> EngineStats:
        """The engine's ``stats()`` as of its last step (the engine thread publishes it)."""
        return self._stats

    def _require_engine(self) -> Any:
        if self.engine is None:
            raise EngineDeadError("engine is not ready yet")
        return self.engine

    # ------------------------------------------------------------------ requests
    async def add_request(
        self,
        prompt: str | list[int] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        chat: bool = False,
        messages: list[dict[str, Any]] | None = None,
        prompt_token_ids: list[int] | None = None,
        timeout_s: float | None = None,
        final_only: bool = False,
    ) -> RequestStream:
        """Validate and queue a request; return its stream of snapshots (the last finished).
        ``final_only``: the stream gets the finished snapshot alone -- for a consumer that
        only wants the result (a non-streaming HTTP request), which then costs the event loop
        one wake-up instead of one per step, off the cores the engine computes on.

        Raises the engine's ValueError / PromptTooLongError / ValidationError for bad input,
        QueueFullError when the queue is full, EngineDeadError when the engine is gone.
        Leaving the stream early (break, cancellation, disconnect) aborts the request.
        """
        self._check_alive()
        if not self._ready.is_set():
            await self.wait_ready(timeout_s or self.request_timeout_s)
        if self._num_active >= self.max_num_seqs + self.max_queued_requests:
            raise QueueFullError(
                f"server is at capacity ({self.max_num_seqs} running + "
                f"{self.max_queued_requests} queued requests); retry later"
            )
        params = params or SamplingParams()
        loop = asyncio.get_running_loop()
        rid = request_id or f"req-{uuid.uuid4().hex}"
        if rid in self._states:
            raise ValueError(f"request id {rid!r} is already in use")
        timeout_s = timeout_s if timeout_s is not None else self.request_timeout_s
        state = _RequestState(rid, loop, None if timeout_s is None else loop.time() + timeout_s)
        self._states[rid] = state
        self._num_active += 1
        try:
            ids = await self._prompt_ids(prompt, chat, messages, prompt_token_ids)
            await self._call(_AddCommand(self, rid, loop, prompt, params, ids, final_only))
        except asyncio.CancelledError:
            self._close(state)
            # The engine thread may add it after all; commands run in order, so this follows.
            self._submit(lambda: self._abort_now(rid))
            raise
        except BaseException:
            self._close(state)
            raise
        return RequestStream(self, state)

    async def generate(
        self,
        prompt: str | list[int] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        chat: bool = False,
        messages: list[dict[str, Any]] | None = None,
        prompt_token_ids: list[int] | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """``add_request`` and iterate: one snapshot per step that advanced the request."""
        stream = await self.add_request(
            prompt, params, request_id, chat=chat, messages=messages,
            prompt_token_ids=prompt_token_ids, timeout_s=timeout_s,
        )
        async for out in stream:
            yield out

    async def abort(self, request_id: str) -> None:
        """Cancel a request and free its KV blocks (its stream ends with finish_reason abort)."""
        self._check_alive()
        await self._call(lambda: self._abort_now(request_id))

    async def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        return await self._tokenize(self._require_engine().apply_chat_template, messages)

    async def _prompt_ids(self, prompt: str | list[int] | None, chat: bool,
                          messages: list[dict[str, Any]] | None,
                          prompt_token_ids: list[int] | None) -> list[int]:
        """The prompt's token ids, tokenised (chat template included) on the tokenizer pool and
        checked against the context here: a multi-megabyte prompt costs the engine thread,
        and so every other request's step, nothing."""
        engine = self._require_engine()
        if messages is not None:
            ids = await self._tokenize(engine.apply_chat_template, messages)
        elif prompt_token_ids is not None:
            ids = _token_id_list(prompt_token_ids)
        elif isinstance(prompt, str):
            if not prompt:  # whitespace is text (it has tokens), as for OpenAI's API
                raise ValueError("prompt is empty")
            ids = await self._tokenize(engine.encode_prompt, prompt, chat)
        elif prompt is not None:
            ids = _token_id_list(prompt)
        else:
            raise ValueError("give a prompt, prompt token ids or chat messages")
        if not ids:
            raise ValueError("prompt is empty (no tokens)")
        if len(ids) >= engine.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens but the model's context is "
                f"{engine.max_model_len} tokens (at least one must remain for generation)"
            )
        vocab = engine.vocab_size
        if not all(isinstance(t, Integral) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return ids

    async def _tokenize(self, fn: Callable[..., list[int]], *args: Any) -> list[int]:
        """Run a tokenizer call on the tokenizer threads (the engine thread only steps)."""
        if self._tokenizer_pool is None:
            self._tokenizer_pool = cf.ThreadPoolExecutor(
                max_workers=TOKENIZER_THREADS, thread_name_prefix="keyserve-tokenizer"
            )
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    async def _stream(self, state: _RequestState) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                if state.latest is not None:
                    out, state.latest = state.latest, None
                    yield out
                    if out.finished:
                        return
                    continue
                if state.error is not None:
                    raise state.error
                if state.finished:
                    return
                state.event.clear()
                if state.deadline is None:
                    await state.event.wait()
                    continue
                remaining = state.deadline - state.loop.time()
                try:
                    if remaining <= 0:
                        raise asyncio.TimeoutError
                    await asyncio.wait_for(state.event.wait(), remaining)
                except asyncio.TimeoutError:
                    if state.latest is not None or state.finished:
                        continue  # it finished just in time
                    raise RequestTimeoutError(
                        f"request {state.request_id} exceeded the server's timeout and was aborted"
                    ) from None
        finally:
            self._release(state)

    def _release(self, state: _RequestState) -> None:
        """The consumer is done with the request: abort it if still running, count it out."""
        if not state.finished:
            state.finished = True
            self._submit(lambda: self._abort_now(state.request_id))
        self._close(state)

    def _close(self, state: _RequestState) -> None:
        if not state.closed:
            state.closed = True
            self._num_active -= 1
            self._states.pop(state.request_id, None)

    # -------------------------------------------------- crossing to the thread
    def _check_alive(self) -> None:
        if self._dead is not None or self._stopping:
            raise EngineDeadError(f"engine is not running: {self._dead or 'shut down'}")

    def _submit(self, fn: Callable[[], Any], future: cf.Future | None = None) -> None:
        self._commands.put((fn, future))
        self._wake.set()

    async def _call(self, fn: Callable[[], T]) -> T:
        future: cf.Future = cf.Future()
        self._submit(fn, future)
        return await asyncio.wrap_future(future)

    # ------------------------------------------------------ the engine thread
    def _run(self) -> None:
        try:
            self.engine = self._factory()
        except BaseException as e:  # noqa: BLE001 — reported through wait_ready / health
            log.exception("engine failed to load")
            self._dead = e
            return
        self._publish_stats()
        self._ready.set()
        failures = stalled = 0
        flush = getattr(self.engine, "flush", None)  # the Ray engine batches messages to its actors
        try:
            while not self._stopping:
                self._wake.clear()
                ran = self._run_commands()
                if not self.engine.has_unfinished_requests():
                    if ran and flush is not None:  # e.g. an abort's frees, with no step to carry them
                        flush()
                        self._publish_stats()
                    self._wake.wait(0.5)
                    continue
                try:
                    outputs = self.engine.step()
                    failures = 0
                except Exception as e:  # noqa: BLE001 — isolate the failure to these requests
                    # One request's own fault never gets here: the engine fails it alone inside
                    # the step (its output's ``error``). This is a fault of the step itself.
                    failures += 1
                    log.exception("engine step failed (%d in a row)", failures)
                    self._fail_step(e)
                    if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                        raise
                    continue
                self._publish_stats()  # first: whoever sees a request finish sees its blocks freed
                # Two empty steps with nothing running: what waits can never be admitted.
                stalled = stalled + 1 if not outputs and not self._stats.num_requests_running else 0
                if stalled >= 2:
                    self._fail_unschedulable()
                    stalled = 0
                self._deliver(outputs, publish=False)
        except BaseException as e:  # noqa: BLE001
            log.exception("engine thread died")
            self._dead = e
        finally:
            reason = self._dead or EngineDeadError("engine shut down")
            self._drain_commands(reason)
            self._fail_all(EngineDeadError(f"engine stopped: {reason}"), abort=False)
            close = getattr(self.engine, "shutdown", None)  # the Ray engine's actors
            if close is not None:
                try:
                    close()
                except Exception:  # noqa: BLE001
                    log.exception("engine shutdown failed")

    def _run_commands(self) -> bool:
        """Run the queued calls; True if there were any."""
        ran = False
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return ran
            ran = True
            if future is not None and not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001 — goes back to the caller
                if future is not None:
                    future.set_exception(e)
                else:
                    log.exception("engine command failed")
                continue
            if future is not None:
                future.set_result(result)

    def _drain_commands(self, reason: BaseException) -> None:
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError(f"engine stopped: {reason}"))

    def _abort_now(self, request_id: str) -> None:
        out = self.engine.abort(request_id)
        self._deliver([out] if out is not None else [])

    def _deliver(self, outputs: list[RequestOutput], publish: bool = True) -> None:
        """Publish the stats (unless just published), then hand a step's outputs to their
        event loops: one wake-up per loop per step. (Stats first: whoever sees a request finish
        sees its blocks freed.) A request that failed alone in the step (``out.error``) gets
        its error instead."""
        by_loop: dict[asyncio.AbstractEventLoop, list[RequestOutput]] = {}
        failed: list[tuple[str, asyncio.AbstractEventLoop, BaseException, RequestOutput]] = []
        for out in outputs:
            if not out.finished and out.request_id in self._final_only:
                continue
            loop = self._loops.get(out.request_id)
            if out.finished:
                self._loops.pop(out.request_id, None)
                self._final_only.discard(out.request_id)
                if out.error is not None:
                    if loop is not None:
                        failed.append((out.request_id, loop, out.error, out))
                    continue
            if loop is not None:
                by_loop.setdefault(loop, []).append(out)
        if publish:
            self._publish_stats()
        for rid, loop, error, out in failed:
            self._fail(rid, loop, error, out)
        for loop, outs in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._on_outputs, outs)
            except RuntimeError:  # that loop is closed: nobody is listening
                for out in outs:
                    if not out.finished:
                        self.engine.abort(out.request_id)

    def _fail_step(self, error: Exception) -> None:
        """A step raised. ``StepFailedError``: the engine aborted the requests that step ran
        and recovered; only they fail. Anything else (another engine, a fault before the
        engine could recover): every request in flight fails."""

        if not isinstance(error, StepFailedError):
            self._fail_all(EngineStepError(f"engine step failed: {error!r}"))
            return
        failure = EngineStepError(str(error))
        try:
            self._publish_stats()
        except Exception:  # noqa: BLE001 — the errors must still go out
            log.exception("stats after a failed step")
        finals = {out.request_id: out for out in error.outputs}
        for rid in error.request_ids:
            loop = self._loops.get(rid)
            if loop is not None:
                self._fail(rid, loop, failure, finals.get(rid))

    def _fail_all(self, error: BaseException, abort: bool = True) -> None:
        """Abort every request in flight and raise ``error`` in their streams."""
        doomed = list(self._loops.items())
        finals: dict[str, RequestOutput | None] = {}
        for rid, _ in doomed:
            if abort and self.engine is not None:
                try:
                    finals[rid] = self.engine.abort(rid)
                except Exception:  # noqa: BLE001
                    log.exception("abort of %s failed", rid)
        if self.engine is not None:
            try:
                self._publish_stats()
            except Exception:  # noqa: BLE001 — the engine may be broken; the errors must still go out
                log.exception("stats after a failure")
        for rid, loop in doomed:
            self._fail(rid, loop, error, finals.get(rid))

    def _fail_unschedulable(self) -> None:
        """Nothing runs and nothing could be scheduled (the engine fails a request that can
        never fit itself, ``LLMEngine._fail_unschedulable``; this is the safety net): the first
        waiting request fails, so those behind it can be admitted."""
        doomed = [(rid, self._loops.get(rid)) for rid in self.engine.waiting_request_ids()[:1]]
        finals = {rid: self.engine.abort(rid) for rid, _ in doomed}
        self._publish_stats()
        st = self._stats
        for rid, loop in doomed:
            if loop is not None:
                self._fail(rid, loop, ValueError(
                    f"request {rid} cannot be scheduled: it needs more KV blocks than the pool "
                    f"holds ({st.num_blocks} blocks of {st.block_size} tokens)"
                ), finals[rid])

    def _fail(self, rid: str, loop: asyncio.AbstractEventLoop, error: BaseException,
              out: RequestOutput | None = None) -> None:
        """Fail ``rid``'s stream with ``error``; ``out``, its final output if the engine gave
        one, still reaches ``on_finished`` (a failed request counts in the metrics)."""
        self._loops.pop(rid, None)
        self._final_only.discard(rid)
        if out is not None and out.error is None:
            out.error = error
        try:
            loop.call_soon_threadsafe(self._on_error, rid, error, out)
        except RuntimeError:
            pass

    def _publish_stats(self) -> None:
        self._stats = self.engine.stats()

    # ------------------------------------------------- back on the event loop
    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                self._observe_finished(out)
            state = self._states.get(out.request_id)
            if state is None:
                continue
            state.latest = out
            state.event.set()
            if out.finished:  # counted out now, even if nobody reads the stream any more
                state.finished = True
                self._close(state)

    def _observe_finished(self, out: RequestOutput) -> None:
        if self.on_finished is not None:
            try:
                self.on_finished(out)
            except Exception:  # noqa: BLE001 — metrics must never break a request
                log.exception("on_finished callback failed")

    def _on_error(self, request_id: str, error: BaseException, out: RequestOutput | None = None) -> None:
        if out is not None:
            self._observe_finished(out)
        state = self._states.get(request_id)
        if state is not None:
            state.error = error
            state.finished = True
            state.event.set()
            self._close(state)


def _token_id_list(ids: Any) -> list[Any]:
    """A prompt given as token ids, as a list (checked by the caller). Bytes and mappings are
    refused: listed, they would be byte values and keys, not token ids."""
    if isinstance(ids, (str, bytes, bytearray, Mapping)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"a prompt is text or a list of token ids, not {type(ids).__name__}")
    return list(ids)


class RequestStream:
    """The snapshots of one request, as an async iterator; ``aclose()`` (or leaving an
    ``async for`` early, or cancellation) aborts the request if it is still running."""

    def __init__(self, owner: AsyncLLMEngine, state: _RequestState) -> None:
        self._owner = owner
        self._state = state
        self._gen = owner._stream(state)

    @property
    def request_id(self) -> str:
        return self._state.request_id

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        self._owner._release(self._state)
        await self._gen.aclose()


class _AddCommand:
    """Runs on the engine thread: check the (already tokenised) request fits the pool, add it."""

    def __init__(self, owner: AsyncLLMEngine, rid: str, loop: asyncio.AbstractEventLoop,
                 prompt: str | list[int] | None, params: SamplingParams, ids: list[int],
                 final_only: bool = False) -> None:
        self.owner, self.rid, self.loop = owner, rid, loop
        self.prompt, self.params, self.ids, self.final_only = prompt, params, ids, final_only

    def __call__(self) -> None:
        engine = self.owner.engine
        prompt, ids = self.prompt, self.ids
        pool = self.owner.stats()  # the pool's size and block size never change
        needed = math.ceil((len(ids) + 1) / pool.block_size) + self.params.n - 1
        if 0 < len(ids) < engine.max_model_len and needed > pool.num_blocks:
            raise ValueError(
                f"the prompt ({len(ids)} tokens, n={self.params.n}) needs {needed} KV blocks but "
                f"the server's pool has {pool.num_blocks}"
            )
        self.owner._loops[self.rid] = self.loop
        if self.final_only:
            self.owner._final_only.add(self.rid)
        try:
            engine.add_request(
                prompt if isinstance(prompt, str) else ids, self.params,
                request_id=self.rid, prompt_token_ids=ids,
            )
        except BaseException:
            self.owner._loops.pop(self.rid, None)
            self.owner._final_only.discard(self.rid)
            raise
