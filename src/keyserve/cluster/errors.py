"""Every failure as an OpenAI error envelope ``{"error": {"message", "type", "param", "code"}}``.

``to_api_error`` is the one place that decides which exception becomes which status, so the
HTTP server and the batch job report the same error the same way.
"""

from __future__ import annotations

import logging

from pydantic import ValidationError

from keyserve.cluster.openai_protocol import ErrorInfo, ErrorResponse
from keyserve.engine.async_engine import (
    EngineDeadError,
    EngineStepError,
    QueueFullError,
    RequestTimeoutError,
)
from keyserve.engine.errors import InvalidParamError, PromptTooLongError

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error with its HTTP status, OpenAI type / param / code and extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        message = _printable(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = None if param is None else _printable(param)
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()


def _printable(text: str) -> str:
    """``text`` with what UTF-8 cannot carry (a lone surrogate from the client) escaped, so the
    error that names it can itself be sent."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def from_validation_error(err: ValidationError, rename: dict[str, str] | None = None) -> APIError:
    """400 naming the first offending field (its top-level name, renamed for the client)."""
    rename = rename or {}
    parts = []
    param = None
    for e in err.errors():
        loc = [str(x) for x in e["loc"] if not str(x).startswith(("function-", "union["))]
        field = rename.get(loc[0], loc[0]) if loc else None
        param = param or field
        where = ".".join([field, *loc[1:]]) if field else "body"
        parts.append(f"{where}: {e['msg']}" + ("" if e["type"] != "extra_forbidden" else " (unknown field)"))
    return bad_request("; ".join(dict.fromkeys(parts)), param)


def to_api_error(exc: BaseException, prompt_param: str = "prompt",
                 retry_after_s: int = 1, rename: dict[str, str] | None = None) -> APIError:
    """Map an exception from validation or the engine to its APIError."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValidationError):
        return from_validation_error(exc, rename)
    if isinstance(exc, InvalidParamError):
        return bad_request(str(exc), exc.param)
    if isinstance(exc, PromptTooLongError):
        return bad_request(str(exc), prompt_param, code="context_length_exceeded")
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), "server_error", code="server_overloaded",
                        headers={"Retry-After": str(retry_after_s)})
    if isinstance(exc, RequestTimeoutError):
        return APIError(408, str(exc), "timeout_error", code="request_timeout")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), "server_error", code="engine_unavailable",
                        headers={"Retry-After": str(max(retry_after_s, 5))})
    if isinstance(exc, EngineStepError):
        return APIError(500, str(exc), "server_error", code="engine_step_failed")
    if isinstance(exc, ValueError):
        message = str(exc)
        return bad_request(message, prompt_param)
    log.error("unexpected error", exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}", "server_error",
                    code="internal_error")
