"""The peer bench's pure logic (bench/peer_bench.py, bench/peers/): which rounds count, the
summaries and bounds, the target verdicts, the workload. No timing, no builds, no processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.peers import results  # noqa: E402
from bench.peers.ggufs import weight_bytes_per_token  # noqa: E402
from bench.peers.results import Round  # noqa: E402


def res(engine: str, precision: str, decode: float, prefill: float) -> dict:
    return {"engine": engine, "precision": precision, "decode_tok_s": decode, "prefill_tok_s": prefill}


def test_rounds_above_the_load_threshold_are_dropped_whole() -> None:
    calm = Round(0, 30.0, loads=[0.4, 1.5, 0.9])  # the threshold itself still counts as calm
    busy = Round(1, 28.0, loads=[0.4, 1.51, 0.3])  # one measurement over: the whole round goes
    empty = Round(2, 29.0)
    kept, dropped = results.split_rounds([calm, busy, empty], max_load=1.5)
    assert [r.index for r in kept] == [0, 2]
    assert [r.index for r in dropped] == [1]


def test_summary_takes_median_and_range_and_the_bound_of_each_round() -> None:
    rounds = [
        Round(0, 20.0, results=[res("keyserve", "float32", 30.0, 500.0)]),
        Round(1, 40.0, results=[res("keyserve", "float32", 50.0, 520.0)]),
        Round(2, 30.0, results=[res("keyserve", "float32", 45.0, 510.0)]),
    ]
    s = results.summarize(rounds, {"float32": 500_000_000})["keyserve float32"]
    assert (s["decode"].median, s["decode"].low, s["decode"].high, s["decode"].n) == (45.0, 30.0, 50.0, 3)
    assert s["prefill"].median == 510.0
    # bound per round = bandwidth / bytes: 40, 80, 60 tok/s; fractions 0.75, 0.625, 0.75
    assert s["bound"].median == pytest.approx(60.0)
    assert s["fraction"].median == pytest.approx(0.75)
    assert s["fraction"].low == pytest.approx(0.625)


def test_summary_without_a_byte_count_has_no_fraction() -> None:
    s = results.summarize([Round(0, 30.0, results=[res("llama.cpp", "Q8_0", 90.0, 200.0)])], {})
    assert s["llama.cpp Q8_0"]["fraction"] is None and s["llama.cpp Q8_0"]["decode"].median == 90.0


def test_spread_text_shows_a_range_only_when_there_is_one() -> None:
    assert results.spread([]) is None
    assert results.spread([12.34]).text() == "12.3"
    assert results.spread([10.0, 12.0, 11.0]).text() == "11.0 (10.0–12.0)"
    assert results.spread([0.8, 0.9]).text(2) == "0.85 (0.80–0.90)"


def summary_for(ks_decode: float, ks_prefill: float, lc_decode: float, lc_prefill: float, bw: float) -> dict:
    rounds = [Round(0, bw, results=[res("keyserve", "float32", ks_decode, ks_prefill),
                                    res("llama.cpp", "F32", lc_decode, lc_prefill)])]
    return results.summarize(rounds, {"float32": 1_000_000_000, "F32": 1_000_000_000})


def test_decode_targets_say_met_and_missed_plainly() -> None:
    # bound = 50 GB/s / 1 GB = 50 tok/s; keyserve 45 = 90 % (met), decode below llama.cpp (missed),
    # prefill ahead (met)
    t = results.decode_targets(summary_for(45.0, 500.0, 46.0, 400.0, 50.0), ["float32"])
    assert [x.verdict for x in t] == ["met", "**missed**", "met"]
    assert t[0].measured == "90%" and t[1].measured == "0.98×" and t[2].measured == "1.25×"
    t = results.decode_targets(summary_for(42.0, 500.0, 40.0, 400.0, 50.0), ["float32"])
    assert t[0].verdict == "**missed**" and t[0].measured == "84%"


def test_a_target_without_numbers_is_not_measured_rather_than_met() -> None:
    t = results.decode_targets({}, ["bfloat16"])
    assert [x.met for x in t] == [None, None, None]
    assert {x.verdict for x in t} == {"not measured"}
    assert "llama.cpp BF16" in t[1].what


def test_throughput_targets_compare_keyserve_with_each_peer() -> None:
    tput = {"float32": {"keyserve": 300.0, "llama-server": 150.0, "transformers": 70.0}}
    t = results.throughput_targets(tput, ["float32"])
    assert [(x.measured, x.verdict) for x in t] == [("2.00×", "met"), ("4.29×", "**missed**")]
    t = results.throughput_targets({"float32": {"keyserve": 300.0, "llama-server": None}}, ["float32"])
    assert t[0].met is None and t[1].met is None
    tput["float32"]["transformers padded"] = 50.0  # the target is against padded batches
    t = results.throughput_targets(tput, ["float32"])
    assert [(x.what.split("/ ")[1], x.measured, x.verdict) for x in t] == [
        ("llama-server", "2.00×", "met"), ("transformers padded", "6.00×", "met"), ("transformers", "4.29×", "**missed**")]


def test_useful_tokens_per_second_of_what_was_done() -> None:
    assert results.useful_tok_s(1000, 4.0) == 250.0
    assert results.useful_tok_s(0, 4.0) is None
    assert results.useful_tok_s(10, 0.0) is None


def test_rotation_starts_each_round_somewhere_else() -> None:
    items = ["bw", "a", "b", "c"]
    orders = [results.rotation(items, r) for r in range(5)]
    assert orders[0] == items and orders[1] == ["a", "b", "c", "bw"] and orders[4] == items
    assert all(sorted(o) == sorted(items) for o in orders)
    assert results.rotation([], 3) == []


def test_common_prefix_of_greedy_tokens() -> None:
    assert results.common_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert results.common_prefix([1, 2], [1, 2, 3]) == 2
    assert results.common_prefix([], [1]) == 0


def test_weight_bytes_read_per_decode_step() -> None:
    # tied: the embedding is also the LM head, read whole
    tied = {"token_embd.weight": (1000, 10), "blk.0.attn_q.weight": (300, 3)}
    assert weight_bytes_per_token(tied) == 1300
    # untied: only one row of the input embedding is read
    untied = dict(tied, **{"output.weight": (1000, 10)})
    assert weight_bytes_per_token(untied) == 1000 + 300 + 100


class CharTokenizer:
    """A real, if tiny, tokenizer: one id per character."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 50000 for c in text]


