"""The engine: requests in, one scheduler step at a time, outputs out.

A step is schedule (``KVCore``) -> propose (drafter) -> execute (model runner: forward,
sample, verify) -> accept (stop checks, here) -> commit (``KVCore``) -> emit. In this process
the three sides are local objects; ``keyserve.actors.ray_engine.RayEngine`` runs this same class
with the KV-block manager, the draft and the tensor-parallel target group as Ray actors behind
the same three interfaces. This class owns what only the front needs: requests, detokenizers,
stop conditions and outputs -- and every request's tokens, from which anything lost is recomputed.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from keyserve.config import EngineConfig
from keyserve.core.multi_step import multi_step_lookahead
from keyserve.core.prompt_context import prompt_context
from keyserve.core.prompt_logprobs import merge_prompt_logprobs
from keyserve.core.sampling_params import SamplingParams
from keyserve.core.sequence import FinishReason, Sequence, SequenceStatus
from keyserve.engine.admission import EngineLimits, admit_params, check_token_ids
from keyserve.engine.build import EngineParts, build_local_parts
from keyserve.engine.detokenizer import IncrementalDetokenizer
from keyserve.engine.errors import InvalidParamError, PromptTooLongError, RequestFailedError, StepFailedError
from keyserve.engine.kv_budget.resolve import request_budget
from keyserve.engine.kv_core import KVCore, SeqStat
from keyserve.engine.outputs import CompletionOutput, RequestOutput, RequestStats
from keyserve.engine.stats import EngineStats
from keyserve.engine.speculative import step_samples
from keyserve.engine.step_input import ForkOp, StepInput, StepOutput, attach_drafts
from keyserve.model.loader import LoadedModel

__all__ = ["InvalidParamError", "LLMEngine", "PromptTooLongError", "RequestFailedError", "StepFailedError"]


log = logging.getLogger(__name__)


def _op_seq_ids(op: object) -> tuple[int, ...]:
    """The sequences a model-side op changes (a fork: both)."""
    if isinstance(op, ForkOp):
        return (op.parent_id, op.child_id)
    seq_id = getattr(op, "seq_id", None)
    return () if seq_id is None else (seq_id,)


def _describe(error: BaseException, limit: int = 300) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message as the tokenizer's template gets it, from every entry point alike
    (``LLM.chat``, the OpenAI server, batch jobs): ``developer`` is the system role, no content
    is ``""`` and text parts are joined by newlines (as vLLM joins them); every other key
    (``name``, ...) reaches the template as it came."""
    out = dict(message)
    content = out.get("content")
    if content is None:
        out["content"] = ""
    elif isinstance(content, list):
        out["content"] = "\n".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    if out.get("role") == "developer":
        out["role"] = "system"
    return out


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float
    seqs: list[Sequence]  # sample 0 first; siblings join once sample 0's prompt is computed
    pending_forks: list[Sequence] = field(default_factory=list)
    detoks: dict[int, IncrementalDetokenizer] = field(default_factory=dict)
    first_token_time: float | None = None
    finish_time: float | None = None
    max_blocks: int = 0
    # Teacher forcing (evaluation): emit these tokens instead of sampling, keeping the model's
    # log-probability of each, so perplexity can be measured under any KV policy.
    forced_token_ids: list[int] | None = None
    # SamplingParams.prompt_logprobs: per prompt position so far (position 0: None), filled as
    # its chunks run (core/prompt_logprobs.py), and each position's top alternatives.
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None

    @property
    def all_seqs(self) -> list[Sequence]:
        return self.seqs + self.pending_forks

    @property
    def finished(self) -> bool:
        return not self.pending_forks and all(s.is_finished for s in self.seqs)


