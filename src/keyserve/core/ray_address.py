"""Whether a Ray cluster address answers, before ``ray.init`` is asked to join it (it retries
an unreachable GCS for minutes, printing only timeouts). Pure socket code: the CLI, the batch
job and the actors all check with it."""

from __future__ import annotations

import socket


def check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """A ``host:port`` Ray address must answer a TCP connect: ``ray.init`` itself retries an
    unreachable GCS for minutes, printing only timeouts. ``auto``, ``local`` and ``ray://``
    addresses are left to Ray."""
    if address in ("auto", "local") or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise ConnectionError(f"Ray address {address!r} is not host:port")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConnectionError(f"cannot reach the Ray cluster at {address} ({e.strerror or e}); "
                              "check --address / $RAY_ADDRESS") from None
