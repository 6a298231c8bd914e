"""The ``keyserve`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pydantic import ValidationError

from keyserve.cluster.help_format import PlainHelpFormatter
from keyserve.core.sampling_params import SamplingParams


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local HF directory, GGUF file, or default model name")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks in the pool")
    p.add_argument("--kv-cache-memory-gb", type=float, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--draft", default=None, help="draft model for speculative sampling")
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="draft tokens per step (K)")
    p.add_argument("--adaptive-k", action="store_true", help="pick K from the running acceptance rate")
    p.add_argument("--draft-kv-policy", default=None,
                   choices=["full", "window", "streaming_llm", "h2o", "keyformer"],
                   help="KV policy of the draft's own cache (output stays exact)")
    p.add_argument("--draft-kv-budget", type=float, default=None,
                   help="KV budget of the draft (fraction of prompt if <= 1, else tokens)")
    p.add_argument("--default-kv-policy", default=None,
                   choices=["full", "window", "streaming_llm", "h2o", "keyformer"],
                   help="KV policy for requests that name none")
    p.add_argument("--default-kv-budget", type=float, default=None,
                   help="KV budget for requests that give none (fraction of prompt or tokens)")


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False if args.no_prefix_caching else None,
        draft=args.draft,
        num_speculative_tokens=args.num_speculative_tokens,
        adaptive_k=True if args.adaptive_k else None,
        draft_kv_policy=args.draft_kv_policy,
        draft_kv_budget=args.draft_kv_budget,
        default_kv_policy=args.default_kv_policy,
        default_kv_budget=args.default_kv_budget,
    )


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--logprobs", action="store_true")
    p.add_argument("--kv-policy", default=None,
                   choices=["full", "window", "streaming_llm", "h2o", "keyformer"],
                   help="KV eviction policy")
    p.add_argument("--kv-budget", type=float, default=None,
                   help="KV tokens kept per (layer, head): fraction of the prompt if <= 1, else a count")
    p.add_argument("--recent-ratio", type=float, default=0.3, help="share of the budget kept recent")
    p.add_argument("--no-speculative", action="store_true", help="decode without the draft")


def _sampling_params(args: argparse.Namespace):
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        n=args.n,
        stop=args.stop,
        logprobs=args.logprobs,
        kv_policy=args.kv_policy,
        kv_budget=args.kv_budget,
        recent_ratio=args.recent_ratio,
        speculative=False if args.no_speculative else None,
    )


def _read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt is not None:
        return [args.prompt]
    with open(args.prompts_file) as f:
        lines = [line.rstrip("\n") for line in f]
    prompts = []
    for line in lines:
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            prompts.append(json.loads(line)["prompt"])
        else:
            prompts.append(line)
    return prompts


def cmd_generate(args: argparse.Namespace) -> int:
    from keyserve.llm import LLM, RayLLM  # torch only once a command needs the engine

    params = _sampling_params(args)
    prompts = _read_prompts(args)
    options = _engine_options(args)
    if args.tp > 1 or args.address is not None:  # the Ray cluster: shards, draft, KV manager
        import ray

        started = not ray.is_initialized()
        try:
            llm = RayLLM(**options, tensor_parallel_size=args.tp, address=args.address,
                         placement_strategy=args.placement_strategy)
            try:
                outputs = llm.generate(prompts, params, chat=args.chat, use_tqdm=len(prompts) > 1)
            finally:
                llm.shutdown()
        finally:
            if started and ray.is_initialized():
                ray.shutdown()
    else:
        llm = LLM(**options)
        outputs = llm.generate(prompts, params, chat=args.chat, use_tqdm=len(prompts) > 1)
    for out in outputs:
        if args.json:
            print(json.dumps(out.to_dict(), ensure_ascii=False))
        else:
            for o in out.outputs:
                print(o.text)
            st = out.stats
            rate = f"{st.tokens_per_s:.1f} tok/s" if st.tokens_per_s else "n/a"
            print(
                f"[{st.prompt_tokens} prompt + {st.generated_tokens} generated tokens, "
                f"TTFT {st.time_to_first_token_s:.3f}s, {rate}, KV blocks {st.kv_blocks_used}, "
                f"evicted {st.kv_tokens_evicted}, finish={out.finish_reason}"
                + (f", speculative acceptance {st.spec_acceptance_rate:.0%}, "
                   f"{st.spec_tokens_per_forward:.2f} tokens/forward" if st.spec_draft_tokens else "")
                + "]",
                file=sys.stderr,
            )
    return 0


def cmd_distill_draft(args: argparse.Namespace) -> int:
    from keyserve.training.distill import DistillOptions, distill_draft

    distill_draft(DistillOptions.from_namespace(args))
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
    p.add_argument("--teacher-top-k", type=int, default=32, help="target logits kept per position")
    p.add_argument("--gen-slots", type=int, default=48, help="answers generated at once")
    p.add_argument("--gen-share", type=float, default=0.45, help="share of the time budget for generation")
    p.add_argument("--dropout", type=float, default=0.1, help="residual dropout while training")
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
    gen = sub.add_parser("generate", help="generate text from prompts (in-process engine)",
                         formatter_class=PlainHelpFormatter)
    _add_engine_args(gen)
    _add_sampling_args(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompts-file", help="a file: one prompt per line, or JSONL with 'prompt'")
    gen.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    gen.add_argument("--tp", type=int, default=1,
                     help="tensor-parallel shards; > 1 (or --address) runs on a Ray cluster")
    gen.add_argument("--address", default=None,
                     help="Ray cluster to join ('auto', ray://host:10001); a local one is started if none runs")
    gen.add_argument("--placement-strategy", default="STRICT_PACK",
                     choices=["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"],
                     help="placement of the tensor-parallel shards")
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
        errs = "; ".join(
            f"{'.'.join(str(x) for x in err['loc']) or 'value'}: {err['msg']}" for err in e.errors()
        )
        print(f"keyserve: invalid value: {errs}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as e:
        print(f"keyserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
