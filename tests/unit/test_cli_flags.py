"""One config surface: `keyserve generate`, `serve` and `batch` take their flags from the
pydantic models, so each EngineConfig field has exactly one flag in each command, the flags
build the config the Python API builds, and help shows each field's one description.

The reachability test does not trust the code's own field tables: it gives every flag of a
command a few values, builds the command's EngineConfig and looks at which of EngineConfig's
leaves moved away from their defaults."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from keyserve import cli
from keyserve.cluster import batch_job, serve_cli
from keyserve.cluster.cli_args import flag_errors
from keyserve.cluster.serve_app import ServeArgs, build_app, deployment_options
from keyserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    PrefixStoreConfig,
    SchedulerSettings,
    ServeConfig,
    SpeculativeConfig,
)
from keyserve.core.sampling_params import SamplingParams
from keyserve.types import KVPolicyName

Path_ = tuple[str, ...]


def leaves(model: BaseModel, prefix: Path_ = ()) -> dict[Path_, Any]:
    """Every scalar setting of a (nested) config, by its path."""
    out: dict[Path_, Any] = {}
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            out |= leaves(value, prefix + (name,))
        else:
            out[prefix + (name,)] = value
    return out


def leaf_definitions(cls: type[BaseModel] = EngineConfig, prefix: Path_ = ()) -> dict[Path_, Any]:
    """Every leaf field's FieldInfo, walking the classes (not an instance)."""
    out: dict[Path_, Any] = {}
    for name, info in cls.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out |= leaf_definitions(ann, prefix + (name,))
        else:
            out[prefix + (name,)] = info
    return out


DEFAULT_LEAVES = leaves(EngineConfig())
assert set(DEFAULT_LEAVES) == set(leaf_definitions())


@dataclass(frozen=True)
class Command:
    name: str
    parser: Callable[[], argparse.ArgumentParser]
    base: list[str]  # argv every parse starts with
    engine: Callable[[argparse.Namespace], EngineConfig]
    no_flag: dict[Path_, str]  # EngineConfig leaves deliberately without a flag -> the reason
    # the command's own defaults where they differ from EngineConfig's (batch: multi-step rounds)
    defaults: tuple[tuple[Path_, Any], ...] = ()

    def default_config(self, config: EngineConfig | None = None) -> EngineConfig:
        """``config`` (default: EngineConfig()) with the command's own defaults."""
        config = (config or EngineConfig()).model_copy(deep=True)
        for (section, name), value in self.defaults:
            setattr(getattr(config, section), name, value)
        return config


def _generate_parser() -> argparse.ArgumentParser:
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    return sub.choices["generate"]


COMMANDS = [
    Command("generate", _generate_parser, ["--prompt", "p"], cli.engine_config, {}),
    Command("serve", serve_cli.build_parser, [], lambda ns: serve_cli.serve_args(ns).engine_config(),
            {("parallel", "address"): serve_cli.NO_FLAG["address"]}),
    Command("batch", batch_job.build_parser, ["--input", "in.jsonl", "--output", "out.jsonl"],
            lambda ns: batch_job.serve_config(ns).engine_config(), {},
            ((("scheduler", "num_scheduler_steps"), batch_job.BATCH_SCHEDULER_STEPS),)),
]


@pytest.fixture(autouse=True)
def _no_api_key_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KEYSERVE_API_KEY", raising=False)


def candidate_argvs(action: argparse.Action) -> list[list[str]]:
    """A few command lines that set ``action``: each switch form, each choice, a few numbers."""
    if action.nargs == 0:
        return [[opt] for opt in action.option_strings]
    flag = action.option_strings[0]
    if action.choices is not None:
        values = [str(c) for c in action.choices]
    elif action.type is int:
        values = ["3", "5", "17"]
    elif action.type is float:
        values = ["0.5", "0.75", "3"]
    elif action.type in (None, str):
        values = ["x", "2"]  # "2": a string field with a grammar (speculative_tree's shapes)
    else:  # a JSON object (Ray resources)
        values = ['{"r": 1}']
    return [[flag, v] for v in values]


