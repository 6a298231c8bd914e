"""Admission: a request's sampling parameters checked against what this engine and model can use.

The edge (pydantic, ``SamplingParams``) bounds every field by limits that hold for any model;
this is the engine's own line, run in ``LLMEngine.add_request`` whatever the caller: a value
that got past the edge (a ``model_construct``, a new edge that forgot a check, a Python caller)
must fail *its* request here with an error naming the field, never later inside a batched step
where it would take its neighbours down. Values that mean the same as an in-range value are
normalised instead of refused (``top_k`` at or above the vocabulary keeps every token, a
``kv_budget`` beyond the context never evicts, any integer seed is reduced into the
generator's range). Pure Python, no torch: it costs microseconds per request, nothing per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral
from typing import Any, get_args

from keyserve.core.kv_policy import SCORE_POOLINGS, SCORE_WINDOWS, score_mode
from keyserve.core.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from keyserve.engine.errors import InvalidParamError
from keyserve.types import KVPolicyName

SEED_RANGE = 2**63  # seeds are reduced into [0, 2**63) (a torch.Generator takes 64 bits)
MAX_SPECULATIVE_TOKENS = 16  # the engine's K is at most this (config.SpeculativeConfig)
MAX_TEMPERATURE = 1e4  # beyond this every token is equally likely; larger only overflows
MAX_TAU = 1e4
INT64_MAX = 2**63 - 1
_POLICIES = frozenset(get_args(KVPolicyName))


@dataclass(frozen=True)
class EngineLimits:
    """What the loaded model and engine can honour."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    has_draft: bool
    has_prefix_store: bool = False
    # the budget of a request that names none (CacheConfig.default_kv_policy / _budget)
    default_kv_policy: str = "full"
    default_kv_budget: float | None = None


