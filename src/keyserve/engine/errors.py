"""Errors the engine raises for a bad request, which the layers above map to API errors.

Part of the engine's public client surface (with ``async_engine`` and ``outputs``): torch-free,
so the HTTP layer imports it without loading the model stack.
"""

from __future__ import annotations


class PromptTooLongError(ValueError):
    """The prompt does not fit the context (the HTTP layer maps this to 400)."""


class InvalidParamError(ValueError):
    """A request parameter the engine cannot honour; ``param`` names it for the API error."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param