def moved_leaves(command: Command, action: argparse.Action, capsys: pytest.CaptureFixture) -> set[Path_]:
    """The EngineConfig leaves some value of ``action`` changes (its parses that validate)."""
    moved: set[Path_] = set()
    parser = command.parser()
    for argv in candidate_argvs(action):
        try:
            ns = parser.parse_args(command.base + argv)
            config = command.engine(ns)
        except SystemExit:  # e.g. --prompts-file beside --prompt
            capsys.readouterr()
            continue
        except ValueError:  # a value the field's range refuses; another candidate fits
            continue
        got, defaults = leaves(config), leaves(command.default_config())
        moved |= {path for path, value in got.items() if value != defaults[path]}
    return moved


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.name)
def test_every_engine_field_has_exactly_one_flag(command: Command, capsys) -> None:
    reached: dict[Path_, list[str]] = {path: [] for path in DEFAULT_LEAVES}
    for action in command.parser()._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        moved = moved_leaves(command, action, capsys)
        assert len(moved) <= 1, f"{command.name} {action.option_strings[0]} sets several fields: {moved}"
        for path in moved:
            reached[path].append(action.option_strings[0])
    for path, flags in reached.items():
        if path in command.no_flag:
            assert flags == [] and command.no_flag[path].strip(), (path, flags)
        else:
            assert len(flags) == 1, f"{command.name}: EngineConfig.{'.'.join(path)} is set by {flags or 'no flag'}"


# --------------------------------------------------------------------------- same config
ENGINE_ARGV = [
    "--model", "/models/m", "--dtype", "bfloat16", "--max-num-seqs", "32", "--default-kv-policy", "h2o",
    "--default-kv-budget", "0.5", "--no-prefix-caching", "--block-size", "8", "--draft", "/models/d",
    "--num-speculative-tokens", "3", "--adaptive-k", "--draft-kv-policy", "keyformer", "--tp", "2",
    "--placement-strategy", "SPREAD", "--worker-resources", '{"accel": 0.5}', "--prefix-store-eviction",
    "lru", "--prefix-store-host-tokens", "64",
]
FLAT = dict(  # the same, as LLM(...) / EngineConfig.from_flat / a Serve config's args take them
    model="/models/m", dtype="bfloat16", max_num_seqs=32, default_kv_policy="h2o", default_kv_budget=0.5,
    enable_prefix_caching=False, block_size=8, draft="/models/d", num_speculative_tokens=3, adaptive_k=True,
    draft_kv_policy="keyformer", placement_strategy="SPREAD", worker_resources={"accel": 0.5},
    prefix_store_eviction="lru", prefix_store_host_tokens=64,
)
EXPECTED = EngineConfig(  # the same, nested, as the Python API builds it
    model=ModelConfig(model="/models/m", dtype="bfloat16"),
    cache=CacheConfig(block_size=8, enable_prefix_caching=False, default_kv_policy="h2o", default_kv_budget=0.5),
    scheduler=SchedulerSettings(max_num_seqs=32),
    spec=SpeculativeConfig(draft="/models/d", num_speculative_tokens=3, adaptive_k=True, draft_kv_policy="keyformer"),
    parallel=ParallelConfig(tensor_parallel_size=2, placement_strategy="SPREAD", worker_resources={"accel": 0.5}),
    prefix_store=PrefixStoreConfig(eviction="lru", host_tokens=64),
    seed=5,
)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.name)
def test_flags_build_the_config_the_python_api_builds(command: Command) -> None:
    seed = ["--engine-seed", "5"] if command.name == "generate" else ["--seed", "5"]
    ns = command.parser().parse_args(command.base + ENGINE_ARGV + seed)
    assert command.engine(ns) == command.default_config(EXPECTED)
    assert command.engine(command.parser().parse_args(command.base)) == command.default_config()


