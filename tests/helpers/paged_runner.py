"""Drive a model over a paged KV cache without the engine: the parity tests' oracle runner.

``PagedRunner`` owns a KV pool whose free list is shuffled, so every sequence's pages are
non-contiguous and out of order (what a long-running block manager produces), and packs each
step exactly as the engine does: decode tokens first, then prefill chunks.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from keyserve.kernels.metadata import AttentionMetadata
from keyserve.model.kv_cache import allocate_kv_cache
from keyserve.model.llama import LlamaForCausalLM


def _pad_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """[num_seqs, max_blocks] int32, padded with block 0 (any valid id; masked by length)."""
    width = max((len(t) for t in tables), default=0)
    rows = [t + [0] * (width - len(t)) for t in tables]
    return torch.tensor(rows, dtype=torch.int32, device=device).view(len(tables), width)


class PagedRunner:
    """A minimal block allocator + metadata builder around one model and its KV cache."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int = 256,
        block_size: int = 16,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.kv_caches = allocate_kv_cache(
            model.config, num_blocks, block_size, model.dtype, device, model.tp.rank, model.tp.size
        )
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def _grow(self, seq_id: int, new_len: int) -> list[int]:
        """Allocate blocks on demand so ``seq_id`` can hold ``new_len`` tokens."""
        table = self.tables.setdefault(seq_id, [])
        while len(table) * self.block_size < new_len:
            if not self.free:
                raise RuntimeError("PagedRunner ran out of KV blocks")
            table.append(self.free.pop())
        return table

    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        b = self.block_size
        return [table[p // b] * b + p % b for p in range(start, end)]

    def free_seq(self, seq_id: int) -> None:
        self.free.extend(self.tables.pop(seq_id, []))
        self.lengths.pop(seq_id, None)

    def build(
        self,
        decode: Sequence[tuple[int, int]] = (),  # (seq_id, token)
        prefill: Sequence[tuple[int, Sequence[int]]] = (),  # (seq_id, chunk tokens)
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids [n], positions [n], metadata) for one step; advances sequence lengths."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        dec_tables, dec_lens, pre_tables, pre_lens, starts = [], [], [], [], [0]
        for seq_id, chunk in [(s, [t]) for s, t in decode] + [(s, list(c)) for s, c in prefill]:
            start = self.lengths.get(seq_id, 0)
            end = start + len(chunk)
            table = self._grow(seq_id, end)
            self.lengths[seq_id] = end
            ids += chunk
            positions += range(start, end)
            slots += self._slots(table, start, end)
            if len(dec_tables) < len(decode):
                dec_tables.append(list(table))
                dec_lens.append(end)
            else:
                pre_tables.append(list(table))
                pre_lens.append(end)
                starts.append(starts[-1] + len(chunk))
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decode_seqs=len(decode),
            decode_block_tables=_pad_tables(dec_tables, dev),
            decode_context_lens=torch.tensor(dec_lens, dtype=torch.int32, device=dev),
            prefill_block_tables=_pad_tables(pre_tables, dev),
            prefill_query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            prefill_context_lens=torch.tensor(pre_lens, dtype=torch.int32, device=dev),
            sliding_window=self.model.config.sliding_window,
        )
        as_long = dict(dtype=torch.int64, device=dev)
        return torch.tensor(ids, **as_long), torch.tensor(positions, **as_long), meta

    @torch.inference_mode()
    def step(
        self,
        decode: Sequence[tuple[int, int]] = (),
        prefill: Sequence[tuple[int, Sequence[int]]] = (),
    ) -> torch.Tensor:  # [num_tokens, vocab] float32, rows in packing order
        """Run one packed step and return the logits of every token in it."""
        input_ids, positions, meta = self.build(decode, prefill)
        hidden, _ = self.model(input_ids, positions, self.kv_caches, meta)
        return self.model.compute_logits(hidden)

    def teacher_forced(
        self,
        seqs: dict[int, Sequence[int]],  # seq_id -> full token list (prompt + continuation)
        prompt_lens: dict[int, int],
        chunks: int = 1,
    ) -> dict[int, torch.Tensor]:  # seq_id -> [len(tokens), vocab] logits at every position
        """Prefill every prompt (packed, in ``chunks`` pieces), then decode the rest one token
        per step with all unfinished sequences batched -- the engine's schedule, fixed tokens."""
        out: dict[int, list[torch.Tensor]] = {s: [] for s in seqs}
        for c in range(chunks):
            prefill = []
            for s, toks in seqs.items():
                n = prompt_lens[s]
                lo, hi = n * c // chunks, n * (c + 1) // chunks
                if hi > lo:
                    prefill.append((s, list(toks[lo:hi])))
            logits = self.step(prefill=prefill)
            row = 0
            for s, chunk in prefill:
                out[s].append(logits[row : row + len(chunk)])
                row += len(chunk)
        longest = max(len(t) - prompt_lens[s] for s, t in seqs.items())
        for i in range(longest):
            decode = [
                (s, int(toks[prompt_lens[s] + i]))
                for s, toks in seqs.items()
                if prompt_lens[s] + i < len(toks)
            ]
            logits = self.step(decode=decode)
            for row, (s, _) in enumerate(decode):
                out[s].append(logits[row : row + 1])
        return {s: torch.cat(parts) for s, parts in out.items()}

    @torch.inference_mode()
    def greedy(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        seq_id: int = 0,
        stop_token_ids: Sequence[int] = (),
    ) -> list[int]:
        """Greedy continuation of one prompt (batch 1); see ``greedy_batch``."""
        return self.greedy_batch({seq_id: prompt}, max_new_tokens, stop_token_ids)[seq_id]

    @torch.inference_mode()
    def greedy_batch(
        self,
        prompts: dict[int, Sequence[int]],  # seq_id -> prompt tokens
        max_new_tokens: int,
        stop_token_ids: Sequence[int] = (),
    ) -> dict[int, list[int]]:
        """Greedy continuations of several prompts decoded together (continuous batching with
        fixed membership); a sequence stops after emitting a stop token, which is included
        (as transformers' ``generate`` does)."""
        logits = self.step(prefill=[(s, list(p)) for s, p in prompts.items()])
        ends = torch.tensor([len(p) for p in prompts.values()]).cumsum(0) - 1
        out = {s: [int(t)] for s, t in zip(prompts, logits[ends].argmax(-1).tolist())}

        def running() -> list[int]:
            return [
                s for s, g in out.items() if len(g) < max_new_tokens and g[-1] not in stop_token_ids
            ]

        while active := running():
            logits = self.step(decode=[(s, out[s][-1]) for s in active])
            for s, t in zip(active, logits.argmax(-1).tolist()):
                out[s].append(int(t))
        return out
