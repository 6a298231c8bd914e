"""What every actor module shares: joining a cluster, the errors that trigger recovery."""

from __future__ import annotations

import os
import secrets
import uuid

import ray
from ray.exceptions import RayActorError, RayError

from keyserve.actors.step_channel import TOKEN_BYTES, ChannelClient
from keyserve.core.ray_address import check_reachable


class ShardLost(RuntimeError):
    """A target shard died (or a collective failed because one did): rebuild the group."""


class CoreLost(RuntimeError):
    """The KV-block manager actor died or restarted: give it the unfinished work again."""


class DraftLost(RuntimeError):
    """The draft actor died inside a compiled step: the step never ran; decode without it."""


ACTOR_LOST = (RayActorError,)  # ActorDiedError and ActorUnavailableError derive from it


def ensure_ray(address: str | None = None) -> None:
    """Join the cluster at ``address``, else a running local one, else start one."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    if address is not None:
        check_reachable(address)
        ray.init(address=address, ignore_reinit_error=True)
        return
    if os.environ.get("RAY_ADDRESS"):  # what "auto" joins first
        check_reachable(os.environ["RAY_ADDRESS"])
    try:
        ray.init(address="auto", ignore_reinit_error=True)
    except ConnectionError:
        ray.init(ignore_reinit_error=True)


def actor_runtime_env(niceness: int | None) -> dict | None:
    """The runtime_env that starts an engine actor's process at ``niceness``: Ray starts worker
    processes at 15 unless ``RAY_worker_niceness`` says otherwise (its job supervisor sets 0 for
    job drivers the same way). The actor gets a process of its own, started for it (~1 s more
    than a pooled worker). None: Ray's default."""
    if niceness is None:
        return None
    return {"env_vars": {"RAY_worker_niceness": str(niceness)}}


def new_incarnation() -> str:
    """Set in an actor's constructor: a restarted actor (fresh state) answers with a new one."""
    return uuid.uuid4().hex


def alive(handles: list, timeout_s: float = 10.0) -> bool:
    """Whether every actor answers a ping (``ready``) within ``timeout_s``."""
    try:
        ray.get([h.ready.remote() for h in handles], timeout=timeout_s)
        return True
    except RayError:  # died, killed for memory, unreachable, or too slow to answer
        return False


def kill_actor(actor: object) -> None:
    """Kill ``actor`` for good (no restart); one already gone is fine."""
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 — already gone
        pass


def channel_addresses(handles: list) -> tuple[bytes, list[tuple[str, int]]]:
    """A fresh token and each actor's step-channel listener under it (``channel_address``,
    one Ray call per actor)."""
    token = secrets.token_bytes(TOKEN_BYTES)
    return token, ray.get([h.channel_address.remote(token) for h in handles])


def open_channels(handles: list) -> list[ChannelClient]:
    """Each actor's step channel (``step_channel.py``), opened under a fresh token."""
    token, addresses = channel_addresses(handles)
    return [ChannelClient(address, token) for address in addresses]