def test_python_api_and_serve_args_build_the_same_config() -> None:
    assert EngineConfig.from_flat(**FLAT, tensor_parallel_size=2, seed=5) == EXPECTED
    assert EngineConfig.from_flat(**FLAT, tp=2, seed=5) == EXPECTED
    args = ServeArgs.model_validate({**FLAT, "tp": 2, "seed": 5, "max_queued_requests": 10})
    assert args.engine_config() == EXPECTED and args.serve_config().engine_config() == EXPECTED
    assert ServeConfig().engine_config() == EngineConfig()
    # None for an engine option keeps its default (LLM(model=None), `max_num_seqs: null` in args).
    assert ServeConfig(model=None, max_num_seqs=None, tp=None).engine_config() == EngineConfig()
    assert ServeConfig(request_timeout_s=None).request_timeout_s is None  # a server field's None stays
    # Both names of one option: refused as such, not as an "extra input".
    with pytest.raises(ValueError, match="tp and tensor_parallel_size name the same option"):
        EngineConfig.from_flat(tp=2, tensor_parallel_size=2)
    assert EngineConfig.from_flat(tp=2, tensor_parallel_size=None).parallel.tensor_parallel_size == 2


def test_generate_sampling_flags_build_sampling_params() -> None:
    parser = cli.build_parser()
    ns = parser.parse_args(["generate", "--prompt", "p", "--kv-policy", "keyformer", "--kv-budget", "0.5",
                            "--top-k", "40", "--top-p", "0.9", "--stop", "a", "--stop", "b", "--seed", "7",
                            "--no-speculative", "--stop-token-ids", "3", "--stop-token-ids", "4", "--logprobs",
                            "--n", "2", "--recent-ratio", "0.5", "--tau-end", "3", "--temperature", "0.7"])
    assert cli.sampling_params(ns) == SamplingParams(
        kv_policy="keyformer", kv_budget=0.5, top_k=40, top_p=0.9, stop=["a", "b"], seed=7, speculative=False,
        stop_token_ids=[3, 4], logprobs=True, n=2, recent_ratio=0.5, tau_end=3.0, temperature=0.7, max_tokens=64)
    assert cli.engine_config(ns) == EngineConfig()  # the request's seed is not the engine's
    plain = parser.parse_args(["generate", "--prompt", "p"])
    # generate's documented defaults: greedy, 64 tokens; everything else is SamplingParams' own.
    assert cli.sampling_params(plain) == SamplingParams(temperature=0.0, max_tokens=64)
    excluded = set(SamplingParams.model_fields) - set(cli.sampling_params(ns).model_fields_set)
    assert "num_speculative_tokens" in excluded and cli.SAMPLING_NO_FLAG["num_speculative_tokens"].strip()
    assert "--num-speculative-tokens" in _generate_parser().format_help()  # the engine's K


def test_users_existing_flags_keep_working() -> None:
    ns = serve_cli.build_parser().parse_args(["--max-num-seqs", "32", "--default-kv-policy", "h2o",
                                              "--enable-prefix-caching", "--prefix-store", "--num-cpus", "2"])
    args = serve_cli.serve_args(ns)
    assert (args.max_num_seqs, args.default_kv_policy, args.prefix_store, args.num_cpus) == (32, "h2o", True, 2.0)
    assert deployment_options(args)["max_ongoing_requests"] == 32 + args.max_queued_requests + 16
    ns = cli.build_parser().parse_args(["generate", "--prompt", "p", "--kv-policy", "keyformer", "--kv-budget",
                                        "0.5", "--top-k", "5", "--tp", "2", "--address", "auto",
                                        "--placement-strategy", "PACK", "--no-prefix-caching", "--seed", "1"])
    config = cli.engine_config(ns)
    assert (config.parallel.tensor_parallel_size, config.parallel.address) == (2, "auto")
    assert config.parallel.placement_strategy == "PACK" and not config.cache.enable_prefix_caching
    assert cli.sampling_params(ns).seed == 1 and config.seed == 0


