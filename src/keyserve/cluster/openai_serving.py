"""OpenAI requests -> engine requests -> OpenAI responses, independent of the transport.

The HTTP app and the batch job both call ``OpenAIServing.handle(kind, body)``: it returns a
response dict, or (``stream: true``) an async iterator of server-sent-event strings that has
already waited for the first token, so errors up to that point still become an HTTP status.
Every failure leaves as an ``APIError``. The bounds that depend on the loaded model (context
length, vocabulary, seats) are checked here, before anything reaches the engine thread.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from keyserve.cluster.errors import APIError, bad_request, to_api_error
from keyserve.cluster.json_body import check_json
from keyserve.cluster.metrics import ServerMetrics
from keyserve.cluster.openai_protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    Usage,
)
from keyserve.cluster.token_bytes import TokenBytes
from keyserve.config import EngineConfig, ServeConfig
from keyserve.core.prompt_context import prompt_context
from keyserve.core.sampling_params import SamplingParams
from keyserve.engine.async_engine import AsyncLLMEngine, RequestStream
from keyserve.engine.outputs import CompletionOutput, RequestOutput

Kind = Literal["completions", "chat"]
DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel | dict) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


def _finish(reason: str | None) -> Literal["stop", "length"] | None:
    return reason if reason in ("stop", "length") else None  # type: ignore[return-value]


@dataclass
class _Tracker:
    """What one choice has already sent; holds back a possible stop-string prefix. A token
    counts as sent (its logprob with it) only once a chunk carries it: a chunk held back whole
    (its text could start a stop string, or its bytes are not yet a character) passes its
    tokens on to the next one sent."""

    holdback: int
    sent_chars: int = 0
    sent_tokens: int = 0
    token_chars: int = 0  # text_offset of the next token: the echo plus earlier tokens' text
    started: bool = False
    done: bool = False

    def advance(self, o: CompletionOutput) -> tuple[str, int, list[float] | None, str | None]:
        """(new text, index of the first token not sent yet, their logprobs, finish reason if
        new). Call ``sent`` once a chunk carries them."""
        end = len(o.text) if o.finish_reason else max(self.sent_chars, len(o.text) - self.holdback)
        delta = o.text[self.sent_chars:end]
        self.sent_chars = max(self.sent_chars, end)
        start = self.sent_tokens
        lps = o.logprobs[start:] if o.logprobs is not None else None
        finish = None
        if o.finish_reason and not self.done:
            self.done = True
            finish = o.finish_reason
        return delta, start, lps, finish

    def sent(self, o: CompletionOutput) -> None:
        self.sent_tokens = len(o.token_ids)


def ray_engine_wanted(config: EngineConfig) -> bool:
    """Whether a server or batch job runs the Ray engine: at any tensor-parallel size when this
    process is on Ray (a Serve replica, a ``ray job submit`` driver, ``$RAY_ADDRESS`` set) or
    asked for it (``tp > 1``, an address). The prefix store exists in the in-process engine only."""
    if config.parallel.uses_ray:
        return True
    if config.prefix_store.enabled:
        return False
    import ray  # the serving layer runs on Ray

    return ray.is_initialized() or bool(os.environ.get("RAY_ADDRESS"))


class OpenAIServing:
    """Serves OpenAI completions / chat requests with one ``AsyncLLMEngine``."""

    def __init__(self, engine: AsyncLLMEngine, config: ServeConfig, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.config = config
        self.model_name = config.model_name()
        self.metrics = metrics

    @classmethod
    def from_config(cls, config: ServeConfig, in_process: bool = False) -> "OpenAIServing":
        """Start an engine (loading in its thread) with metrics wired to it: the Ray engine
        (target group, draft actor, KV-block manager actor) wherever Ray runs, else -- or with
        ``in_process`` (``keyserve serve --no-ray``) -- the in-process engine, behind the same
        async front."""
        engine_config = config.engine_config()
        limits = {"max_queued_requests": config.max_queued_requests, "request_timeout_s": config.request_timeout_s}
        if not in_process and ray_engine_wanted(engine_config):
            from keyserve.actors.ray_engine import AsyncRayEngine

            engine = AsyncRayEngine(engine_config, **limits)
        else:
            engine = AsyncLLMEngine(engine_config, **limits)
        metrics = ServerMetrics(engine.stats, config.model_name())
        engine.on_finished = metrics.observe_finished
        return cls(engine, config, metrics)

    def models(self) -> dict:
        return ModelList(data=[self._card()]).model_dump()

    def model(self, model_id: str) -> dict:
        """The card of ``model_id`` (``GET /v1/models/{id}``); 404 for any other id."""
        if model_id != self.model_name:
            raise APIError(404, f"The model `{model_id}` does not exist; this server serves "
                           f"`{self.model_name}`.", param="model", code="model_not_found")
        return self._card().model_dump()

    def _card(self) -> ModelCard:
        max_len = self.engine.max_model_len if self.engine.is_ready else None
        return ModelCard(id=self.model_name, max_model_len=max_len)

    # ------------------------------------------------------------------ entry
    async def handle(self, kind: Kind, body: Any, checked: bool = False) -> dict | AsyncIterator[str]:
        """One request body -> a response dict, or a primed SSE iterator if it streams.
        ``checked``: the body already passed ``json_body.check_json`` (the HTTP path)."""
        prompt_param = "messages" if kind == "chat" else "prompt"
        rename: dict[str, str] = {}
        try:
            if not checked:
                check_json(body)
            req = self._parse(kind, body)
            if kind == "chat":
                rename = {"max_tokens": req.max_tokens_param()}
            if not self.engine.is_ready:
                state = "is still loading" if self.engine.is_alive else "is not running"
                raise APIError(503, f"the model {state}; retry later", "server_error",
                               code="engine_unavailable", headers={"Retry-After": "5"})
            params = self._fit_to_model(req, req.to_sampling_params(self.engine.max_model_len))
            rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
            streams = await self._start(kind, req, params, rid)
            if req.stream:
                return await _primed(self._guard(self._chunks(kind, req, params, rid, streams)))
            return await self._collect(kind, req, rid, streams)
        except BaseException as e:
            if isinstance(e, (asyncio.CancelledError, KeyboardInterrupt, SystemExit)):
                raise
            raise to_api_error(e, prompt_param, self.config.retry_after_s, rename) from e

    def _parse(self, kind: Kind, body: Any) -> CompletionRequest | ChatCompletionRequest:
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        model_cls = ChatCompletionRequest if kind == "chat" else CompletionRequest
        try:
            req = model_cls.model_validate(body)
        except ValidationError as e:
            raise to_api_error(e) from None
        for param, message in req.unsupported():
            raise bad_request(message, param)
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"The model `{req.model}` does not exist; this server serves "
                           f"`{self.model_name}`.", param="model", code="model_not_found")
        if kind == "completions" and (req.prompt == [] or req.prompt == [[]]):
            raise bad_request("prompt must not be empty", "prompt")
        return req

    def _fit_to_model(self, req: Any, params: SamplingParams) -> SamplingParams:
        """The bounds the loaded model sets: 400 naming the field, or (top_k) a clamp that
        keeps the meaning (a k at or above the vocabulary keeps every token)."""
        max_len, vocab = self.engine.max_model_len, self.engine.vocab_size
        if params.max_tokens > max_len:
            raise bad_request(f"{req.max_tokens_param()}={params.max_tokens} exceeds the model's "
                              f"context length of {max_len} tokens", req.max_tokens_param())
        if params.kv_budget is not None and params.kv_budget > max_len:
            raise bad_request(f"kv_budget={params.kv_budget:g} tokens exceeds the model's context "
                              f"length of {max_len} tokens", "kv_budget")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise bad_request(f"stop_token_ids must lie in [0, {vocab}); got {bad[0]}", "stop_token_ids")
        prompts = getattr(req, "prompt", None)
        if isinstance(prompts, list) and prompts and not isinstance(prompts[0], int):
            seats = self.engine.max_num_seqs + self.engine.max_queued_requests
            if len(prompts) > seats:
                raise bad_request(f"{len(prompts)} prompts exceed what the server can hold at once "
                                  f"({seats})", "prompt")
        if params.top_k > vocab:
            params = params.model_copy(update={"top_k": vocab})
        return params

    async def _start(self, kind: Kind, req: Any, params: SamplingParams, rid: str) -> list[RequestStream]:
        """Queue one engine request per prompt; undo them all if any fails."""
        if kind == "chat":
            jobs: list[dict[str, Any]] = [{"messages": [m.as_template_dict() for m in req.messages]}]
        else:
            prompts = req.prompt
            if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
                prompts = [prompts]
            jobs = [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
        streams: list[RequestStream] = []
        try:
            for i, job in enumerate(jobs):
                streams.append(await self.engine.add_request(params=params, request_id=f"{rid}-{i}",
                                                             final_only=not req.stream, **job))
        except BaseException:
            for s in streams:
                await s.aclose()
            raise
        return streams

    # --------------------------------------------------------- non-streaming
    async def _collect(self, kind: Kind, req: Any, rid: str, streams: list[RequestStream]) -> dict:
        finals: list[RequestOutput | None] = [None] * len(streams)
        async for i, out in _merge(streams):
            if out.finished:
                finals[i] = out
        done = [f for f in finals if f is not None]
        usage = _usage(done)
        n = req.n
        if kind == "chat":
            choices = [
                ChatChoice(index=o.index, message=ChatResponseMessage(content=o.text),
                           logprobs=(self._chat_logprobs(done[0].prompt_token_ids, o.token_ids, 0, o.logprobs,
                                                         o.top_logprobs)
                                     if req.logprobs else None),
                           finish_reason=_finish(o.finish_reason))
                for o in done[0].outputs
            ]
            return ChatCompletionResponse(id=rid, model=self.model_name, choices=choices, usage=usage,
                                          prompt_logprobs=self._prompt_logprobs(req, done[0])).model_dump()
        completion_choices = []
        for i, out in enumerate(done):
            prefix = self._echo(req, out)
            # the prompt's entries, once for all its samples
            echoed = self._echoed_logprobs(req, out) if req.echo and req.logprobs is not None else None
            prompt_lp = self._prompt_logprobs(req, out)
            for o in out.outputs:
                lp = (self._completion_logprobs(out.prompt_token_ids, o.token_ids, 0, o.logprobs, len(prefix),
                                                o.top_logprobs)
                      if o.logprobs is not None else None)
                if lp is not None and echoed is not None:
                    lp = echoed.followed_by(lp)
                completion_choices.append(CompletionChoice(
                    index=i * n + o.index, text=prefix + o.text, logprobs=lp,
                    finish_reason=_finish(o.finish_reason), prompt_logprobs=prompt_lp))
        return CompletionResponse(id=rid, model=self.model_name, choices=completion_choices, usage=usage).model_dump()

    # ------------------------------------------------------------- streaming
    async def _chunks(self, kind: Kind, req: Any, params: SamplingParams, rid: str,
                      streams: list[RequestStream]) -> AsyncIterator[str]:
        created = int(time.time())
        holdback = max((len(s) for s in params.stop), default=1) - 1
        trackers: dict[int, _Tracker] = {}
        finals: list[RequestOutput | None] = [None] * len(streams)
        usage_field = {"usage": None} if req.include_usage else {}
        latest: list[RequestOutput | None] = [None] * len(streams)
        async for i, out in _merge(streams):
            if out.finished:
                finals[i] = out
            if req.continuous_usage:  # the usage so far rides in every chunk of this snapshot
                latest[i] = out
                usage_field = {"usage": _usage([o for o in latest if o is not None])}
            for o in out.outputs:
                index = i * req.n + o.index
                t = trackers.setdefault(index, _Tracker(holdback))
                if not t.started and not out.finished and _prompt_logprobs_pending(out):
                    continue  # an echo with logprobs goes out whole: its prompt is still running
                first = not t.started
                t.started = True
                delta, start, lps, finish = t.advance(o)
                new_tokens = len(o.token_ids) > start
                if kind == "chat":
                    if first:
                        yield sse(ChatCompletionChunk(
                            id=rid, created=created, model=self.model_name, **usage_field,
                            choices=[ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))]))
                    if not delta and not finish:
                        continue  # its tokens go out with the next chunk
                    t.sent(o)
                    tops = o.top_logprobs[start:] if o.top_logprobs is not None else None
                    logprobs = (self._chat_logprobs(out.prompt_token_ids, o.token_ids, start, lps, tops)
                                if req.logprobs and new_tokens else None)
                    yield sse(ChatCompletionChunk(
                        id=rid, created=created, model=self.model_name, **usage_field,
                        choices=[ChatChunkChoice(index=index, delta=DeltaMessage(content=delta or None),
                                                 logprobs=logprobs, finish_reason=_finish(finish))]))
                else:
                    prefix = self._echo(req, out) if first else ""
                    t.token_chars += len(prefix)
                    if not (delta or finish or prefix):
                        continue  # its tokens go out with the next chunk
                    t.sent(o)
                    logprobs = None
                    if lps is not None and new_tokens:
                        tops = o.top_logprobs[start:] if o.top_logprobs is not None else None
                        logprobs = self._completion_logprobs(out.prompt_token_ids, o.token_ids, start, lps,
                                                             t.token_chars, tops)
                        t.token_chars = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                    if first and req.echo and lps is not None:  # the echoed prompt's tokens: first chunk
                        echoed = self._echoed_logprobs(req, out)
                        logprobs = echoed if logprobs is None else echoed.followed_by(logprobs)
                    yield sse(CompletionResponse(
                        id=rid, created=created, model=self.model_name, **usage_field,
                        choices=[CompletionChoice(index=index, text=prefix + delta, logprobs=logprobs,
                                                  finish_reason=_finish(finish))]))
        if req.include_usage:
            usage = _usage([f for f in finals if f is not None])
            cls = ChatCompletionChunk if kind == "chat" else CompletionResponse
            yield sse(cls(id=rid, created=created, model=self.model_name, choices=[], usage=usage))
        yield DONE

    async def _guard(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """Errors after the first chunk: an error event, then [DONE] (the status is sent);
        before it they propagate, to become the response's status."""
        sent = False
        try:
            async for chunk in chunks:
                sent = True
                yield chunk
        except Exception as e:  # noqa: BLE001
            if not sent:
                raise
            err = to_api_error(e, retry_after_s=self.config.retry_after_s)
            if self.metrics is not None:  # the 200 is sent: count the failure by its own status
                self.metrics.observe_rejected(err.status)
            yield sse(err.body())
            yield DONE
        finally:
            await chunks.aclose()

    # ----------------------------------------------------------- formatting
    def _echo(self, req: Any, out: RequestOutput) -> str:
        if not getattr(req, "echo", False):
            return ""
        if out.prompt is not None:
            return out.prompt
        # token ids: their text without special tokens, as generated text is (so an echo with
        # logprobs is spelled by its tokens' entries: a BOS adds nothing)
        return self.engine.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=True)

    def _contexts(self, prompt_ids: list[int], token_ids: list[int], start: int) -> list[tuple[list[int], str]]:
        """Per token from ``start``: the few tokens before it and their text, which the text a
        token (or an alternative in its place) adds is decoded after (so word-initial spaces
        survive, as in the generated text: the first tokens' context is the prompt's, as the
        detokenizer's, ``prompt_context``)."""
        tok = self.engine.tokenizer
        head = prompt_context(tok, prompt_ids) if prompt_ids and start < 4 else []  # first 4 only
        out = []
        for i in range(start, len(token_ids)):
            ctx = token_ids[max(0, i - 4):i] if i >= 4 else head + token_ids[:i]
            out.append((ctx, tok.decode(ctx, skip_special_tokens=True) if ctx else ""))
        return out

    def _piece(self, context: tuple[list[int], str], token: int) -> str:
        """The text ``token`` adds after ``context``, without special tokens, as the text is (a
        special token adds nothing, so later ``text_offset``s still point into the text)."""
        ctx, before = context
        return self.engine.tokenizer.decode(ctx + [token], skip_special_tokens=True)[len(before):]

    def _completion_logprobs(self, prompt_ids: list[int], token_ids: list[int], start: int,
                             logprobs: list[float | None] | None, offset: int,
                             tops: list[list[tuple[int, float]] | None] | None = None) -> CompletionLogprobs:
        """``tops``: each token's alternatives from ``start`` (``CompletionOutput.top_logprobs``),
        sent as OpenAI does: text -> logprob, the chosen token's too (up to N + 1 entries; two
        tokens of one text keep the likelier). A None entry (an echoed prompt's first token, which
        has no context) stays null."""
        contexts = self._contexts(prompt_ids, token_ids, start)
        strings = [self._piece(c, t) for c, t in zip(contexts, token_ids[start:])]
        offsets = []
        for s in strings:
            offsets.append(offset)
            offset += len(s)
        top = None
        if tops is not None:
            top = []
            for context, alternatives, chosen, lp in zip(contexts, tops, strings, logprobs or []):
                if alternatives is None:
                    top.append(None)
                    continue
                entry: dict[str, float] = {}
                for token, value in alternatives:
                    entry.setdefault(self._piece(context, token), value)
                entry.setdefault(chosen, lp)
                top.append(entry)
        return CompletionLogprobs(tokens=strings, token_logprobs=list(logprobs or []), top_logprobs=top,
                                  text_offset=offsets)

    def _prompt_logprobs(self, req: Any, out: RequestOutput) -> PromptLogprobs | None:
        """vLLM's ``prompt_logprobs`` (when the request asked): per prompt token after the first,
        token id -> {logprob, rank, decoded_token} for the token itself and its N likeliest
        alternatives (ranks 1..N), each decoded in the tokens before it."""
        count = getattr(req, "prompt_logprobs", None)
        if count is None or out.prompt_logprobs is None:
            return None
        ids = out.prompt_token_ids
        contexts = self._contexts([], ids, 0)
        tops = out.prompt_top_logprobs or [None] * len(ids)
        ranks = out.prompt_logprob_ranks or [None] * len(ids)
        entries: PromptLogprobs = []
        for token, context, lp, rank, top in zip(ids, contexts, out.prompt_logprobs, ranks, tops):
            if lp is None:
                entries.append(None)
                continue
            entry = {str(t): PromptLogprob(logprob=v, rank=r, decoded_token=self._piece(context, t))
                     for r, (t, v) in enumerate((top or [])[:count], 1)}
            entry.setdefault(str(token), PromptLogprob(logprob=lp, rank=rank, decoded_token=self._piece(context, token)))
            entries.append(entry)
        return entries

    def _echoed_logprobs(self, req: Any, out: RequestOutput) -> CompletionLogprobs:
        """The echoed prompt's entries (``RequestOutput.prompt_logprobs``): each prompt token's
        text, offset into the echo and log-probability, null for the first (it has no context),
        as OpenAI's echo with logprobs; the ``logprobs`` N alternatives where N > 0."""
        prompt_ids = out.prompt_token_ids
        lps = out.prompt_logprobs or [None] * len(prompt_ids)
        tops = None
        if req.logprobs and out.prompt_top_logprobs is not None:  # the request's N of the engine's
            tops = [t if t is None else t[: req.logprobs] for t in out.prompt_top_logprobs]
        # the prompt's own tokens before each token give its text, as a generated token's do
        return self._completion_logprobs([], prompt_ids, 0, lps, 0, tops)

    def _token_bytes(self) -> TokenBytes:
        """The tokenizer's ``TokenBytes`` (built once: it reads the tokenizer's decoder)."""
        cached = getattr(self, "_token_bytes_cache", None)
        if cached is None or cached.tokenizer is not self.engine.tokenizer:
            cached = self._token_bytes_cache = TokenBytes(self.engine.tokenizer)
        return cached

    def _chat_logprobs(self, prompt_ids: list[int], token_ids: list[int], start: int,
                       logprobs: list[float] | None,
                       tops: list[list[tuple[int, float]]] | None = None) -> ChatLogprobs:
        """``tops``: each token's alternatives from ``start``, as ``top_logprobs`` entries."""
        token_bytes = self._token_bytes()
        contexts = self._contexts(prompt_ids, token_ids, start)
        entries = []
        for i, (context, t, lp) in enumerate(zip(contexts, token_ids[start:], logprobs or [])):
            s = self._piece(context, t)
            alternatives = []
            for token, value in (tops[i] if tops is not None else ()):
                text = self._piece(context, token)
                alternatives.append({"token": text, "logprob": value, "bytes": token_bytes.of(token, text)})
            entries.append(ChatTokenLogprob(token=s, logprob=lp, bytes=token_bytes.of(t, s), top_logprobs=alternatives))
        return ChatLogprobs(content=entries)


def _prompt_logprobs_pending(out: RequestOutput) -> bool:
    """Whether the request asked for prompt log-probabilities and its prompt's chunks have not
    all run yet (a snapshot after an early chunk)."""
    return out.prompt_logprobs is not None and len(out.prompt_logprobs) < len(out.prompt_token_ids)


def _usage(outputs: list[RequestOutput]) -> Usage:
    prompt = sum(o.stats.prompt_tokens for o in outputs)
    completion = sum(o.stats.generated_tokens for o in outputs)
    cached = sum(o.stats.prefix_cache_hit_tokens for o in outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' snapshots as (prompt index, snapshot)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 — re-raised by the consumer
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        # A pump may be inside its stream's ``__anext__``: wait until every pump has stopped,
        # or closing that stream raises ("already running") in place of the error that got
        # here (a timeout, a failed request) or on a client's disconnect.
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            await s.aclose()


async def _primed(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Wait for the first chunk now (errors still raise), then stream it and the rest."""
    try:
        first = await chunks.__anext__()
    except BaseException:
        await chunks.aclose()
        raise

    async def rest() -> AsyncIterator[str]:
        try:
            yield first
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()

    return rest()
