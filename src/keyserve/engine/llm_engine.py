"""The in-process engine: requests in, one scheduler step at a time, outputs out.

Usable as a library (``LLM`` wraps it) and, later, wrapped piece by piece by the Ray actors.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from keyserve.config import EngineConfig
from keyserve.core.block_manager import BlockManager
from keyserve.core.sampler import make_generator
from keyserve.core.sampling_params import SamplingParams
from keyserve.core.scheduler import Scheduler, SchedulerConfig, StepPlan
from keyserve.core.sequence import FinishReason, Sequence, SequenceStatus
from keyserve.engine.detokenizer import IncrementalDetokenizer
from keyserve.engine.kv_budget import BudgetDefaults, budget_spec, compact_kv
from keyserve.engine.model_runner import ModelRunner, SampleRequest, num_blocks_for_memory
from keyserve.engine.outputs import CompletionOutput, RequestOutput, RequestStats

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PromptTooLongError(ValueError):
    """The prompt does not fit the context (the HTTP layer maps this to 400)."""


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
    generators: dict[int, torch.Generator | None] = field(default_factory=dict)
    first_token_time: float | None = None
    finish_time: float | None = None
    max_blocks: int = 0
    # Teacher forcing (evaluation): emit these tokens instead of sampling, keeping the model's
    # log-probability of each, so perplexity can be measured under any KV policy.
    forced_token_ids: list[int] | None = None

    @property
    def all_seqs(self) -> list[Sequence]:
        return self.seqs + self.pending_forks

    @property
    def finished(self) -> bool:
        return not self.pending_forks and all(s.is_finished for s in self.seqs)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: Any | None = None) -> None:
        from keyserve.model.kv_cache import allocate_kv_cache, kv_cache_bytes_per_block
        from keyserve.model.loader import load_model

        self.config = config = config or EngineConfig()
        torch.manual_seed(config.seed)
        self.device = resolve_device(config.model.device)
        dtype = _DTYPES[config.model.dtype]
        if dtype is torch.float16 and self.device.type == "cpu":
            raise ValueError("dtype float16 is only supported on CUDA; use bfloat16 on the CPU")
        self.loaded = loaded or load_model(config.model.model, dtype=dtype, device=self.device)
        arch = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = config.model.max_model_len or arch.max_position_embeddings
        block_size = config.cache.block_size
        num_blocks = config.cache.num_blocks or num_blocks_for_memory(
            config.cache.kv_cache_memory_gb,
            kv_cache_bytes_per_block(arch, block_size, dtype),
        )
        kv_caches = allocate_kv_cache(arch, num_blocks, block_size, dtype, self.device)
        self.budget_defaults = BudgetDefaults(
            config.cache.default_kv_policy, config.cache.default_kv_budget
        )
        self.runner = ModelRunner(
            self.loaded.model,
            kv_caches,
            block_size,
            arch.sliding_window,
            self.device,
            num_layers=arch.num_hidden_layers,
            num_kv_heads=kv_caches[0][0].shape[2],
            budget_defaults=self.budget_defaults,
        )
        self.block_manager = BlockManager(num_blocks, block_size, config.cache.enable_prefix_caching)
        s = config.scheduler
        self.scheduler = Scheduler(
            SchedulerConfig(s.max_num_batched_tokens, s.max_num_seqs, s.enable_chunked_prefill),
            self.block_manager,
        )
        self.spec = self._build_speculative(config, arch, dtype, num_blocks, block_size)
        self.eos_token_ids = self._eos_ids()
        self.requests: dict[str, _Request] = {}
        self._seq_owner: dict[int, _Request] = {}
        self._ids = itertools.count()
        self.num_steps = 0

    def _build_speculative(self, config: EngineConfig, arch, dtype, num_blocks: int, block_size: int):
        """Load the draft with its own KV pool (as many token slots as the target's)."""
        if config.spec.draft is None:
            return None
        from keyserve.engine.draft_worker import DraftWorker
        from keyserve.engine.speculative import SpeculativeDecoder
        from keyserve.model.draft import load_draft
        from keyserve.model.kv_cache import allocate_kv_cache

        draft = load_draft(config.spec.draft, self.loaded, dtype=dtype, device=self.device)
        if draft.config.vocab_size != arch.vocab_size:
            raise ValueError(
                f"draft vocabulary ({draft.config.vocab_size}) differs from the target's ({arch.vocab_size})"
            )
        kv = allocate_kv_cache(draft.config, num_blocks, block_size, dtype, self.device)
        runner = ModelRunner(
            draft.model, kv, block_size, draft.config.sliding_window, self.device,
            num_layers=draft.config.num_hidden_layers, num_kv_heads=kv[0][0].shape[2],
        )
        drafter = DraftWorker(runner, BlockManager(num_blocks, block_size, True), arch.vocab_size)
        cost = config.spec.draft_cost_ratio or min(1.0, _weight_bytes(draft.model) / _weight_bytes(self.loaded.model))
        return SpeculativeDecoder(drafter, config.spec, cost)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        eos = getattr(self.loaded.config, "eos_token_ids", None) or getattr(
            self.loaded.config, "eos_token_id", None
        )
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
        return list(prompt)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; send a plain prompt")
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
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
        """Validate and queue a request; raises ValueError on bad input, leaving nothing behind."""
        params = params or SamplingParams()
        if forced_token_ids is not None:
            if params.n != 1 or not forced_token_ids:
                raise ValueError("teacher forcing needs n == 1 and at least one forced token")
            params = params.model_copy(
                update={"max_tokens": len(forced_token_ids), "speculative": False, "logprobs": True,
                        "ignore_eos": True, "stop": [], "stop_token_ids": []}
            )
        if params.speculative and self.spec is None:
            raise ValueError("speculative=true needs a draft model (start the engine with a draft)")
        if isinstance(prompt, str) and not prompt.strip() and not prompt_token_ids:
            raise ValueError("prompt is empty")
        token_ids = prompt_token_ids if prompt_token_ids is not None else self.encode_prompt(prompt, chat)
        if not token_ids:
            raise ValueError("prompt is empty (no tokens)")
        vocab = self.loaded.config.vocab_size
        if any(t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(token_ids)} tokens but the model's context is "
                f"{self.max_model_len} tokens (at least one must remain for generation)"
            )
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        now = time.monotonic()
        seqs = [
            Sequence(request_id, list(token_ids), params, arrival=now, sample_index=i)
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
        for seq in seqs:
            seq.kv_budgeted = budget_spec(seq, self.budget_defaults) is not None
            req.detoks[seq.seq_id] = IncrementalDetokenizer(self.tokenizer, params.stop)
            req.generators[seq.seq_id] = make_generator(params.seed, seq.sample_index)
            self._seq_owner[seq.seq_id] = req
        self.requests[request_id] = req
        self.scheduler.add(seqs[0])
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request and free its blocks."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        for seq in req.all_seqs:
            if not seq.is_finished:
                self._finish(seq, FinishReason.ABORT)
        req.pending_forks = []
        return self._pop_finished(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------- step
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return a snapshot of every request that made progress."""
        spec = self.spec
        if spec is not None:
            for seq in self.scheduler.running:
                seq.num_lookahead = (
                    spec.lookahead(seq, self.max_model_len) if seq.num_uncomputed_tokens == 1 else 0
                )
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        verify = [it for it in plan.prefill if it.num_lookahead]
        proposal = spec.propose(verify) if verify else None
        if proposal is not None:  # those the draft could not serve decode plainly
            keep = [i for i, it in enumerate(verify) if it.draft_token_ids]
            verify = [verify[i] for i in keep]
            proposal = _select_rows(proposal, keep)
        forced = [
            it for it in plan.scheduled
            if it.completes and self._seq_owner[it.seq.seq_id].forced_token_ids is not None
        ]
        skip = {id(it) for it in verify} | {id(it) for it in forced}
        samples, generators = self._sample_requests(plan, exclude=skip)
        for item in verify:
            generators[item.seq.seq_id] = self._seq_owner[item.seq.seq_id].generators[item.seq.seq_id]
        rows = {it.seq.seq_id: it.num_query_tokens for it in verify}
        rows.update({it.seq.seq_id: 1 for it in forced})
        result = self.runner.execute(plan, samples, generators, logits_rows=rows)
        self.num_steps += 1
        now = time.monotonic()
        touched: dict[str, _Request] = {}
        for item in plan.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.commit_computed(item.seq)
            touched[item.seq.request_id] = self._seq_owner[item.seq.seq_id]
        if verify:
            assert spec is not None and proposal is not None
            for item, ver in zip(verify, spec.verify(verify, proposal, result.logits, generators)):
                seq = item.seq
                seq.num_computed_tokens += ver.num_accepted  # the accepted drafts' KV is valid
                self.block_manager.truncate(seq, seq.num_computed_tokens)  # drop rejected slots
                req = self._seq_owner[seq.seq_id]
                for j, token in enumerate(ver.token_ids):
                    lp = ver.logprobs[j] if ver.logprobs else None
                    self._append_token(req, seq, token, lp, now)
                    if seq.is_finished:  # a stop condition inside the accepted run
                        break
                else:
                    self.block_manager.commit_computed(seq)
        for item in forced:
            seq = item.seq
            req = self._seq_owner[seq.seq_id]
            token = req.forced_token_ids[len(seq.output_token_ids)]
            logprob = torch.log_softmax(result.logits[seq.seq_id][-1].float(), dim=-1)[token]
            self._append_token(req, seq, token, float(logprob), now)
        self._compact_prompts([it.seq for it in forced])
        for req_sample in samples:
            source = req_sample.source.seq
            req = self._seq_owner[source.seq_id]
            # Siblings fork from the computed prompt before any token can finish (and free) it.
            for target in req_sample.targets[1:]:
                self.block_manager.fork(source, target)
                self.runner.budget.fork(source, target)
                req.pending_forks.remove(target)
                req.seqs.append(target)
                self.scheduler.add_running(target)
            for target in req_sample.targets:
                token = result.tokens[target.seq_id]
                self._append_token(req, target, token, result.logprobs.get(target.seq_id), now)
        self._compact_prompts([t for r in samples for t in r.targets])
        outputs = []
        for req in touched.values():
            held = sum(len(s.block_table) for s in req.seqs)
            req.max_blocks = max(req.max_blocks, held)
            if req.finished:
                outputs.append(self._pop_finished(req))
            else:
                outputs.append(self._snapshot(req))
        return outputs

    def _sample_requests(self, plan: StepPlan, exclude: set[int] = frozenset()) -> tuple[list[SampleRequest], dict]:
        samples = []
        generators: dict[int, torch.Generator | None] = {}
        for item in plan.scheduled:
            if not item.completes or id(item) in exclude:
                continue
            seq = item.seq
            req = self._seq_owner[seq.seq_id]
            targets = [seq]
            if seq.sample_index == 0 and req.pending_forks and not seq.output_token_ids:
                targets += req.pending_forks
            for t in targets:
                generators[t.seq_id] = req.generators[t.seq_id]
            samples.append(SampleRequest(item, targets))
        return samples, generators

    def _append_token(self, req: _Request, seq: Sequence, token: int, logprob: float | None, now: float) -> None:
        seq.append_token(token, logprob)
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
        elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        if reason is not None:
            self._finish(seq, reason)

    def _compact_prompts(self, seqs: list[Sequence]) -> None:
        """Prompt-phase eviction for budgeted sequences whose prompt is now computed: keep k
        tokens per (layer, head), move them into the first blocks, free the rest."""
        budget = self.runner.budget
        bm = self.block_manager
        for seq in seqs:
            state = budget.get(seq)
            if seq.is_finished or state is None or not budget.due_for_compaction(seq):
                continue
            k = state.spec.budget
            assert k is not None
            if state.num_slots > k:
                copies = bm.make_writable(seq, list(range(bm.blocks_for_slots(k))))
                if copies is None:
                    continue  # the pool cannot copy shared blocks now; retry next step
                self.runner.copy_blocks(copies)
                keep = budget.select_prompt(seq)
                if keep is not None:
                    compact_kv(self.runner.kv_caches, seq.block_table, keep, bm.block_size)
                bm.truncate(seq, k)
            else:
                budget.select_prompt(seq)
            seq.kv_slot_cap = k

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        state = self.runner.budget.get(seq)
        if state is not None:
            seq.kv_tokens_held, seq.kv_tokens_evicted = state.num_slots, state.num_evicted
        self.runner.budget.release(seq)
        if self.spec is not None:
            self.spec.release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.monotonic()
        self.scheduler.remove(seq)

    # ---------------------------------------------------------------- outputs
    def _snapshot(self, req: _Request) -> RequestOutput:
        outs = []
        for seq in sorted(req.seqs, key=lambda s: s.sample_index):
            detok = req.detoks[seq.seq_id]
            outs.append(
                CompletionOutput(
                    index=seq.sample_index,
                    text=detok.text,
                    token_ids=list(seq.output_token_ids),
                    finish_reason=seq.finish_reason.value if seq.finish_reason else None,
                    logprobs=list(seq.output_logprobs) if seq.params.logprobs else None,
                )
            )
        return RequestOutput(
            req.request_id, req.prompt, req.prompt_token_ids, outs, req.finished, self._stats(req)
        )

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
        if self.spec is None or req.request_id not in self.spec.request_stats:
            return {}
        st = self.spec.request_stats[req.request_id]
        return {
            "spec_draft_tokens": st.num_draft_tokens,
            "spec_accepted_tokens": st.num_accepted_tokens,
            "spec_acceptance_rate": st.acceptance_rate,
            "spec_tokens_per_forward": st.mean_tokens_per_forward,
        }

    def _kv_held(self, seq: Sequence) -> int:
        state = self.runner.budget.get(seq)
        if state is not None:
            return state.num_slots
        return seq.kv_tokens_held if seq.kv_budgeted else seq.num_computed_tokens

    def _kv_evicted(self, seq: Sequence) -> int:
        state = self.runner.budget.get(seq)
        return state.num_evicted if state is not None else seq.kv_tokens_evicted

    def _pop_finished(self, req: _Request) -> RequestOutput:
        req.finish_time = max((s.finish_time or 0.0) for s in req.seqs) or time.monotonic()
        self.requests.pop(req.request_id, None)
        for seq in req.all_seqs:
            self._seq_owner.pop(seq.seq_id, None)
        out = self._snapshot(req)
        if self.spec is not None:
            self.spec.pop_request_stats(req.request_id)
        return out

    # ---------------------------------------------------------------- helpers
    def run_until_done(self) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    finished[out.request_id] = out
            if not self.scheduler.has_work and self.requests:
                raise RuntimeError("engine has requests but nothing schedulable")
        return finished


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _select_rows(proposal, rows: list[int]):
    from keyserve.engine.draft_worker import Proposal

    index = torch.tensor(rows, dtype=torch.int64)
    return Proposal(proposal.token_ids[index], proposal.probs[index], proposal.num_draft[index])