# --------------------------------------------------------------------------- help and errors
def _normalised(text: str) -> str:
    return re.sub(r"\s+", "", text)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.name)
def test_help_shows_each_engine_field_once_with_its_own_description(command: Command) -> None:
    text = _normalised(command.parser().format_help())
    for path, info in leaf_definitions().items():
        if path in command.no_flag:
            continue
        description = _normalised(info.description)
        assert text.count(description) == 1, f"{command.name}: {path} {info.description!r}"


def test_generate_help_lists_the_kv_policies_of_the_one_enum() -> None:
    choices = "{" + ",".join(typing.get_args(KVPolicyName)) + "}"
    text = _generate_parser().format_help()
    for flag in ("--kv-policy", "--default-kv-policy", "--draft-kv-policy"):
        assert f"{flag} {choices}" in text, flag


def test_a_new_kv_policy_reaches_every_policy_flag() -> None:
    """Add a policy to keyserve.types.KVPolicyName before anything imports it: every command's
    policy flags offer it (nothing keeps a copy of the list)."""
    code = (
        "import typing, keyserve.types as t\n"
        "t.KVPolicyName = typing.Literal[(*typing.get_args(t.KVPolicyName), 'new_policy')]\n"
        "from keyserve.cli import build_parser\n"
        "from keyserve.cluster.serve_cli import build_parser as serve\n"
        "sub = next(a for a in build_parser()._actions if a.dest == 'command')\n"
        "print(sub.choices['generate'].format_help()); print(serve().format_help())\n"
    )
    env = {**os.environ, "COLUMNS": "400"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    choices = "{" + ",".join((*typing.get_args(KVPolicyName), "new_policy")) + "}"
    for flag in ("--kv-policy", "--default-kv-policy", "--draft-kv-policy"):
        assert f"{flag} {choices}" in out.stdout, flag
    assert out.stdout.count(f"--default-kv-policy {choices}") == 2  # generate and serve


def test_bad_values_exit_2_naming_the_flag(capsys, tmp_path) -> None:
    assert cli.main(["generate", "--prompt", "p", "--engine-seed", "-1"]) == 2
    assert "--engine-seed: Input should be greater than or equal to 0" in capsys.readouterr().err
    assert cli.main(["generate", "--prompt", "p", "--top-p", "0", "--max-num-seqs", "0"]) == 2
    err = capsys.readouterr().err
    assert "--top-p: Input should be greater than 0" in err
    assert cli.main(["generate", "--prompt", "p", "--max-num-seqs", "0"]) == 2
    assert "--max-num-seqs: Input should be greater than or equal to 1" in capsys.readouterr().err
    ns = serve_cli.build_parser().parse_args(["--prefix-store", "--tp", "2"])
    with pytest.raises(ValidationError) as refused:  # EngineConfig's own cross-field check
        serve_cli.serve_args(ns)
    assert flag_errors(refused.value, ns.serve_flags) == (
        "the prefix store runs with the in-process engine only (no Ray / TP)")
    (tmp_path / "in.jsonl").write_text("")
    argv = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]
    assert batch_job.main([*argv, "--block-size", "0"]) == 2
    assert "--block-size: Input should be greater than or equal to 1" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()  # refused before the output is opened
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "--prompt", "p", "--worker-resources", "[1]"])
    assert "expected a JSON object" in capsys.readouterr().err


def test_serve_args_schema_is_flat_and_builds() -> None:
    """A Serve config's args (examples/serve_config.yaml) still validate, flat, and build_app
    binds them (the chart's own args are checked in tests/deploy/test_serve_contract.py)."""
    import yaml

    pytest.importorskip("ray.serve")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "examples", "serve_config.yaml")) as f:
        (app,) = yaml.safe_load(f)["applications"]
    args = ServeArgs.model_validate(app["args"])
    for key, value in app["args"].items():
        assert getattr(args, key) == value
    assert args.engine_config().scheduler.max_num_seqs == app["args"]["max_num_seqs"]
    assert build_app(app["args"]) is not None