def test_mixed_workload_is_seeded_and_within_its_ranges() -> None:
    from bench.workloads import mixed_requests

    a = mixed_requests(CharTokenizer(), 64, (50, 1000), (16, 256), seed=0)
    b = mixed_requests(CharTokenizer(), 64, (50, 1000), (16, 256), seed=0)
    c = mixed_requests(CharTokenizer(), 64, (50, 1000), (16, 256), seed=1)
    assert [(r.prompt_token_ids, r.max_tokens) for r in a] == [(r.prompt_token_ids, r.max_tokens) for r in b]
    assert [r.max_tokens for r in a] != [r.max_tokens for r in c]
    assert len(a) == 64
    assert all(50 <= len(r.prompt_token_ids) <= 1000 and 16 <= r.max_tokens <= 256 for r in a)
    assert len({len(r.prompt_token_ids) for r in a}) > 32  # mixed, not one length


def test_quick_is_a_small_float32_smoke_run() -> None:
    from bench.peer_bench import contenders, parse_args

    args = parse_args(["--quick"])
    assert (args.rounds, args.precisions, args.num_requests) == (1, ["float32"], 8)
    assert contenders(args) == [("keyserve", "float32"), ("transformers", "float32"), ("llama.cpp", "F32"),
                                ("llama.cpp", "Q4_1")]
    assert contenders(parse_args([]))[3:6] == [("keyserve", "bfloat16"), ("transformers", "bfloat16"),
                                               ("llama.cpp", "BF16")]
    assert parse_args(["--quick", "--precisions", "bfloat16"]).precisions == ["bfloat16"]
    full = parse_args(["--llama-half", "F16"])
    assert (full.rounds, full.max_load, full.threads, full.num_requests) == (3, 2.5, 2, 64)
    # the measurements' own threads keep the load near --threads: the threshold sits half a core above
    assert parse_args(["--threads", "1"]).max_load == 1.5 and parse_args(["--max-load", "9"]).max_load == 9
    assert ("llama.cpp", "F16") in contenders(full) and ("keyserve", "bfloat16") in contenders(full)


def test_a_contender_stopped_by_its_budget_is_reported_with_what_it_did() -> None:
    from bench.peer_bench import did_text

    d = {"requests": 40, "total_requests": 64, "tokens": 5000, "elapsed": 598.4, "finished": False,
         "budget_s": 600.0, "error": None}
    txt = did_text(d)
    assert "40/64 requests" in txt and "5000 tokens" in txt and "600 s budget" in txt
    assert "did not finish" not in txt
    assert "mismatch" not in did_text(dict(d, finished=True, mismatches=0))
    assert "3 with a token count" in did_text(dict(d, mismatches=3))


def test_fractions_read_as_percent() -> None:
    assert results.spread([0.5]).percent() == "50%"
    assert results.spread([0.45, 0.5, 0.52]).percent() == "50% (45–52 %)"


def test_the_worker_runs_in_a_venv_without_keyserve() -> None:
    """bench/peers/worker.py runs under the bench-only venv too (llama.cpp's side), which has no
    keyserve, transformers or httpx: its module level imports the standard library only."""
    import ast

    tree = ast.parse((Path(__file__).resolve().parents[2] / "bench" / "peers" / "worker.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = {a.name.split(".")[0] for n in top if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in top if isinstance(n, ast.ImportFrom) and n.module}
    assert names <= set(sys.stdlib_module_names) | {"__future__"}, names


def test_greedy_tokens_are_checked_against_transformers() -> None:
    from bench.peer_bench import agreement_texts, reference_of

    def r(engine: str, precision: str, toks: list[int]) -> dict:
        return dict(res(engine, precision, 1.0, 1.0), first_tokens=toks)

    both = [Round(0, 1.0, results=[r("keyserve", "float32", [1, 2, 3, 4]), r("transformers", "bfloat16", [1, 2, 0, 0]),
                                   r("transformers", "float32", [1, 2, 3, 5])])]
    assert reference_of(both) == ("transformers", "float32")
    assert agreement_texts(both) == {"keyserve float32": "3/4", "transformers bfloat16": "2/4",
                                     "transformers float32": "4/4"}
    bf16 = [Round(0, 1.0, results=[r("llama.cpp", "BF16", [1, 2, 3]), r("transformers", "bfloat16", [1, 2, 3])])]
    assert reference_of(bf16) == ("transformers", "bfloat16")
    assert agreement_texts(bf16)["llama.cpp BF16"] == "3/3"