def admit_params(params: Any, limits: EngineLimits) -> SamplingParams:
    """``params`` checked field by field; returns them, or a normalised copy. Raises
    ``InvalidParamError`` naming the first field the engine cannot honour."""
    if not isinstance(params, SamplingParams):
        raise InvalidParamError(f"sampling parameters must be SamplingParams, got {type(params).__name__}", "params")
    p = params
    update: dict[str, Any] = {}
    n = _int(p.n, "n", 1, INT64_MAX)
    if n > limits.max_num_seqs:
        raise InvalidParamError(f"n={n} exceeds the engine's max_num_seqs={limits.max_num_seqs}", "n")
    _int(p.max_tokens, "max_tokens", 1, INT64_MAX)
    _real(p.temperature, "temperature", 0.0, MAX_TEMPERATURE)
    top_k = _int(p.top_k, "top_k", 0, None)
    if top_k >= limits.vocab_size:  # keeps every token: the same as no top-k
        update["top_k"] = 0
    _real(p.top_p, "top_p", 0.0, 1.0, low_open=True)
    _real(p.min_p, "min_p", 0.0, 1.0)
    if p.seed is not None:
        seed = _int(p.seed, "seed", None, None)
        if not 0 <= seed < SEED_RANGE:
            update["seed"] = seed % SEED_RANGE
    stop = _stop_strings(p.stop)
    if stop is not p.stop:
        update["stop"] = stop
    stop_ids = _token_ids(p.stop_token_ids, "stop_token_ids", limits.vocab_size)
    if stop_ids is not p.stop_token_ids:
        update["stop_token_ids"] = stop_ids
    for name in ("ignore_eos", "logprobs"):
        if not isinstance(getattr(p, name), bool):
            raise InvalidParamError(f"{name} must be true or false", name)
    _int(p.top_logprobs, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if p.prompt_logprobs is not None:
        _int(p.prompt_logprobs, "prompt_logprobs", 0, MAX_TOP_LOGPROBS)
    _budget(p, limits, update)
    _speculative(p, limits)
    admitted = p.model_copy(update=update) if update else p
    return _plain_params(admitted)


def check_token_ids(ids: Any, field: str, vocab_size: int) -> list[int]:
    """Token ids (a prompt, forced tokens) as a list of plain ints in ``[0, vocab_size)`` (an
    ``int`` subclass or another integral type, numpy's, is taken as its value: see ``_plain``)."""
    return [int(t) for t in _token_ids(ids, field, vocab_size)]


def _plain(value: Any) -> Any:
    """``value`` with builtin types only (a ``str`` / ``int`` / ``float`` subclass as its value,
    lists and tuples element by element). What a request carries crosses to the Ray engine's
    actors as a plain pickle (``actors/step_channel.py``), which names a value's class: one the
    actor cannot import (a subclass defined in the caller's script) would fail the whole step
    there, and every step after it."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        if type(value) is list and all(a is b for a, b in zip(items, value)):
            return value
        return items
    return value


def _plain_params(p: SamplingParams) -> SamplingParams:
    """``p`` as a ``SamplingParams`` itself (not a subclass) whose fields hold builtin values
    (``_plain``); ``p`` unchanged when it already is one."""
    fields = {name: getattr(p, name) for name in SamplingParams.model_fields}
    plain = {name: _plain(value) for name, value in fields.items()}
    if type(p) is SamplingParams and all(plain[k] is fields[k] for k in fields):
        return p
    return SamplingParams.model_construct(**plain)


# ------------------------------------------------------------------------------------ fields
def _budget(p: SamplingParams, limits: EngineLimits, update: dict[str, Any]) -> None:
    if p.kv_policy is not None and (not isinstance(p.kv_policy, str) or p.kv_policy not in _POLICIES):
        raise InvalidParamError(
            f"kv_policy must be one of {', '.join(sorted(_POLICIES))}, got {_show(p.kv_policy)}", "kv_policy"
        )
    for name, allowed in (("kv_score_window", SCORE_WINDOWS), ("kv_score_pooling", SCORE_POOLINGS)):
        value = getattr(p, name)
        if not isinstance(value, str) or value not in allowed:
            raise InvalidParamError(f"{name} must be one of {', '.join(allowed)}, got {_show(value)}", name)
    policy = p.kv_policy or limits.default_kv_policy
    evicts = (p.kv_budget if p.kv_budget is not None else limits.default_kv_budget) is not None
    # A policy runs only with a budget and a budget only under a policy that evicts: a request
    # that names one half while the server's defaults leave the other unset would run on the full
    # cache, its field silently dropped, so it is refused naming that field.
    if p.kv_policy is not None and p.kv_policy != "full" and not evicts:
        raise InvalidParamError(f"kv_policy={p.kv_policy!r} needs a kv_budget (the request gives none and "
                                "the server sets no default): without one nothing is evicted", "kv_policy")
    if p.kv_budget is not None and p.kv_policy is None and policy == "full":
        raise InvalidParamError("kv_budget needs a kv_policy that evicts (window, streaming_llm, h2o or "
                                "keyformer): the server's default policy is 'full', which never evicts",
                                "kv_budget")
    if p.kv_score_pooling == "layer" and evicts and score_mode(policy) is not None and limits.has_prefix_store:
        # a stored prefix is loaded with its important tokens per kv-head, so the heads of a
        # layer hold different positions and their scores cannot be summed slot by slot; the
        # option only matters when the request (or the server's default) selects by score
        raise InvalidParamError("kv_score_pooling='layer' is not supported with the prefix store "
                                "(its loaded prompts hold different tokens per kv-head)", "kv_score_pooling")
    _real(p.recent_ratio, "recent_ratio", 0.0, 1.0)
    tau_init = _real(p.tau_init, "tau_init", 0.0, MAX_TAU, low_open=True)
    tau_end = _real(p.tau_end, "tau_end", 0.0, MAX_TAU, low_open=True)
    if tau_end < tau_init:
        raise InvalidParamError("tau_end must be >= tau_init", "tau_end")
    if p.kv_budget is None:
        return
    budget = _real(p.kv_budget, "kv_budget", 0.0, None, low_open=True)
    if budget > 1.0:
        if budget != int(budget):
            raise InvalidParamError("kv_budget above 1 is a token count and must be a whole number", "kv_budget")
        if budget > limits.max_model_len:  # holds the whole context: never evicts anything
            update["kv_budget"] = float(limits.max_model_len)


def _speculative(p: SamplingParams, limits: EngineLimits) -> None:
    if p.speculative is not None and not isinstance(p.speculative, bool):
        raise InvalidParamError("speculative must be true, false or null", "speculative")
    if p.speculative and not limits.has_draft:
        raise InvalidParamError(
            "speculative=true needs a draft model (start the engine with a draft)", "speculative"
        )
    if p.num_speculative_tokens is not None:
        _int(p.num_speculative_tokens, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)


def _stop_strings(stop: Any) -> Any:
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise InvalidParamError(f"stop must be a list of strings, got {type(stop).__name__}", "stop")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise InvalidParamError(f"stop strings must be non-empty strings, got {_show(s)}", "stop")
    return stop


def _token_ids(ids: Any, field: str, vocab_size: int) -> Any:
    if not isinstance(ids, (list, tuple)):
        raise InvalidParamError(f"{field} must be a list of token ids, got {type(ids).__name__}", field)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, Integral) or not 0 <= t < vocab_size:
            raise InvalidParamError(
                f"{field} must be token ids in [0, {vocab_size}) (the vocabulary), got {_show(t)}", field
            )
    return ids


def _int(value: Any, field: str, low: int | None, high: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParamError(f"{field} must be an integer, got {_show(value)}", field)
    _in_range(value, field, low, high)
    return value


def _real(value: Any, field: str, low: float | None, high: float | None, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParamError(f"{field} must be a number, got {_show(value)}", field)
    if isinstance(value, int):
        if abs(value) > 2**1000:  # float() of it would overflow
            raise InvalidParamError(f"{field}={_show(value)} is out of range", field)
        value = float(value)
    if not math.isfinite(value):
        raise InvalidParamError(f"{field} must be a finite number, got {value}", field)
    if low_open and value <= (low or 0.0):
        raise InvalidParamError(f"{field} must be > {low}, got {value}", field)
    _in_range(value, field, low, high)
    return value


def _in_range(value: float, field: str, low: float | None, high: float | None) -> None:
    if (low is not None and value < low) or (high is not None and value > high):
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        raise InvalidParamError(f"{field}={_show(value)} is out of range [{lo}, {hi}]", field)


def _show(value: Any) -> str:
    """A short description of a value for an error message (never a 4,000-digit integer)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**18:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
