"""Logits → processed probabilities → sampled tokens, vectorised over the batch.

Per-request randomness comes from a per-sequence ``torch.Generator`` seeded from the request
seed and the sample index, so a seeded request gives the same tokens whatever else shares its
batch, and a preempted request resamples nothing (its generator only advances per new token).
Sampling is by inverse CDF (``inverse_cdf``): one float64 uniform per row, the first token
whose cumulative mass exceeds it. It replaced an exponential race (``argmax(p / E)``,
``E ~ Exp(1)``), exact too but needing a vocabulary-wide noise vector per row: drawing
8 x 49152 exponentials took 17 ms on one core (twice for seeded rows), more than a batch-8 decode
step's whole forward at T = 0.8, where the cumulative sum costs ~1 ms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from keyserve.core.sampling_params import SamplingParams

_MASKED = float("-inf")
# Temperatures below this act as greedy: dividing logits by a denormal temperature overflows to
# inf and the softmax turns into NaN.
GREEDY_BELOW = 1e-5


@dataclass
class SamplingTensors:
    """The batch's sampling parameters as tensors (rows = sequences)."""

    temperature: torch.Tensor  # [num_seqs] float32; 0 = greedy
    top_k: torch.Tensor  # [num_seqs] int64; 0 = off
    top_p: torch.Tensor  # [num_seqs] float32
    min_p: torch.Tensor  # [num_seqs] float32
    all_greedy: bool
    any_top_k_top_p: bool
    any_min_p: bool

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: torch.device | str = "cpu") -> "SamplingTensors":
        temps = [p.temperature for p in params]
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            min_p=torch.tensor(min_p, dtype=torch.float32, device=device),
            all_greedy=all(t < GREEDY_BELOW for t in temps),
            any_top_k_top_p=any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p),
            any_min_p=any(m > 0.0 for m in min_p),
        )

    def expand(self, repeats: int) -> "SamplingTensors":
        """Each row repeated ``repeats`` times (speculative positions of one sequence)."""
        rep = lambda t: t.repeat_interleave(repeats)  # noqa: E731
        return SamplingTensors(
            rep(self.temperature), rep(self.top_k), rep(self.top_p), rep(self.min_p),
            self.all_greedy, self.any_top_k_top_p, self.any_min_p,
        )


def processed_logits(
    logits: torch.Tensor,  # [num_rows, vocab] float32
    st: SamplingTensors,
) -> torch.Tensor:  # [num_rows, vocab] float32, masked tokens = -inf
    """Temperature, then top-k, top-p and min-p masks. Greedy rows are returned unscaled."""
    greedy = st.temperature < GREEDY_BELOW
    temp = torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
    out = logits / temp[:, None]
    if st.any_top_k_top_p:
        out = _apply_top_k_top_p(out, st.top_k, st.top_p)
    if st.any_min_p:
        probs = torch.softmax(out, dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * st.min_p[:, None]
        out = out.masked_fill(probs < threshold, _MASKED)
    return out


def _apply_top_k_top_p(
    logits: torch.Tensor,  # [num_rows, vocab]
    top_k: torch.Tensor,  # [num_rows] int64, 0 = off
    top_p: torch.Tensor,  # [num_rows] float32
) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    drop = ranks >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, _MASKED)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # Rows with top_p == 1 keep everything (float32 cumsums can reach 1.0 before the tail).
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    drop[:, 0] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(drop, _MASKED)
    return torch.full_like(logits, _MASKED).scatter(-1, order, sorted_logits)


def row_argmax(x: torch.Tensor) -> torch.Tensor:  # [num_rows, vocab] -> [num_rows] int64
    """``x.argmax(-1)`` (the first index of the row's maximum; NaN wins), by ``max``'s indices:
    torch's CPU argmax kernel is ~2.5x slower over a 49152-wide vocabulary, a cost paid by every
    greedy decode step."""
    return torch.max(x, dim=-1).indices


def processed_probs(
    logits: torch.Tensor,  # [num_rows, vocab] float32
    st: SamplingTensors,
) -> torch.Tensor:  # [num_rows, vocab] float32
    """The distribution each row samples from; greedy rows are one-hot on the argmax."""
    probs = torch.softmax(processed_logits(logits, st), dim=-1)
    greedy = st.temperature < GREEDY_BELOW
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def uniforms(
    num_rows: int,
    width: int,
    generators: list[torch.Generator | None],
    device: torch.device | str,
    widths: torch.Tensor | None = None,  # [num_rows] int64: values a seeded row draws (<= width)
    dtype: torch.dtype = torch.float32,  # float64 for inverse-CDF draws (``inverse_cdf``)
) -> torch.Tensor:  # [num_rows, width] in [0, 1)
    """U(0, 1) per row: one batched draw from the global RNG, then the rows with a generator
    redrawn from it, so a seeded request's stream depends on nothing else in the batch. With
    ``widths`` a seeded row draws only its own count (the rest of its row is never read): the
    accept uniforms of a row with 2 drafts must not depend on a neighbour drafting 4 (found by
    a hostile-input sweep: the seeded row's later draws all shifted)."""
    out = torch.rand(num_rows, width, dtype=dtype, device=device)
    seeded = [row for row, gen in enumerate(generators) if gen is not None]
    counts = widths.tolist() if widths is not None and seeded else None
    for row in seeded:
        gen = generators[row]
        n = width if counts is None else min(int(counts[row]), width)
        out[row, :n] = torch.rand(n, dtype=dtype, generator=gen, device=gen.device)
    return out


