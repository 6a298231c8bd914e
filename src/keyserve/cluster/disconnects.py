"""Client disconnects are aborts, not server errors.

A client that goes away shows up in several shapes depending on the server: uvicorn answers
``receive()`` with ``http.disconnect`` (and Starlette raises ``ClientDisconnect`` from a body
still being read); Ray Serve cancels the handler's task, or its receive proxy raises once the
proxy has dropped the request; a send on a closed connection raises ``OSError``. Left alone the
exceptions reach Starlette's error middleware, which logs them as unhandled and answers 500 --
a false alert in every deployment. This ASGI middleware (inside that one) turns all of them
into one count of ``keyserve:request_aborted`` and nothing else; the engine requests are aborted
by the handlers' own cleanup.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)


class DisconnectGuard:
    """Pure ASGI middleware; ``on_abort`` is called once per request the client abandoned."""

    def __init__(self, app: ASGIApp, on_abort: Callable[[], None]) -> None:
        self.app = app
        self.on_abort = on_abort

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        watch = _Watch(receive, send)
        try:
            await self.app(scope, watch.receive, watch.send)
        except asyncio.CancelledError:  # Ray Serve cancels the handler when the client goes
            if not watch.done:
                watch.gone = True
            self._count(watch, scope)
            raise
        except Exception as e:  # noqa: BLE001 — only disconnects are swallowed
            if not (watch.gone or isinstance(e, ClientDisconnect)):
                raise
            watch.gone = True
            log.debug("client went away: %s %s (%r)", scope.get("method"), scope.get("path"), e)
        self._count(watch, scope)

    def _count(self, watch: "_Watch", scope: Scope) -> None:
        if watch.gone and not watch.counted:
            watch.counted = True
            try:
                self.on_abort()
            except Exception:  # noqa: BLE001 — metrics never break a request
                log.exception("abort counter failed")


class _Watch:
    """Wraps receive / send: notes a disconnect (in any shape) before the response ended."""

    def __init__(self, receive: Receive, send: Send) -> None:
        self._receive = receive
        self._send = send
        self.gone = False  # the client left before the response was complete
        self.done = False  # the last body message was sent
        self.counted = False

    async def receive(self) -> Message:
        try:
            message = await self._receive()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 — Ray Serve's receive proxy, once the request is gone
            log.debug("receive failed, taken as a disconnect: %r", e)
            message = {"type": "http.disconnect"}
        if message["type"] == "http.disconnect" and not self.done:
            self.gone = True
        return message

    async def send(self, message: Any) -> None:
        try:
            await self._send(message)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 — a closed connection
            if self.done:
                raise
            self.gone = True
            raise ClientDisconnect() from e
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.done = True
