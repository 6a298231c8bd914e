"""An independent dense replay of H2O / Keyformer (docs/algorithms.md §2, §3) for engine tests.

transformers' own modules (embeddings, norms, projections, rotary embedding, MLP, LM head) run
the model; only the attention core is written out here, in plain torch over a dense K/V of
every position, so that each (layer, kv-head) can see exactly the tokens it still holds. The
budget's bookkeeping -- which position sits in which slot, the accumulated scores S, the victim
of each decode step, the prompt selection and its compaction, the settling of a speculative
verification -- is recomputed here per (layer, kv-head) in plain Python / torch, from the
rules, not from ``core.kv_policy``. The one thing shared with the engine is the noise function
(``kernels.noise``: what Keyformer's Gumbel noise *is*, tested on its own), so a Keyformer
replay draws the same ζ.
"""

from __future__ import annotations

import math

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from keyserve.kernels import noise


class DenseBudgetOracle:
    """One sequence under an H2O or Keyformer budget of ``k`` tokens per (layer, kv-head)."""

    def __init__(self, hf_model, policy: str, k: int, recent_ratio: float, seed: int,
                 max_tokens: int, tau_init: float = 1.0, tau_end: float = 2.0,
                 window: str = "all", pooling: str = "kv_head") -> None:
        cfg = hf_model.config
        self.hf = hf_model
        self.policy, self.k = policy, k
        # The scoring options: S = the newest query's attention instead of the sum over all
        # queries ("last"); tokens ranked by S over the number of queries that attended them
        # ("mean"); one S per layer, the sum over its kv-heads, given to each ("layer").
        self.window, self.pooling = window, pooling
        self.w = max(0, min(k, int(math.floor(recent_ratio * k + 0.5))))  # round half up
        self.seed = noise.request_seed(seed, 0)
        self.max_tokens, self.tau_init, self.tau_end = max_tokens, tau_init, tau_end
        self.L, self.Hq, self.H = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
        self.group = self.Hq // self.H
        self.d = cfg.hidden_size // self.Hq if getattr(cfg, "head_dim", None) is None else cfg.head_dim
        self.keys: list[torch.Tensor] = []  # per layer [H, T, d], every position ever computed
        self.values: list[torch.Tensor] = []
        # Per (layer, kv-head): position -> slot of every held position, and S by position.
        self.slot_of: list[list[dict[int, int]]] = [[{} for _ in range(self.H)] for _ in range(self.L)]
        self.score: list[list[dict[int, float]]] = [[{} for _ in range(self.H)] for _ in range(self.L)]
        self.num_tokens = 0
        self.ties_followed = 0  # near-ties decided the engine's way (see ``_follow``)

    # ------------------------------------------------------------------ views
    def positions(self) -> torch.Tensor:  # [L, H, num_slots] int64: position held in each slot
        n = len(self.slot_of[0][0])
        out = torch.full((self.L, self.H, n), -1, dtype=torch.long)
        for layer in range(self.L):
            for h in range(self.H):
                for pos, slot in self.slot_of[layer][h].items():
                    out[layer, h, slot] = pos
        return out

    def scores(self) -> torch.Tensor:  # [L, H, num_slots] float32: S of the token in each slot
        pos = self.positions()
        out = torch.zeros(pos.shape, dtype=torch.float32)
        for layer in range(self.L):
            for h in range(self.H):
                for slot, p in enumerate(pos[layer, h].tolist()):
                    out[layer, h, slot] = self.score[layer][h][p]
        return out

    # ------------------------------------------------------------------ phases
    def prompt(self, ids: list[int], follow: torch.Tensor | None = None) -> torch.Tensor:  # [vocab]
        """All prompt queries (τ = 1) attend causally and score; then keep w recent + the top
        k − w by S, compacted into slots 0..k−1. ``follow`` (the engine's positions per slot
        afterwards, ``[L, H, k]``) settles near-ties only (``_follow``)."""
        n = len(ids)
        for layer in range(self.L):
            for h in range(self.H):
                self.slot_of[layer][h] = {p: p for p in range(n)}
                self.score[layer][h] = {p: 0.0 for p in range(n)}
        logits = self._forward(ids, 0, [1.0] * n)
        self._evict_down_to(self.k, follow)
        return logits[-1]

    def decode(self, token: int, step: int, follow: torch.Tensor | None = None) -> torch.Tensor:  # [vocab]
        """Evict, then write: the lowest-S candidate (not among the w − 1 newest held, ties
        to the oldest) gives its slot to the new token, which starts with its own score."""
        p = self.num_tokens
        for layer in range(self.L):
            for h in range(self.H):
                slots, s = self.slot_of[layer][h], self.score[layer][h]
                if len(slots) >= self.k:
                    r = self._ranking(s, p)
                    cands = sorted((q for q in slots if q <= p - self.w), key=lambda q: (r[q], q))
                    [victim] = self._follow(cands, 1, r, slots, follow, layer, h)
                    slot = slots.pop(victim)
                    del s[victim]
                else:
                    slot = len(slots)
                slots[p] = slot
                s[p] = 0.0
        return self._forward([token], p, [self._tau(step)])[0]

    def verify(self, tokens: list[int], step: int,
               follow: torch.Tensor | None = None) -> torch.Tensor:  # [len(tokens), vocab]
        """A speculative verification, replayed over its accepted rows only (a rejected row's
        scores never count and no accepted row attends to it): the rows go to spare slots
        after the held ones, their scores add up, then the policy evicts down to k at once."""
        p0 = self.num_tokens
        for layer in range(self.L):
            for h in range(self.H):
                slots, s = self.slot_of[layer][h], self.score[layer][h]
                base = len(slots)
                for i in range(len(tokens)):
                    slots[p0 + i] = base + i
                    s[p0 + i] = 0.0
        logits = self._forward(tokens, p0, [self._tau(step + i) for i in range(len(tokens))])
        self._evict_down_to(self.k, follow)
        return logits

    # ------------------------------------------------------------------ rules
    def _tau(self, step: int) -> float:
        if self.policy != "keyformer":
            return 1.0
        return self.tau_init + step * (self.tau_end - self.tau_init) / self.max_tokens

    def _ranking(self, s: dict[int, float], queries: int) -> dict[int, float]:
        """What eviction orders by: S, or under "mean" S / (queries at or after the position,
        of the ``queries`` computed so far)."""
        if self.window != "mean":
            return s
        return {q: v / max(1, queries - q) for q, v in s.items()}

    def _follow(self, cands: list[int], count: int, s: dict[int, float], slots: dict[int, int],
                follow: torch.Tensor | None, layer: int, h: int) -> list[int]:
        """The ``count`` positions to evict: the first ``count`` candidates in (S, position) order,
        unless the engine (``follow``) evicted others that differ from them only among
        candidates whose S is within float rounding (1e-5 relative) of the cut -- a near-tie
        that float summation order may decide either way; then the engine's, counted."""
        mine = cands[:count]
        if follow is None or not mine:
            return mine
        theirs = sorted(set(slots) - set(follow[layer, h].tolist()) - {self.num_tokens})
        if sorted(mine) == theirs or len(theirs) != count:
            return mine
        cut = s[mine[-1]]
        near = {q for q in cands if abs(s[q] - cut) <= 1e-5 * max(1.0, abs(cut))}
        if set(theirs) <= set(cands) and set(theirs) ^ set(mine) <= near:
            self.ties_followed += 1
            return theirs
        return mine

    def _evict_down_to(self, k: int, follow: torch.Tensor | None = None) -> None:
        """Evict the candidates first in (S, position) order until k are held; kept tokens in
        slots < k stay, the holes (ascending) take the kept tokens beyond (ascending slot)."""
        newest = self.num_tokens - 1
        for layer in range(self.L):
            for h in range(self.H):
                slots, s = self.slot_of[layer][h], self.score[layer][h]
                excess = len(slots) - k
                if excess <= 0:
                    continue
                r = self._ranking(s, newest + 1)
                cands = sorted((q for q in slots if q <= newest - self.w), key=lambda q: (r[q], q))
                for q in self._follow(cands, excess, r, slots, follow, layer, h):
                    del slots[q]
                    del s[q]
                movers = sorted((slot, q) for q, slot in slots.items() if slot >= k)
                holes = sorted(set(range(k)) - set(slots.values()))
                for hole, (_, q) in zip(holes, movers):
                    slots[q] = hole

    @torch.no_grad()
    def _forward(self, ids: list[int], p0: int, taus: list[float]) -> torch.Tensor:  # [q, vocab]
        """The model over ``ids`` at positions p0.. with each (layer, kv-head) attending to the
        positions it holds (which include the chunk's own, causally); S += the scores."""
        inner = self.hf.model
        q_len = len(ids)
        pos = torch.arange(p0, p0 + q_len)
        x = inner.embed_tokens(torch.tensor([ids]))  # [1, q, hidden]
        cos, sin = inner.rotary_emb(x, pos[None])
        for layer, block in enumerate(inner.layers):
            attn = block.self_attn
            hs = block.input_layernorm(x)
            q = attn.q_proj(hs).view(1, q_len, self.Hq, self.d).transpose(1, 2)  # [1, Hq, q, d]
            k = attn.k_proj(hs).view(1, q_len, self.H, self.d).transpose(1, 2)
            v = attn.v_proj(hs).view(1, q_len, self.H, self.d).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            if layer == len(self.keys):
                self.keys.append(k[0])
                self.values.append(v[0])
            else:
                self.keys[layer] = torch.cat([self.keys[layer], k[0]], dim=1)
                self.values[layer] = torch.cat([self.values[layer], v[0]], dim=1)
            out = self._attend(layer, q[0], pos, taus)  # [Hq, q, d]
            x = x + attn.o_proj(out.transpose(0, 1).reshape(1, q_len, self.Hq * self.d))
            x = x + block.mlp(block.post_attention_layernorm(x))
        self.num_tokens = p0 + q_len
        return self.hf.lm_head(inner.norm(x))[0]

    def _attend(
        self,
        layer: int,
        q: torch.Tensor,  # [Hq, q, d] rotated queries
        pos: torch.Tensor,  # [q] int64 query positions
        taus: list[float],
    ) -> torch.Tensor:  # [Hq, q, d]
        out = torch.empty_like(q)
        masses: list[dict[int, float]] = [{} for _ in range(self.H)]  # per kv-head: position -> this forward's mass
        for hq in range(self.Hq):
            h = hq // self.group
            held = self.slot_of[layer][h]
            keys = torch.tensor(sorted(held))  # held positions (ascending)
            slot = torch.tensor([held[int(p)] for p in keys])
            visible = keys[None, :] <= pos[:, None]  # [q, n]: the chunk's own, causally
            x = (q[hq] @ self.keys[layer][h, keys].T) / math.sqrt(self.d)  # [q, n]
            x = x.masked_fill(~visible, float("-inf"))
            out[hq] = torch.softmax(x, dim=-1) @ self.values[layer][h, keys]
            if self.policy == "h2o":
                f = torch.softmax(x, dim=-1)
            else:
                row = noise.row_keys(torch.tensor(self.seed), noise.layer_key(layer) + hq, pos[:, None])
                zeta = -torch.log(-torch.log(noise.uniforms(row, slot[None, :]).clamp(1e-20, 1 - 1e-7)))
                tau = torch.tensor(taus)[:, None]
                f = torch.softmax(((x + zeta) / tau).masked_fill(~visible, float("-inf")), dim=-1)
            mass = f[-1] if self.window == "last" else f.sum(dim=0)  # [n]: the newest query's, or all
            for p, m in zip(keys.tolist(), mass.tolist()):
                masses[h][p] = masses[h].get(p, 0.0) + m
        if self.pooling == "layer":  # every kv-head of the layer holds the same positions
            total = {p: sum(masses[h][p] for h in range(self.H)) for p in masses[0]}
            masses = [dict(total) for _ in range(self.H)]
        for h in range(self.H):
            for p, m in masses[h].items():
                self.score[layer][h][p] = m if self.window == "last" else self.score[layer][h][p] + m
        return out