def row_uniforms(
    generators: list[torch.Generator | None], device: torch.device | str
) -> torch.Tensor:  # [num_rows] float64 in [0, 1)
    """One U(0, 1) per row for an inverse-CDF draw, float64 (53 bits: no token's share of
    [0, 1) is rounded to a coarser grid than its float32 probability); ``uniforms``' rule for
    seeded rows."""
    return uniforms(len(generators), 1, generators, device, dtype=torch.float64)[:, 0]


def inverse_cdf(
    probs: torch.Tensor,  # [num_rows, vocab] non-negative, need not sum to 1
    u: torch.Tensor,  # [num_rows] in [0, 1)
) -> torch.Tensor:  # [num_rows] int64
    """The first token whose cumulative mass exceeds ``u`` times the row's total: a draw from
    probs / sum. The sum runs in float64 (a float32 sum over 49152 tokens moves a late token's
    interval by up to half an ulp of 1, 3 % of a 1e-6 probability). A zero-probability token
    never is that first one (its cumulative mass equals the token's before it, or is 0 for
    token 0, and 0 > u·total never holds); when rounding puts u·total at or past the last
    cumulative value, the row's last positive token is taken, not the vocabulary's last (which
    may have zero probability)."""
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)  # [num_rows, vocab], non-decreasing
    target = (u.to(torch.float64) * cdf[:, -1])[:, None]  # [num_rows, 1]
    first = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # [num_rows] count of cdf <= target
    vocab = probs.shape[-1]
    if not bool((first >= vocab).any()):  # the rounding case is rare: skip a vocabulary-wide scan
        return first
    last_positive = (vocab - 1) - (probs > 0).flip(-1).to(torch.uint8).argmax(dim=-1)
    return torch.where(first < vocab, first, last_positive)


def sample(
    logits: torch.Tensor,  # [num_seqs, vocab] float32 raw model logits
    st: SamplingTensors,
    generators: list[torch.Generator | None],
    want_logprobs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # tokens [num_seqs] int64, logprobs [num_seqs]
    """Sample one token per row. Logprobs are of the raw model distribution."""
    if st.all_greedy:
        tokens = row_argmax(logits)
    else:
        probs = torch.softmax(processed_logits(logits, st), dim=-1)
        sampled = inverse_cdf(probs, row_uniforms(generators, logits.device))
        tokens = torch.where(st.temperature < GREEDY_BELOW, row_argmax(logits), sampled)
    logprobs = None
    if want_logprobs:
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None])[:, 0]
    return tokens, logprobs


def top_logprobs(
    logits: torch.Tensor,  # [num_rows, vocab] float32 raw model logits
    counts: list[int],  # alternatives per row (0: none)
) -> list[list[tuple[int, float]]]:  # per row: (token id, logprob), most likely first
    """The most likely tokens of each row's raw model distribution with their log-probabilities
    (``SamplingParams.top_logprobs``, as vLLM's default raw logprobs): one ``topk`` over the
    rows that ask, one copy to the host."""
    if max(counts, default=0) == 0:
        return [[] for _ in counts]
    rows = [i for i, c in enumerate(counts) if c]
    picked = logits if len(rows) == len(counts) else logits[torch.tensor(rows, device=logits.device)]
    tops = top_entries(torch.log_softmax(picked.float(), dim=-1), [counts[i] for i in rows])
    out: list[list[tuple[int, float]]] = [[] for _ in counts]
    for j, i in enumerate(rows):
        out[i] = tops[j]
    return out


def top_entries(
    logp: torch.Tensor,  # [num_rows, vocab] log-probabilities
    counts: list[int],  # entries per row (0: none)
) -> list[list[tuple[int, float]]]:  # per row: (token id, logprob), most likely first
    """Each row's ``counts[row]`` likeliest tokens: one ``topk`` at the widest count, one copy to
    the host (``top_logprobs``, and the prompt rows' alternatives, engine/prompt_logprobs.py)."""
    k = max(counts, default=0)
    if k == 0:
        return [[] for _ in counts]
    values, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return [list(zip(i[:c], v[:c])) for i, v, c in zip(ids.tolist(), values.tolist(), counts, strict=True)]


def make_generator(seed: int | None, sample_index: int, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A per-sequence generator for seeded requests (None: use the global RNG), on the device
    its draws are made on."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(hash((seed, sample_index)) & 0x7FFF_FFFF_FFFF_FFFF)
    return gen
