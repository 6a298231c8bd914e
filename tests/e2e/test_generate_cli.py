"""`keyserve generate` as a user runs it answers what the Python API answers for the same
settings: the flags (sampling from SamplingParams, engine from EngineConfig) reach the engine."""

from __future__ import annotations

import json

from keyserve import cli
from keyserve.core.sampling_params import SamplingParams
from keyserve.llm import LLM

PROMPTS = ["Once upon a time", "The little dog"]


def test_generate_flags_answer_what_the_python_api_answers(stories_path: str, tmp_path, capsys) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    argv = ["generate", "--model", stories_path, "--prompts-file", str(prompts), "--json",
            "--num-blocks", "64", "--block-size", "8", "--no-prefix-caching",
            "--kv-policy", "keyformer", "--kv-budget", "0.5", "--top-k", "5", "--temperature", "0.8",
            "--seed", "3", "--max-tokens", "12", "--n", "2", "--stop-token-ids", "0"]
    assert cli.main(argv) == 0
    got = [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    llm = LLM(stories_path, num_blocks=64, block_size=8, enable_prefix_caching=False)
    params = SamplingParams(kv_policy="keyformer", kv_budget=0.5, top_k=5, temperature=0.8, seed=3,
                            max_tokens=12, n=2, stop_token_ids=[0])
    want = llm.generate(PROMPTS, params)
    assert [[o["token_ids"] for o in g["outputs"]] for g in got] == \
        [[o.token_ids for o in w.outputs] for w in want]
    assert all(g["stats"]["kv_tokens_evicted"] > 0 for g in got)  # the budget was applied


def test_generate_defaults_are_greedy_and_64_tokens(stories_path: str, capsys) -> None:
    assert cli.main(["generate", "--model", stories_path, "--prompt", PROMPTS[0], "--json",
                     "--num-blocks", "64"]) == 0
    (got,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    (want,) = LLM(stories_path, num_blocks=64).generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=64))
    assert got["token_ids"] == want.token_ids
