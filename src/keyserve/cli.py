"""The ``keyserve`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from keyserve.cluster.cli_args import FieldFlags, add_model_fields, flag_errors
from keyserve.cluster.help_format import PlainHelpFormatter
from keyserve.config import EngineConfig, FlatEngineConfig
from keyserve.core.sampling_params import SamplingParams


# SamplingParams fields without a `generate` flag, and why.
SAMPLING_NO_FLAG = {
    "num_speculative_tokens": "one run, one engine: the engine's --num-speculative-tokens (K) "
    "applies to every prompt",
}
# Engine fields whose `generate` flag has another name: --seed is the requests' own seed
# (SamplingParams.seed), so the engine's global RNG seed is --engine-seed.
ENGINE_RENAME = {"seed": "engine_seed"}
# `generate` prints text for a person to read: greedy and 64 tokens unless asked otherwise
# (SamplingParams' own defaults, the API's, are temperature 1 and 16 tokens).
SAMPLING_DEFAULTS = {"temperature": 0.0, "max_tokens": 64}


@dataclass(frozen=True)
class GenerateFlags:
    """Which argparse dests of `generate` hold which SamplingParams / engine field."""

    sampling: FieldFlags
    engine: FieldFlags


def add_generate_flags(p: argparse.ArgumentParser) -> GenerateFlags:
    """Sampling flags from SamplingParams' fields, engine flags from EngineConfig's (flat)."""
    sampling = add_model_fields(p, SamplingParams, exclude=SAMPLING_NO_FLAG, title="sampling",
                                defaults=SAMPLING_DEFAULTS)
    engine = add_model_fields(p, FlatEngineConfig, rename=ENGINE_RENAME)
    flags = GenerateFlags(sampling, engine)
    p.set_defaults(generate_flags=flags)
    return flags


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of `generate`'s engine flags (unset ones keep EngineConfig's defaults)."""
    return args.generate_flags.engine.build(args).engine_config()


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The SamplingParams of `generate`'s sampling flags, for every prompt."""
    return args.generate_flags.sampling.build(args)


GENERATE_DESCRIPTION = """Generate text from prompts, without a server.

    keyserve generate --prompt "Once upon a time"                      # default model, greedy
    keyserve generate --prompts-file p.txt --kv-policy keyformer --kv-budget 0.5 --top-k 40 --json
    keyserve generate --tp 2 --draft /path/to/draft --prompt "Hi"      # on a Ray cluster

Sampling flags are the fields of SamplingParams (per request, as in LLM.generate), engine flags
the fields of EngineConfig (as LLM(...) takes them; keyserve serve has the same ones).
"""


def _read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts, each checked: a ValueError naming the file and line (or the flag) for
    anything that is not a prompt."""
    if args.prompt is not None:
        return [_text(args.prompt, "--prompt")]
    path = Path(args.prompts_file)
    if path.is_dir():
        raise ValueError(f"--prompts-file {path} is a directory, not a file")
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f]
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompts-file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        if line.lstrip().startswith("{"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON: {e.msg} (column {e.colno})") from None
            prompt = record.get("prompt") if isinstance(record, dict) else None
            if not isinstance(prompt, str):
                raise ValueError(f"{where}: a JSON line needs a \"prompt\" string")
            prompts.append(prompt)
        else:
            prompts.append(line)
    if not prompts:
        raise ValueError(f"--prompts-file {path} holds no prompt")
    return prompts


def _text(value: str, flag: str) -> str:
    """Command-line text that is valid Unicode (argv bytes that are not UTF-8 arrive as lone
    surrogates, which the tokenizer refuses with a TypeError)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{flag} is not valid UTF-8 text") from None
    return value


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)  # bad flags fail before torch and the model load
    config = engine_config(args)
    prompts = _read_prompts(args)
    from keyserve.llm import LLM, RayLLM  # torch only once a command needs the engine

    if config.parallel.uses_ray:  # the Ray cluster: shards, draft, KV manager
        import ray

        started = not ray.is_initialized()
        try:
            llm = RayLLM(config=config)
            try:
                outputs = llm.generate(prompts, params, chat=args.chat, use_tqdm=len(prompts) > 1)
            finally:
                llm.shutdown()
        finally:
            if started and ray.is_initialized():
                ray.shutdown()
    else:
        llm = LLM(config=config)
        outputs = llm.generate(prompts, params, chat=args.chat, use_tqdm=len(prompts) > 1)
    for out in outputs:
        if args.json:
            print(json.dumps(out.to_dict(), ensure_ascii=False))
        else:
            for o in out.outputs:
                print(o.text)
            if out.error is not None:
                print(f"keyserve: {out.request_id} failed: {out.error}", file=sys.stderr)
            st = out.stats
            rate = f"{st.tokens_per_s:.1f} tok/s" if st.tokens_per_s else "n/a"
            ttft = f"{st.time_to_first_token_s:.3f}s" if st.time_to_first_token_s is not None else "n/a"
            print(
                f"[{st.prompt_tokens} prompt + {st.generated_tokens} generated tokens, "
                f"TTFT {ttft}, {rate}, KV blocks {st.kv_blocks_used}, "
                f"evicted {st.kv_tokens_evicted}, finish={out.finish_reason}"
                + (f", speculative acceptance {st.spec_acceptance_rate:.0%}, "
                   f"{st.spec_tokens_per_forward:.2f} tokens/forward" if st.spec_draft_tokens else "")
                + "]",
                file=sys.stderr,
            )
    return 1 if any(out.error is not None for out in outputs) else 0


