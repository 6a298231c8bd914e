"""``keyserve.LLM``: generate text from Python in one call (``RayLLM``: the same on a Ray
cluster). A facade over the engine, above every layer but the command line."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager
from numbers import Integral
from typing import Any

from tqdm.auto import tqdm

from keyserve.config import EngineConfig
from keyserve.core.sampling_params import SamplingParams
from keyserve.engine.errors import PromptTooLongError
from keyserve.engine.llm_engine import LLMEngine
from keyserve.engine.outputs import RequestOutput


class LLM:
    """An in-process engine over one model.

    >>> llm = LLM(model="/path/to/hf_dir")            # or None for the default model
    >>> [out] = llm.generate("Once upon a time", SamplingParams(max_tokens=32))
    >>> out.text, out.token_ids, out.finish_reason, out.stats
    """

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, **options: Any) -> None:
        if config is None:
            config = EngineConfig.from_flat(model=model, **options)
        elif model is not None or options:
            raise ValueError("pass either config= or model/options, not both")
        self.engine = LLMEngine(config)
        self._turn = _OneCallAtATime()
        # A call's request ids until it returns or has aborted them: a second Ctrl-C during its
        # clean-up leaves some queued, and the next call aborts them (else it ran them unseen).
        self._unsettled: list[str] = []

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        chat: bool = False,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or chat user messages with ``chat``);
        one RequestOutput per prompt, in order. Invalid input raises before anything runs.
        Calls from several threads run one after the other."""
        with self._turn():
            return self._generate(prompts, sampling_params, chat, use_tqdm)

    def _generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None,
        chat: bool,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, Seq) and prompts and isinstance(prompts[0], Integral)):
            prompts = [prompts]  # type: ignore[list-item]
        _check_prompts(prompts)
        if not isinstance(sampling_params, Seq):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        engine = self.engine
        encoded = [engine.encode_prompt(p, chat) if not (isinstance(p, str) and not p) else []
                   for p in prompts]
        for i, ids in enumerate(encoded):  # validate everything before queueing anything
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            if len(ids) >= engine.max_model_len:
                raise PromptTooLongError(
                    f"prompt {i} has {len(ids)} tokens but the model's context is "
                    f"{engine.max_model_len} tokens (at least one must remain for generation)"
                )
        for rid in self._unsettled:  # an earlier call's, left when its own clean-up was cut short
            engine.abort(rid)
        ids = self._unsettled = []  # this call's requests until it has their outputs or aborted them
        try:
            for p, sp, tok in zip(prompts, sampling_params, encoded):
                ids.append(engine.add_request(p, sp, prompt_token_ids=tok))
        except BaseException:  # a later prompt's parameters or ids: none of them runs
            for rid in ids:
                engine.abort(rid)
            self._unsettled = []
            raise
        done: dict[str, RequestOutput] = {}
        others: list[RequestOutput] = []  # the ends of requests added with engine.add_request
        mine = set(ids)
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if not out.finished:
                        continue
                    if out.request_id in mine:
                        done[out.request_id] = out
                        bar.update(1)
                    else:
                        others.append(out)
        except BaseException:
            for rid in ids:
                engine.abort(rid)
            self._unsettled = []
            raise
        finally:
            bar.close()
            engine.hold_outputs(others)  # their owner's next step returns them
        self._unsettled = []
        return [done[rid] for rid in ids]

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations (lists of ``{"role", "content"}``)."""
        if not isinstance(messages, Seq) or isinstance(messages, str) or not messages:
            raise ValueError("messages must be a conversation (a list of {'role', 'content'} dicts) "
                             "or a list of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        for i, conversation in enumerate(conversations):
            _check_conversation(conversation, i)
        token_lists = [self.engine.apply_chat_template(c) for c in conversations]  # type: ignore[arg-type]
        return self.generate(token_lists, sampling_params)


class RayLLM(LLM):
    """``keyserve.LLM`` on a Ray cluster (a local one is started if none is running).

    >>> llm = RayLLM("/path/to/model", tensor_parallel_size=2, draft="/path/to/draft")
    >>> [out] = llm.generate("Once upon a time", SamplingParams(max_tokens=32))
    """

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, **options: Any) -> None:
        if config is None:
            config = EngineConfig.from_flat(model=model, **options)
        elif model is not None or options:
            raise ValueError("pass either config= or model/options, not both")
        from keyserve.actors.ray_engine import RayEngine  # Ray only for this class, not for LLM

        self.engine = RayEngine(config)
        self._turn = _OneCallAtATime()
        self._unsettled: list[str] = []

    def stream(
        self, prompts: str | list[str] | list[list[int]], sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Every request's snapshot as soon as a step accepted tokens for it (last one finished).
        Prompts as ``generate`` takes them (one text or token-id list is one prompt); a prompt
        refused raises with none of them left queued. A stream is a call as ``generate`` is:
        one at a time (another thread's call waits until this stream is exhausted or closed;
        ``generate`` from inside the loop over it raises), so the snapshots are its own."""
        with self._turn():
            if isinstance(prompts, str) or (isinstance(prompts, Seq) and prompts and isinstance(prompts[0], Integral)):
                prompts = [prompts]  # type: ignore[list-item]
            _check_prompts(prompts)
            engine = self.engine
            for rid in self._unsettled:  # an earlier call's, left when its own clean-up was cut short
                engine.abort(rid)
            ids = self._unsettled = []
            try:
                for p in prompts:
                    ids.append(engine.add_request(p, sampling_params,
                                                  prompt_token_ids=None if isinstance(p, str) else list(p)))
                while engine.has_unfinished_requests():
                    yield from engine.step()
            finally:
                for rid in ids:
                    engine.abort(rid)
                self._unsettled = []

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "RayLLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class _OneCallAtATime:
    """``generate`` steps the engine until *every* request in it is done and returns the outputs
    of its own (the others' ends are held for the engine's next step): two calls at once would
    each finish the other's requests, or step the engine from two threads. A call from another
    thread waits its turn; one from inside a running call on its own thread (a progress-bar or
    tokenizer callback) is refused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    @contextmanager
    def __call__(self) -> Iterator[None]:
        me = threading.get_ident()
        if self._owner == me:
            raise RuntimeError("LLM.generate (or chat, or RayLLM.stream) was called from inside a running "
                               "call on the same thread (a callback, or the loop over a stream); call it "
                               "after that one returns")
        with self._lock:
            self._owner = me
            try:
                yield
            finally:
                self._owner = None


def _check_prompts(prompts: object) -> None:
    """Each prompt is text or a list of token ids (ints): a ValueError naming the one that is
    not, rather than a TypeError from the tokenizer."""
    if not isinstance(prompts, Seq) or isinstance(prompts, str):
        raise ValueError(f"prompts must be text, token ids, or a list of either, not {type(prompts).__name__}")
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            continue
        if isinstance(p, (bytes, bytearray)):  # a Sequence of ints: its byte values are not token ids
            raise ValueError(f"prompt {i} is bytes: decode it to text, or pass a list of token ids")
        if isinstance(p, Seq) and all(isinstance(t, Integral) and not isinstance(t, bool) for t in p):
            continue
        raise ValueError(f"prompt {i} must be text or a list of token ids (ints), not {p!r:.80}")


def _check_conversation(conversation: object, index: int) -> None:
    """A conversation is a non-empty list of ``{"role": str, "content": str | None}`` dicts."""
    where = f"conversation {index}"
    if not isinstance(conversation, Seq) or isinstance(conversation, str) or not conversation:
        raise ValueError(f"{where} must be a non-empty list of {{'role', 'content'}} dicts, not {conversation!r:.80}")
    for j, message in enumerate(conversation):
        if not isinstance(message, dict):
            raise ValueError(f"{where}, message {j} must be a dict with 'role' and 'content', not {message!r:.80}")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"{where}, message {j}: 'role' must be a string")
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise ValueError(f"{where}, message {j}: 'content' must be a string, not {type(content).__name__}")
