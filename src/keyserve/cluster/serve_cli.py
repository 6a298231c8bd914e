"""``keyserve serve``: the OpenAI-compatible server on Ray Serve (or ``--no-ray``: uvicorn).

    keyserve serve                                   # default model on http://127.0.0.1:8000/v1
    keyserve serve --model /path/to/hf --port 8080 --api-key sk-... --max-num-seqs 32
    keyserve serve --address auto                    # deploy onto a running Ray cluster

Every ``ServeArgs`` field is a flag (``--max-queued-requests``, ``--default-kv-policy``, ...).
"""

from __future__ import annotations

import argparse
import os
import sys

from pydantic import ValidationError

from keyserve.cluster.cli_args import add_model_fields, model_kwargs
from keyserve.cluster.help_format import PlainHelpFormatter
from keyserve.cluster.launcher import RayOptions, run_serve, run_uvicorn
from keyserve.cluster.serve_app import ServeArgs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="keyserve serve", description=__doc__,
                                formatter_class=PlainHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="HTTP host (0.0.0.0 to listen on all interfaces)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--address", default=None,
                   help="Ray cluster to deploy onto ('auto': the running one); default: $RAY_ADDRESS, "
                   "else start a local Ray")
    p.add_argument("--ray-num-cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
    p.add_argument("--object-store-memory-mb", type=int, default=256, help="object store of the local Ray")
    p.add_argument("--no-ray", action="store_true", help="serve with uvicorn in this process, without Ray")
    add_model_fields(p, ServeArgs, exclude={"deployment_name"})
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    kwargs = model_kwargs(args, ServeArgs)
    kwargs.setdefault("api_key", os.environ.get("KEYSERVE_API_KEY") or None)
    try:
        serve_args = ServeArgs(**kwargs)
    except ValidationError as e:
        errs = "; ".join(f"--{'.'.join(map(str, err['loc'])).replace('_', '-')}: {err['msg']}"
                         for err in e.errors())
        print(f"keyserve serve: invalid value: {errs}", file=sys.stderr)
        return 2
    if args.no_ray:
        run_uvicorn(serve_args, args.host, args.port)
    else:
        run_serve(serve_args, args.host, args.port,
                  RayOptions(args.address, args.ray_num_cpus, args.object_store_memory_mb))
    return 0


if __name__ == "__main__":
    sys.exit(main())