class LLMEngine:
    prefix_store: Any = None  # EnginePrefixStore when config.prefix_store.enabled

    def __init__(
        self,
        config: EngineConfig | None = None,
        loaded: LoadedModel | None = None,
        parts: EngineParts | None = None,
    ) -> None:
        """Build the parts in this process (``loaded``: an already loaded target), or drive
        ``parts`` built elsewhere (``RayEngine``: actor clients with the same methods)."""
        self.config = config = config or EngineConfig()
        parts = parts or build_local_parts(config, loaded)
        self.device = parts.device
        self.loaded = parts.loaded
        self.runner = parts.runner
        self.prefix_store = parts.prefix_store
        self.tokenizer = parts.tokenizer
        self.max_model_len = parts.max_model_len
        self.vocab_size = parts.arch.vocab_size
        self.budget_defaults = parts.budget_defaults
        self.core = parts.core
        # In this process the core holds the very Sequence objects the engine does, so what it
        # reports about them is already there; a remote core (Ray) sends it back per step.
        self._core_shares_seqs = isinstance(parts.core, KVCore)
        self.speculative = parts.speculative
        self.drafter = parts.speculative.drafter if parts.speculative is not None else None
        self.eos_token_ids = self._eos_ids(parts.arch)
        self.requests: dict[str, _Request] = {}
        self._held_outputs: list[RequestOutput] = []  # finished, stepped past by a non-owner (``hold_outputs``)
        self._seq_owner: dict[int, _Request] = {}
        self._seqs: dict[int, Sequence] = {}
        self._blocks: dict[int, int] = {}  # seq_id -> KV blocks it holds (from the core)
        self._kv_stats: dict[int, tuple[int, int]] = {}  # budgeted seq_id -> (held, evicted)
        self._cost_after_prompt = False  # the last step had a prompt chunk (``_observe_step_cost``)
        self._ids = itertools.count()
        self.num_steps = 0
        self.last_step_empty = False
        # Over finished requests, whatever ended them (``EngineStats``).
        self.finished_prompt_tokens = self.finished_generated_tokens = self.finished_kv_evicted = 0

    def _eos_ids(self, arch: Any) -> set[int]:
        ids: set[int] = set()
        eos = getattr(arch, "eos_token_ids", None) or getattr(arch, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    # --------------------------------------------------------------- requests
    def encode_prompt(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if chat:
                messages = [{"role": "user", "content": prompt}]
                return self.apply_chat_template(messages)
            return list(self.tokenizer.encode(prompt))
        if chat:
            raise ValueError("chat=True wraps text in the chat template; token ids are taken as they "
                             "are: pass the text, or chat=False")
        return list(prompt)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; send a plain prompt")
        from jinja2 import TemplateError  # transformers renders chat templates with jinja2

        try:
            out = self.tokenizer.apply_chat_template([template_message(m) for m in messages],
                                                     add_generation_prompt=True, tokenize=True)
        except TemplateError as e:  # the template's own check (e.g. "roles must alternate"): the caller's input
            raise ValueError(f"the model's chat template refused these messages: {e}") from e
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        chat: bool = False,
        prompt_token_ids: list[int] | None = None,
        forced_token_ids: list[int] | None = None,
    ) -> str:
        """Validate and queue a request; raises ValueError on bad input, leaving nothing behind.

        Every parameter is checked against what this model can use (``admission``), whoever
        the caller: a value that would overflow inside a batched step fails here, alone."""
        params = params if params is not None else SamplingParams()
        if forced_token_ids is not None:
            forced_token_ids = check_token_ids(forced_token_ids, "forced_token_ids", self.vocab_size)
            if getattr(params, "n", None) != 1 or not forced_token_ids:
                raise ValueError("teacher forcing needs n == 1 and at least one forced token")
            params = params.model_copy(
                update={"max_tokens": len(forced_token_ids), "speculative": False, "logprobs": True,
                        "ignore_eos": True, "stop": [], "stop_token_ids": []}
            )
        params = admit_params(params, self.limits)
        if isinstance(prompt, str) and not prompt and not prompt_token_ids:  # whitespace has tokens
            raise ValueError("prompt is empty")
        token_ids = prompt_token_ids if prompt_token_ids is not None else self.encode_prompt(prompt, chat)
        if not token_ids:
            raise ValueError("prompt is empty (no tokens)")
        token_ids = check_token_ids(token_ids, "prompt", self.vocab_size)
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(token_ids)} tokens but the model's context is "
                f"{self.max_model_len} tokens (at least one must remain for generation)"
            )
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ValueError(f"request_id must be a non-empty string (or None for a fresh one), not {request_id!r}")
        # a str subclass as plain text: the id crosses to the Ray engine's actors (``admission._plain``)
        request_id = str.__str__(request_id) if request_id else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        now = time.monotonic()
        budget = request_budget(params, len(token_ids), self.budget_defaults)  # once per request
        seqs = [
            Sequence(request_id, list(token_ids), params, arrival=now, sample_index=i, kv_budget=budget)
            for i in range(params.n)
        ]
        req = _Request(
            request_id,
            prompt if isinstance(prompt, str) else None,
            list(token_ids),
            params,
            now,
            seqs=[seqs[0]],
            pending_forks=seqs[1:],
            forced_token_ids=list(forced_token_ids) if forced_token_ids is not None else None,
        )
        if params.prompt_logprobs is not None:
            req.prompt_logprobs, req.prompt_top_logprobs, req.prompt_logprob_ranks = [None], [None], [None]
        context = prompt_context(self.tokenizer, req.prompt_token_ids)  # once for all the samples
        for seq in seqs:  # everything that can raise, before anything is registered
            req.detoks[seq.seq_id] = IncrementalDetokenizer(self.tokenizer, params.stop, context)
        for seq in seqs:
            self._seq_owner[seq.seq_id] = req
            self._seqs[seq.seq_id] = seq
        self.requests[request_id] = req
        self.core.add([seqs[0]], seqs[1:], req.forced_token_ids)
        return request_id

    @property
    def limits(self) -> EngineLimits:
        """What a request may ask of this engine (admission checks against it)."""
        cache = self.config.cache
        return EngineLimits(self.vocab_size, self.max_model_len, self.config.scheduler.max_num_seqs,
                            self.speculative is not None, self.prefix_store is not None,
                            cache.default_kv_policy, cache.default_kv_budget)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request and free its blocks."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._abort_seqs(req)
        out = self._pop_finished(req)
        self._flush_store_if_idle()  # store what the abort copied out
        return out

    def has_unfinished_requests(self) -> bool:
        """Requests still running, or finished outputs held for the next ``step``."""
        return bool(self.requests) or bool(self._held_outputs)

    def hold_outputs(self, outputs: list[RequestOutput]) -> None:
        """Finished outputs that a caller stepped past but does not own (``LLM.generate`` on an
        engine that also holds requests added with ``add_request``): the next ``step`` returns
        them first, so whoever steps the engine for them still gets their ends."""
        self._held_outputs.extend(outputs)

    # ------------------------------------------------------------------- step
    # Exceptions that concern the whole engine (RayEngine: a lost shard or KV-block manager);
    # they pass through ``step`` to the caller's own recovery.
    engine_faults: tuple[type[BaseException], ...] = ()
    _running_step: StepInput | None = None  # the step being run, for recovery if it raises

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return a snapshot of every request that made progress.

        What goes wrong for one request (its sampling parameters, KV budget, seed, stop strings,
        drafts) fails that request alone, inside the step: its output comes back finished with
        ``error`` set, and the others carry on as if it had never been there. Anything else that
        raises fails the requests of this step (``StepFailedError``), and the engine is left
        consistent for the next one."""
        if self.prefix_store is not None:  # what the last step copied out, before any lookup
            self.prefix_store.flush()
        self._running_step = None
        start = time.perf_counter()
        try:
            outputs = self._step()
            self._observe_step_cost(time.perf_counter() - start)
        except Exception as e:  # noqa: BLE001 — recovered below, re-raised as StepFailedError
            if isinstance(e, self.engine_faults):
                raise
            raise self._recover_failed_step(e) from e
        if self.last_step_empty and not outputs and self.requests:
            outputs = self._fail_unschedulable()
        self._flush_store_if_idle()
        if self._held_outputs:
            outputs, self._held_outputs = self._held_outputs + outputs, []
        return outputs

    def _fail_unschedulable(self) -> list[RequestOutput]:
        """An empty step with nothing running: the first waiting request cannot get its KV
        blocks from a pool that nobody else holds, so it never will (a request's prompt is
        checked against the pool when it is added; one that outgrew the pool while generating,
        past its prompt, ends up here). It fails alone, with an error, so that the requests
        queued behind it are admitted: first come, first served would hold them forever."""
        stats = self.core.stats()
        if stats.num_running_seqs:
            return []
        waiting = self.waiting_request_ids()
        if not waiting:
            return []
        rid = waiting[0]
        out = self.abort(rid)
        if out is None:
            return []
        log.warning("request %s cannot be scheduled: it outgrew the KV pool", rid)
        out.error = RequestFailedError(
            f"request {rid} cannot be scheduled: it needs more KV blocks than the pool holds "
            f"({stats.num_blocks} blocks of {stats.block_size} tokens)"
        )
        return [out]

    def _observe_step_cost(self, seconds: float) -> None:
        """Tell adaptive K what a decode step just cost, all of it (draft, target, verification,
        bookkeeping), with its batch size and drafts per sequence. Steps with a prompt chunk
        are left out: their cost is the prompt's."""
        step = self._running_step
        if self.speculative is None or step is None or step.is_empty or step.multi_step:
            return
        items = step.items
        after_prompt, self._cost_after_prompt = self._cost_after_prompt, False
        if any(it.num_new_tokens != 1 or it.forced_token_id is not None
               or not (it.sample_seq_ids or it.verifies) for it in items):
            self._cost_after_prompt = True
            return
        if after_prompt:
            # The first decode step after a prompt's forward is not a steady one: traced at 55-64
            # ms at batch 8 on 2 cores against 27 ms for the next ones (25-32 ms in other runs).
            # Taken as a plain baseline it read a K = 1 step (39 ms) as free, and adaptive K kept
            # drafting at 0.78x plain.
            return
        seqs = [self._seqs[it.seq_id] for it in items if it.seq_id in self._seqs]
        drafts = [len(it.draft_token_ids) for it in items]
        self.speculative.observe_step(len(items), max(drafts), seconds, step_samples(seqs),
                                      sum(1 for n in drafts if n), sum(1 for it in items if it.draft_parents),
                                      sum(1 for it in items if it.draft_copied), sum(drafts))

    def _flush_store_if_idle(self) -> None:
        """With no request left nobody waits for a token: store what was copied out now
        rather than at some later step."""
        if self.prefix_store is not None and not self.requests:
            self.prefix_store.flush()

    def _step(self) -> list[RequestOutput]:
        drafter = self.drafter
        speculate = drafter is not None and getattr(drafter, "available", True)
        scheduled = self.core.schedule(*self._step_lookahead(speculate))
        self._apply_seq_stats(scheduled.seq_stats)
        step = self._running_step = scheduled.step
        self.last_step_empty = step is None or step.is_empty
        if step is None:
            return []
        if step.is_empty:  # nothing to compute, only ops for the model side (remote cores)
            self.runner.execute(step)
            return []
        draft_probs = self._propose(step) if speculate and not step.multi_step else None
        out = self.runner.execute(step, draft_probs)
        self.num_steps += 1
        return self._accept(step, out)

    def _lookahead(self) -> dict[int, int]:
        """Draft tokens each decoding sequence wants next step (the KV core reserves their
        slots): asked of the engine's one speculative policy, for the sequences that have
        sampled a token and are not finished."""
        assert self.speculative is not None
        live = (s for s in self._seqs.values() if s.output_token_ids and not s.is_finished)
        return self.speculative.lookaheads(live, self.max_model_len)

    def _step_lookahead(self, speculate: bool) -> tuple[dict[int, int] | None, bool]:
        """The next step's lookahead for the KV core and whether it is a multi-step round's:
        the drafts the speculative policy wants when the step speculates, else the round's
        extra decode steps (``KVCore.schedule``'s two arguments). With a draft loaded but no
        sequence drafting (``speculative=False`` requests, or adaptive K's plain decoding at
        this batch size) the step is the round an engine without a draft would run."""
        if speculate:
            drafts = self._lookahead()
            if drafts:
                return drafts, False
        multi = self._multi_step_lookahead()
        return multi, multi is not None

    def _multi_step_lookahead(self) -> dict[int, int] | None:
        """Extra decode steps per sequence for the next round (``core/multi_step.py``), or None
        for a single step."""
        steps = self.config.scheduler.num_scheduler_steps
        if steps <= 1:
            return None
        live = [s for s in self._seqs.values() if not s.is_finished]
        forced = {s.seq_id for r in self.requests.values() if r.forced_token_ids for s in r.all_seqs}
        return multi_step_lookahead(live, steps, self.max_model_len, self.config.scheduler.max_num_seqs, forced)

    def _propose(self, step: StepInput) -> torch.Tensor | None:
        """Draft tokens for every item with reserved lookahead, in one batched call; items the
        draft could not serve decode plainly (so does the whole step if drafting raises: the
        draft is an accelerator, never a reason to fail a request)."""
        verify = [it for it in step.items if it.num_lookahead]
        if not verify:
            return None
        trees = self.speculative.trees if self.speculative is not None else {}
        tree_items = [it for it in verify if it.seq_id in trees] if trees else []
        if tree_items:  # trees of drafts (core/spec_tree.py); any others verify chains
            verify = [it for it in verify if it.seq_id not in trees]
            tree_targets = [self._seqs[it.seq_id] for it in tree_items]
            proposal = self.drafter.propose_tree(tree_targets, [list(trees[it.seq_id]) for it in tree_items])
            attach_drafts(tree_items, proposal.token_ids, proposal.num_draft, proposal.parents)
            if not verify:
                return None
        targets = [self._seqs[it.seq_id] for it in verify]
        try:
            proposal = self.drafter.propose(targets, [it.num_lookahead for it in verify])
        except Exception as e:  # noqa: BLE001 — see the docstring
            if isinstance(e, self.engine_faults):
                raise
            log.warning("drafting failed; this step decodes without drafts", exc_info=True)
            for seq in targets:  # their mirrors may be half-updated: re-synced from scratch
                self.drafter.release(seq)
            return None
        attach_drafts(verify, proposal.token_ids, proposal.num_draft, copied=proposal.copied)
        return proposal.probs

    def _accept(self, step: StepInput, out: StepOutput) -> list[RequestOutput]:
        """Stop checks over the emitted tokens, then commit to the core and snapshot.

        A request whose sequence failed on the model side (``out.failed``) or in its own stop
        checks here is finished with an error before the commit, so the core never counts
        what it did in this step (nor offers its blocks as a cached prefix)."""
        now = time.monotonic()
        self._kv_stats.update(out.kv_stats)
        owner = self._seq_owner
        touched = {req.request_id: req for req in [owner[item.seq_id] for item in step.items]}
        failed = self._failed_on_model_side(out.failed) if out.failed else {}
        for seq_id, (first, values, tops, ranks) in out.prompt_logprobs.items():
            req = owner[seq_id]
            if req.prompt_logprobs is not None and req.request_id not in failed:
                merge_prompt_logprobs(req.prompt_logprobs, first, values)
                merge_prompt_logprobs(req.prompt_top_logprobs, first, tops)  # type: ignore[arg-type]
                merge_prompt_logprobs(req.prompt_logprob_ranks, first, ranks)  # type: ignore[arg-type]
        items = step.items if not failed else [
            it for it in step.items if self._seq_owner[it.seq_id].request_id not in failed
        ]
        # What the core commits: the step output after the stop checks -- each sequence's
        # tokens cut at its stop, which sequences finished, drafts accepted.
        kept = StepOutput()
        if self.speculative is not None and not step.multi_step:  # asked for drafts, got none
            missed = [it for it in items if it.num_lookahead and not it.draft_token_ids]
            if missed:
                self.speculative.record_misses([owner[it.seq_id].request_id for it in missed])
        for item in items:
            # a verified draft run, or a multi-step round (core/multi_step.py) committed alike
            verifies = bool(item.draft_token_ids) or item.seq_id in out.num_accepted
            if not (verifies or item.forced_token_id is not None or item.sample_seq_ids):
                continue  # a prompt chunk that does not complete the prompt
            req = owner[item.seq_id]
            try:
                if verifies:
                    accepted = out.num_accepted[item.seq_id]
                    if self.speculative is not None and item.draft_token_ids:
                        self.speculative.record(req.request_id, item.seq_id, len(item.draft_token_ids), accepted,
                                                item.draft_parents, copied=item.draft_copied)
                    self._emit(req, self._seqs[item.seq_id], out, now, kept)
                    # A stop cut the run: only the kept tokens' KV counts as computed (the
                    # request's kv_tokens_held), as if its steps had run one at a time.
                    kept.num_accepted[item.seq_id] = min(accepted, len(kept.tokens[item.seq_id]) - 1)
                elif item.forced_token_id is not None:
                    self._emit(req, self._seqs[item.seq_id], out, now, kept)
                else:
                    for target_id in item.sample_seq_ids[1:]:  # siblings join once forked
                        target = self._seqs[target_id]
                        req.pending_forks.remove(target)
                        req.seqs.append(target)
                    for target_id in item.sample_seq_ids:
                        self._emit(req, self._seqs[target_id], out, now, kept)
            except Exception as e:  # noqa: BLE001 — this request's stop checks; fails it alone
                log.warning("request %s failed in its stop checks", req.request_id, exc_info=True)
                failed[req.request_id] = RequestFailedError(
                    f"request {req.request_id} failed in the engine step (stop checks): {_describe(e)}"
                )
                for seq in req.all_seqs:
                    for part in (kept.tokens, kept.num_accepted, kept.finished):
                        part.pop(seq.seq_id, None)
        if failed:
            items = [it for it in step.items if self._seq_owner[it.seq_id].request_id not in failed]
            for rid in failed:
                self._abort_seqs(self.requests[rid])
        result = self.core.commit(kept)
        self._apply_seq_stats(result.seq_stats)
        self._apply_ops(result.ops)
        if not self._core_shares_seqs:  # what the remote core just computed
            for item in items:
                computed = item.start + item.num_new_tokens + kept.num_accepted.get(item.seq_id, 0)
                for seq_id in [item.seq_id] + item.sample_seq_ids[1:]:
                    self._seqs[seq_id].num_computed_tokens = computed
        self._after_commit()
        outputs = []
        blocks = self._blocks
        for req in touched.values():
            held = sum(blocks.get(s.seq_id, 0) for s in req.seqs)
            if held > req.max_blocks:
                req.max_blocks = held
            if req.finished:
                outputs.append(self._pop_finished(req))
            else:
                outputs.append(self._snapshot(req, finished=False))
        if failed:
            for output in outputs:
                output.error = failed.get(output.request_id)
        return outputs

    # ------------------------------------------------------- failure isolation
    def _after_commit(self) -> None:
        """Called once a step is committed, before its outputs are built (``RayEngine``
        submits its next relayed step here)."""

    def _failed_on_model_side(self, failed: dict[int, str]) -> dict[str, RequestFailedError]:
        """Requests with a sequence the model side could not run (a sibling fails them all)."""
        errors: dict[str, RequestFailedError] = {}
        for seq_id, reason in failed.items():
            req = self._seq_owner.get(seq_id)
            if req is not None and req.request_id not in errors:
                log.warning("request %s failed in the engine step: %s", req.request_id, reason)
                errors[req.request_id] = RequestFailedError(
                    f"request {req.request_id} failed in the engine step: {reason}"
                )
        return errors

    def _abort_seqs(self, req: _Request) -> None:
        """Finish every sequence of an aborted or failed request (blocks freed, model-side state
        released); the caller pops the request. Siblings that never forked (it ended before its
        first token) end with it, so its last output still has one completion per sample."""
        for seq in req.all_seqs:
            if not seq.is_finished:
                self._finish(seq, FinishReason.ABORT)
                result = self.core.finish(seq.seq_id, FinishReason.ABORT)
                self._apply_seq_stats(result.seq_stats)
                self._apply_ops(result.ops)
        req.seqs, req.pending_forks = req.all_seqs, []

    def _recover_failed_step(self, error: Exception) -> StepFailedError:
        """A step raised outside every per-request guard: fail the requests it touched -- its
        items, and the sequences its model-side ops named (every request if it failed while
        scheduling) -- and return the error to raise. Nothing else was touched by the step, so
        the others go on unchanged, and the engine stays usable."""
        log.error("engine step failed", exc_info=error)
        step = self._running_step
        if step is None:
            doomed = list(self.requests)
        else:
            seq_ids = [s for item in step.items for s in (item.seq_id, *item.sample_seq_ids)]
            seq_ids += [s for op in step.ops for s in _op_seq_ids(op)]
            doomed = list(dict.fromkeys(self._seq_owner[s].request_id for s in seq_ids if s in self._seq_owner))
        outputs = []
        for rid in doomed:
            try:
                out = self.abort(rid)
            except Exception:  # noqa: BLE001 — keep failing the rest
                log.exception("abort of %s after a failed step failed", rid)
                continue
            if out is not None:
                outputs.append(out)
        self.last_step_empty = False
        self._running_step = None
        return StepFailedError(f"engine step failed: {_describe(error)}", doomed, outputs)

    def _emit(self, req: _Request, seq: Sequence, out: StepOutput, now: float, kept: StepOutput) -> None:
        """Append a sequence's emitted tokens up to the first stop condition; record in
        ``kept`` what it kept and whether it finished."""
        base = len(seq.output_token_ids)
        tokens = out.tokens[seq.seq_id]
        tops = out.top_logprobs.get(seq.seq_id) if out.top_logprobs else None
        if len(tokens) == 1:  # a plain decode step
            logprob = out.logprobs.get(seq.seq_id) if out.logprobs else None
            self._append_token(req, seq, tokens[0], logprob[0] if logprob else None, now, tops[0] if tops else None)
        else:
            logprobs = out.logprobs.get(seq.seq_id)
            for j, token in enumerate(tokens):
                self._append_token(req, seq, token, logprobs[j] if logprobs else None, now,
                                   tops[j] if tops else None)
                if seq.is_finished:  # a stop condition inside an accepted run
                    tokens = seq.output_token_ids[base:]
                    break
        kept.tokens[seq.seq_id] = tokens
        if seq.finish_reason is not None:
            kept.finished[seq.seq_id] = seq.finish_reason

    def _apply_ops(self, ops: list) -> None:
        if ops:
            self._kv_stats.update(self.runner.apply_ops(ops))

    def _apply_seq_stats(self, stats: dict[int, SeqStat]) -> None:
        blocks = self._blocks
        if self._core_shares_seqs:
            for seq_id, st in stats.items():
                blocks[seq_id] = st[0]  # num_blocks; the rest is on the shared Sequence
            return
        for seq_id, st in stats.items():
            blocks[seq_id] = st.num_blocks
            seq = self._seqs.get(seq_id)
            if seq is not None:
                seq.num_preemptions = st.num_preemptions
                seq.num_cached_tokens = st.num_cached_tokens
                seq.num_computed_tokens = st.num_computed_tokens

    def _append_token(self, req: _Request, seq: Sequence, token: int, logprob: float | None, now: float,
                      top: list[tuple[int, float]] | None = None) -> None:
        seq.append_token(token, logprob, top)
        outputs = seq.output_token_ids
        if req.first_token_time is None:
            req.first_token_time = now
        detok = req.detoks[seq.seq_id]
        detok.append(token)
        p = seq.params
        reason = None
        if detok.stopped_at is not None:
            reason = FinishReason.STOP
        elif token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            reason = FinishReason.STOP
        elif len(outputs) >= p.max_tokens or len(seq.prompt_token_ids) + len(outputs) >= self.max_model_len:
            reason = FinishReason.LENGTH
        if reason is not None:
            detok.flush()  # what the stream still holds: a character cut short, a trailing U+FFFD
            if detok.stopped_at is not None:
                reason = FinishReason.STOP
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """The front's half of finishing; the core frees blocks when it hears of it."""
        stats = self._kv_stats.pop(seq.seq_id, None)
        if stats is not None:
            seq.kv_tokens_held, seq.kv_tokens_evicted = stats
        if self.speculative is not None:
            self.speculative.release(seq)  # the drafter's mirror and adaptive K's estimate
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.monotonic()

    # ---------------------------------------------------------------- outputs
    def _snapshot(self, req: _Request, finished: bool | None = None) -> RequestOutput:
        seqs = req.seqs if len(req.seqs) == 1 else sorted(req.seqs, key=lambda s: s.sample_index)
        detoks = req.detoks
        logprobs, tops = req.params.logprobs, req.params.top_logprobs
        outs = [
            CompletionOutput(
                seq.sample_index,
                detoks[seq.seq_id].text,
                list(seq.output_token_ids),
                seq.finish_reason.value if seq.finish_reason else None,
                list(seq.output_logprobs) if logprobs else None,
                list(seq.output_top_logprobs) if tops else None,
            )
            for seq in seqs
        ]
        finished = req.finished if finished is None else finished
        # Full statistics on the last output; in flight only the token counts (the rest --
        # KV, speculation, latency sums over every sample -- would cost every step).
        stats = self._stats(req) if finished else RequestStats(
            len(req.prompt_token_ids), sum(len(o.token_ids) for o in outs)
        )
        result = RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, finished, stats)
        if req.prompt_logprobs is not None:
            result.prompt_logprobs = list(req.prompt_logprobs)
            result.prompt_logprob_ranks = list(req.prompt_logprob_ranks)  # type: ignore[arg-type]
            if req.params.prompt_logprobs:
                result.prompt_top_logprobs = list(req.prompt_top_logprobs)  # type: ignore[arg-type]
        return result

    def _stats(self, req: _Request) -> RequestStats:
        generated = sum(len(s.output_token_ids) for s in req.seqs)
        end = req.finish_time or time.monotonic()
        ttft = None if req.first_token_time is None else req.first_token_time - req.arrival
        decode_time = None if req.first_token_time is None else end - req.first_token_time
        return RequestStats(
            prompt_tokens=len(req.prompt_token_ids),
            generated_tokens=generated,
            time_to_first_token_s=ttft,
            e2e_latency_s=(req.finish_time - req.arrival) if req.finish_time else None,
            tokens_per_s=(generated - len(req.seqs)) / decode_time
            if decode_time and generated > len(req.seqs)
            else None,
            kv_blocks_used=req.max_blocks,
            prefix_cache_hit_tokens=req.seqs[0].num_cached_tokens if req.seqs else 0,
            kv_tokens_held=sum(self._kv_held(s) for s in req.seqs),
            kv_tokens_evicted=sum(self._kv_evicted(s) for s in req.seqs),
            num_preemptions=sum(s.num_preemptions for s in req.seqs),
            **self._spec_stats(req),
        )

    def _spec_stats(self, req: _Request) -> dict:
        if self.speculative is None or req.request_id not in self.speculative.request_stats:
            return {}
        st = self.speculative.request_stats[req.request_id]
        return {
            "spec_draft_tokens": st.num_draft_tokens,
            "spec_accepted_tokens": st.num_accepted_tokens,
            "spec_acceptance_rate": st.acceptance_rate,
            "spec_tokens_per_forward": st.mean_tokens_per_forward,
        }

    def _kv_held(self, seq: Sequence) -> int:
        stats = self._kv_stats.get(seq.seq_id)
        if stats is not None:
            return stats[0]
        return seq.kv_tokens_held if seq.kv_budgeted else seq.num_computed_tokens

    def _kv_evicted(self, seq: Sequence) -> int:
        stats = self._kv_stats.get(seq.seq_id)
        return stats[1] if stats is not None else seq.kv_tokens_evicted

    def _pop_finished(self, req: _Request) -> RequestOutput:
        """The request's last output; it leaves the engine (and counts in ``stats()``)."""
        req.finish_time = max((s.finish_time or 0.0) for s in req.seqs) or time.monotonic()
        self.requests.pop(req.request_id, None)
        for seq in req.all_seqs:
            self._seq_owner.pop(seq.seq_id, None)
            self._seqs.pop(seq.seq_id, None)
            self._blocks.pop(seq.seq_id, None)
        out = self._snapshot(req)
        if self.speculative is not None:
            self.speculative.pop_request_stats(req.request_id)
        self.finished_prompt_tokens += out.stats.prompt_tokens
        self.finished_generated_tokens += out.stats.generated_tokens
        self.finished_kv_evicted += out.stats.kv_tokens_evicted
        return out

    # ---------------------------------------------------------------- reports
    def stats(self) -> EngineStats:
        """A snapshot of this engine: its KV pool, queue, prefix cache, speculation and totals
        over finished requests (what ``/metrics`` exports). The same call, in one process or
        over Ray (the KV core's counts come back with every step)."""
        core = self.core.stats()
        acceptance = self.speculative.stats if self.speculative is not None else None
        lookup = self.speculative.lookup_stats if self.speculative is not None else None
        return EngineStats(
            core=core,
            num_requests_running=core.num_running_requests,
            num_requests_waiting=len(self.requests) - core.num_running_requests,
            kv_tokens_evicted=self.finished_kv_evicted,
            spec_draft_tokens=acceptance.num_draft_tokens if acceptance else 0,
            spec_accepted_tokens=acceptance.num_accepted_tokens if acceptance else 0,
            spec_lookup_draft_tokens=lookup.num_draft_tokens if lookup else 0,
            spec_lookup_accepted_tokens=lookup.num_accepted_tokens if lookup else 0,
            prompt_tokens=self.finished_prompt_tokens,
            generation_tokens=self.finished_generated_tokens,
            num_steps=self.num_steps,
            prefix_store=self.prefix_store_stats(),
        )

    def waiting_request_ids(self) -> list[str]:
        """Requests not yet admitted to the running batch, in queue order."""
        return self.core.waiting_request_ids()

    @property
    def scheduler(self) -> Any:
        """The in-process core's scheduler (tests, benchmarks; the Ray engine has none here:
        read ``stats()``)."""
        return self.core.scheduler

    @property
    def block_manager(self) -> Any:
        """The in-process core's block manager (tests, benchmarks; see ``scheduler``)."""
        return self.core.block_manager

    def prefix_store_stats(self) -> dict[str, float]:
        """Counters of the prefix store (hits, bytes read and evictions per tier, importance
        fallbacks, corrupt chunks); empty when it is off."""
        return self.prefix_store.stats() if self.prefix_store is not None else {}

    def close(self) -> None:
        """Release what outlives the process otherwise (the prefix store's disk directory)."""
        if self.prefix_store is not None:
            self.prefix_store.close()

    def run_until_done(self) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    finished[out.request_id] = out
            if self.last_step_empty and self.requests:
                raise RuntimeError("engine has requests but nothing schedulable")
        return finished
