"""``keyserve serve``: the OpenAI-compatible server on Ray Serve (or ``--no-ray``: uvicorn).

    keyserve serve                                   # default model on http://127.0.0.1:8000/v1
    keyserve serve --model /path/to/hf --port 8080 --api-key sk-... --max-num-seqs 32
    keyserve serve --address auto                    # deploy onto a running Ray cluster

Every ``ServeArgs`` field is a flag (``--max-queued-requests``, ``--default-kv-policy``, ...):
the engine's options (those of ``keyserve generate`` and ``LLM(...)``), the server's limits and
the Serve deployment's placement, each with its own description, default and range.
"""

from __future__ import annotations

import argparse
import os
import sys

from pydantic import ValidationError

from keyserve.cluster.cli_args import add_model_fields, flag_errors
from keyserve.cluster.help_format import PlainHelpFormatter
from keyserve.cluster.launcher import RayOptions, run_serve, run_uvicorn
from keyserve.cluster.serve_app import ServeArgs


# ServeArgs fields without a flag here, and why.
NO_FLAG = {
    "address": "--address (above) names the Ray cluster the server deploys onto; its engine "
    "runs there (a Serve config's args may still set it)",
    "deployment_name": "one deployment per `keyserve serve`; the name matters to serveConfigV2 "
    "overrides (Serve YAML, the Helm chart), which set it in args",
}


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= port <= 65535:  # 0 would listen on a random port; above 65535 wraps around
        raise argparse.ArgumentTypeError(f"a port lies in 1-65535, not {port}")
    return port


def _cannot_listen(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on (in use, an unknown host), checked before the
    model loads; None if it can."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        return f"--host {host!r}: {e}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            return f"cannot listen on {host}:{port}: {e.strerror or e}"
    return None


def _ray_only(args: argparse.Namespace, parsed: ServeArgs) -> str | None:
    """A Ray-only flag given with --no-ray (it would be ignored silently)."""
    defaults = ServeArgs()
    if parsed.engine_config().parallel.uses_ray:
        return "--tp > 1 and --address run on Ray"
    for flag in ("num_replicas", "num_cpus", "num_gpus", "max_ongoing_requests"):
        if getattr(parsed, flag) != getattr(defaults, flag):
            return f"--{flag.replace('_', '-')} places Ray Serve replicas"
    if args.ray_address is not None or args.ray_num_cpus is not None:
        return "--address and --ray-num-cpus are for Ray"
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="keyserve serve", description=__doc__, formatter_class=PlainHelpFormatter,
                                usage="%(prog)s [-h] [--host HOST] [--port PORT] [--address ADDRESS] "
                                "[--no-ray] [flags below]")
    p.add_argument("--host", default="127.0.0.1", help="HTTP host (0.0.0.0 to listen on all interfaces)")
    p.add_argument("--port", type=_port, default=8000, help="HTTP port (1-65535)")
    p.add_argument("--address", dest="ray_address", default=None,
                   help="Ray cluster to deploy onto ('auto': the running one); default: $RAY_ADDRESS, "
                   "else start a local Ray")
    p.add_argument("--ray-num-cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
    p.add_argument("--object-store-memory-mb", type=int, default=256, help="object store of the local Ray")
    p.add_argument("--no-ray", action="store_true", help="serve with uvicorn in this process, without Ray")
    p.set_defaults(serve_flags=add_model_fields(p, ServeArgs, exclude=NO_FLAG,
                                                title="server and Ray Serve deployment"))
    return p


def serve_args(ns: argparse.Namespace) -> ServeArgs:
    """The ServeArgs of parsed flags (the API key from $KEYSERVE_API_KEY unless --api-key)."""
    kwargs = ns.serve_flags.values(ns)
    env_key = os.environ.get("KEYSERVE_API_KEY")
    if "api_key" not in kwargs and env_key is not None:
        if not env_key.strip():  # set but blank: a Secret that came out empty, not "no auth"
            raise ValueError("$KEYSERVE_API_KEY is set but blank: unset it to serve without a key, or set the key")
        kwargs["api_key"] = env_key
    return ServeArgs(**kwargs)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        parsed = serve_args(args)
    except ValidationError as e:
        print(f"keyserve serve: invalid value: {flag_errors(e, args.serve_flags)}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"keyserve serve: {e}", file=sys.stderr)
        return 2
    conflict = _ray_only(args, parsed) if args.no_ray else None
    if conflict is not None:
        print(f"keyserve serve: --no-ray serves in this process, without Ray: {conflict}", file=sys.stderr)
        return 2
    problem = _cannot_listen(args.host, args.port)
    if problem is not None:  # before the model loads and anything says "serving"
        print(f"keyserve serve: {problem}", file=sys.stderr)
        return 2
    if args.no_ray:
        run_uvicorn(parsed, args.host, args.port)
        return 0
    try:
        run_serve(parsed, args.host, args.port,
                  RayOptions(args.ray_address, args.ray_num_cpus, args.object_store_memory_mb))
    except ConnectionError as e:  # an unreachable --address / $RAY_ADDRESS
        print(f"keyserve serve: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
