"""Errors the engine raises for a bad request, which the layers above map to API errors.

Part of the engine's public client surface (with ``async_engine`` and ``outputs``): torch-free,
so the HTTP layer imports it without loading the model stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a type only: errors stay import-light
    from keyserve.engine.outputs import RequestOutput


class PromptTooLongError(ValueError):
    """The prompt does not fit the context (the HTTP layer maps this to 400)."""


class InvalidParamError(ValueError):
    """A request parameter the engine cannot honour; ``param`` names it for the API error."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class RequestFailedError(InvalidParamError):
    """One request failed inside a step (something in it the engine could not process); it
    alone was aborted, the step went on for the others. Carried by its last output's
    ``error``; a 400-class error for the client (its content, not the server, is at fault)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, param)  # type: ignore[arg-type]


class StepFailedError(RuntimeError):
    """A step raised outside the per-request guards. The requests it was running were aborted
    (``request_ids``, their last ``outputs``); the engine is consistent and can step on."""

    def __init__(self, message: str, request_ids: list[str], outputs: list[RequestOutput]) -> None:
        super().__init__(message)
        self.request_ids = request_ids
        self.outputs = outputs
