"""Ray Serve wiring: ``build_app(args)`` is the ``import_path`` of a Serve / KubeRay app.

    # serve run examples/serve_config.yaml     (or serveConfigV2 in a RayService)
    applications:
      - name: keyserve
        route_prefix: /
        import_path: keyserve.cluster.serve_app:build_app
        args: {model: SmolLM2-135M-Instruct, max_num_seqs: 32}

As in Ray Serve LLM, the deployment class is plain Python; ``build_app`` validates ``args``
with ``ServeArgs`` (so a bad value fails at ``serve run``, naming the field), wraps the class
with ``serve.ingress`` (the FastAPI app is built on the replica, after the engine) and binds it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from pydantic import Field

from keyserve.cluster.http_app import create_app
from keyserve.cluster.openai_serving import OpenAIServing
from keyserve.config import ServeConfig

log = logging.getLogger(__name__)
API_KEY_ENV = "KEYSERVE_API_KEY"  # the replica's API key when args give none


class ServeArgs(ServeConfig):
    """``ServeConfig`` plus how Ray Serve places the server (the ``args`` of ``build_app``).

    Flat, as a Serve config's ``args`` are written: the engine's fields under their flat names
    (``model``, ``tp``, ``max_num_seqs``, ``default_kv_policy``, ...; see ``FlatEngineConfig``),
    the server's (``api_key``, ``max_queued_requests``, ...) and these."""

    num_replicas: int = Field(1, ge=1, description="Replicas, each with its own engine.")
    num_cpus: float = Field(1.0, gt=0.0, description="CPUs each replica reserves (and its torch threads).")
    num_gpus: float = Field(0.0, ge=0.0, description="GPUs each replica reserves.")
    max_ongoing_requests: int | None = Field(
        None, ge=1,
        description="Requests Serve routes to one replica at once; default: enough that the "
        "engine's own queue (503 + Retry-After) is the limit clients meet.",
    )
    deployment_name: str = Field("KeyserveDeployment", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                                 description="Serve deployment name (letters, digits, '_', '.', '-').")

    def serve_config(self) -> ServeConfig:
        return ServeConfig.model_validate(self.model_dump(include=set(ServeConfig.model_fields)))


class KeyserveDeployment:
    """One replica: an AsyncLLMEngine and the OpenAI FastAPI app over it. Undecorated:
    ``build_app`` makes it a deployment. Without ``api_key`` in its args it takes the key
    from ``$KEYSERVE_API_KEY``, if set.

    The replica is up as soon as the engine thread starts loading the model: meanwhile
    ``/health`` answers 503 ``{"status": "loading"}`` and requests 503 with Retry-After
    (instead of connection refused, then the proxy's 404); a model that fails to load makes
    ``check_health`` fail, and Serve replaces the replica."""

    def __init__(self, args: dict[str, Any]) -> None:
        config = ServeArgs.model_validate(args).serve_config()
        if config.api_key is None and os.environ.get(API_KEY_ENV):  # e.g. from a k8s Secret
            config = ServeConfig.model_validate({**config.model_dump(), "api_key": os.environ[API_KEY_ENV]})
        self.serving = OpenAIServing.from_config(config)
        log.info("keyserve replica up, loading %s", self.serving.model_name)

    def __serve_build_asgi_app__(self):
        return create_app(self.serving)

    async def check_health(self) -> None:
        """Serve restarts a replica whose engine thread died."""
        engine = self.serving.engine
        if not engine.is_alive:
            raise RuntimeError(f"keyserve engine is dead: {engine.dead_reason}")

    def __del__(self) -> None:
        serving = getattr(self, "serving", None)
        if serving is not None:
            serving.engine.shutdown(timeout=5.0)


def deployment_options(args: ServeArgs) -> dict[str, Any]:
    ongoing = args.max_ongoing_requests
    if ongoing is None:
        ongoing = args.max_num_seqs + args.max_queued_requests + 16  # headroom for /health, /metrics
    actor: dict[str, Any] = {"num_cpus": args.num_cpus}
    if args.num_gpus:
        actor["num_gpus"] = args.num_gpus
    return {
        "name": args.deployment_name,
        "num_replicas": args.num_replicas,
        "ray_actor_options": actor,
        "max_ongoing_requests": ongoing,
        "health_check_period_s": 10,
        "health_check_timeout_s": 60,
        "graceful_shutdown_timeout_s": 30,
    }


def build_app(args: dict[str, Any] | None = None):
    """The Serve application for ``args`` (validated by ``ServeArgs``; raises on bad values)."""
    from ray import serve

    parsed = ServeArgs.model_validate(args or {})
    cls = serve.ingress()(KeyserveDeployment)
    deployment = serve.deployment(cls, **deployment_options(parsed))
    return deployment.bind(parsed.model_dump(exclude_defaults=True))