def cmd_distill_draft(args: argparse.Namespace) -> int:
    from keyserve.training.distill import DistillOptions, distill_draft

    options = DistillOptions.from_namespace(args)  # checks every flag before anything is written
    distill_draft(options)
    return 0


def _add_distill_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="target model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="output draft directory (work files kept under it)")
    p.add_argument("--layers", type=int, default=2, help="draft decoder layers")
    p.add_argument("--init-layers", default=None,
                   help="comma-separated target layers to initialise from (default: first and last)")
    p.add_argument("--vocab", type=int, default=8192, help="draft LM-head vocabulary size")
    p.add_argument("--num-prompts", type=int, default=768)
    p.add_argument("--gen-tokens", type=int, default=192, help="max tokens the target generates per prompt")
    p.add_argument("--temperature", type=float, default=0.8, help="target sampling temperature")
    p.add_argument("--greedy-fraction", type=float, default=0.25, help="share of prompts answered greedily")
    p.add_argument("--prompt-set", choices=["base", "wide"], default="wide",
                   help="the chat prompts the target answers: wide (~20,000 distinct; keeps the speculative "
                        "bench's prompts out) or base (~3,540: what draft runs 1-7 drew from)")
    p.add_argument("--teacher-top-k", type=int, default=32, help="target logits kept per position")
    p.add_argument("--gen-slots", type=int, default=48, help="answers generated at once")
    p.add_argument("--gen-share", type=float, default=0.45, help="share of the time budget for generation")
    p.add_argument("--dropout", type=float, default=0.1, help="residual dropout while training")
    p.add_argument("--corpus-tokens", type=int, default=0,
                   help="also record the target's distributions along this many tokens of offline text "
                        "(teacher-forced: Python docs and sources, package licences and descriptions)")
    p.add_argument("--corpus-share", type=float, default=0.2,
                   help="share of the time budget for the teacher-forced text (after the answers)")
    p.add_argument("--answer-rounds", type=int, default=1,
                   help="answers per prompt: rounds after the first all sample at --temperature")
    p.add_argument("--init-from", default=None,
                   help="another run's checkpoint.pt, or an exported draft directory: train from its (best) "
                        "weights (same layers and vocabulary)")
    p.add_argument("--with-data", default=None,
                   help="comma-separated earlier run directories whose recorded data (DIR/data/) this run "
                        "also trains on, never held out (their data is not recorded again)")
    p.add_argument("--generator", choices=["dense", "engine"], default="dense",
                   help="who answers the prompts: the float32 dense loop (top-k up to any size) or keyserve's "
                        "engine (~4-6x faster on a CPU; at most 20 alternatives per token: --teacher-top-k 20)")
    p.add_argument("--gen-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="the engine's dtype with --generator engine")
    p.add_argument("--keep", choices=["best", "last"], default="best",
                   help="export the best held-out evaluation's weights or the last step's (after --init-from "
                        "the held-out answers may hold ones the other run trained on, which favours early steps)")
    p.add_argument("--train-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the training matmuls' dtype: bfloat16 autocasts them (weights, optimiser and loss "
                        "stay float32); 2.3x faster steps on the AVX512-BF16 Zen 5, the same held-out quality")
    p.add_argument("--argmax-weight", type=float, default=0.0,
                   help="add this x the cross-entropy at the target's argmax to the KL (greedy acceptance "
                        "asks only for the argmax); 0: the KL alone")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch-tokens", type=int, default=2048, help="training tokens per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--resume", action="store_true", help="continue from DIR's cached data and checkpoint")
    p.add_argument("--time-budget-min", type=float, default=50.0,
                   help="stop training early so the whole run ends within this many minutes")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keyserve", description=__doc__,
                                     formatter_class=PlainHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from prompts (in-process engine, or "
                         "--tp / --address: on a Ray cluster)", description=GENERATE_DESCRIPTION,
                         usage="%(prog)s [-h] (--prompt PROMPT | --prompts-file FILE) [flags below]",
                         formatter_class=PlainHelpFormatter)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompts-file", help="a file: one prompt per line, or JSONL with 'prompt'")
    gen.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    add_generate_flags(gen)
    gen.set_defaults(func=cmd_generate)
    distill = sub.add_parser("distill-draft", help="distil a small draft model for speculative decoding",
                             formatter_class=PlainHelpFormatter)
    _add_distill_args(distill)
    distill.set_defaults(func=cmd_distill_draft)
    # serve / batch own their flags (generated from ServeArgs): main() hands them the rest.
    sub.add_parser("serve", add_help=False, help="OpenAI-compatible server on Ray Serve (--help for flags)")
    sub.add_parser("batch", add_help=False, help="OpenAI batch-format JSONL through the engine (--help)")
    return parser


_DELEGATED = {"serve": "keyserve.cluster.serve_cli", "batch": "keyserve.cluster.batch_job"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in _DELEGATED:
        import importlib

        return importlib.import_module(_DELEGATED[argv[0]]).main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValidationError as e:
        flags = getattr(args, "generate_flags", None)
        errs = flag_errors(e, *((flags.sampling, flags.engine) if flags else ()))
        print(f"keyserve: invalid value: {errs}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:  # an operator's input: a bad value, a wrong path
        print(f"keyserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
