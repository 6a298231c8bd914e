"""Reading a JSON request body within limits: size, nesting depth, finite numbers, valid text.

Everything here fails as an ``APIError`` (413 past the size limit, 400 otherwise) naming the
top-level field at fault, so no body can reach the request models -- or end in a 500 -- by
being too large, too deep, non-finite (``NaN``, ``Infinity``, ``1e400``) or carrying a lone
UTF-16 surrogate (``"\\ud800"``), which Python's ``json`` accepts but no tokenizer or
response encoder can handle.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from starlette.requests import Request

from keyserve.cluster.errors import APIError, bad_request

MAX_JSON_DEPTH = 32  # nested arrays / objects; an OpenAI body needs about 6
_THREAD_ABOVE_BYTES = 256 * 1024  # parse bodies larger than this off the event loop


class _NotFinite:
    """What the parser puts where a number is not finite (reported with its field)."""

    def __init__(self, text: str) -> None:
        self.text = text


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than the server's limit of {limit} bytes "
                    "(--max-request-bytes)", code="request_too_large")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused with 413 as soon as Content-Length or the bytes read pass ``max_bytes``
    (a chunked body has no Content-Length: it is counted as it arrives)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_request("invalid Content-Length header", code="invalid_request")
        if int(declared) > max_bytes:
            raise too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_json(raw: bytes) -> Any:
    """``parse_json_sync``, on a worker thread for large bodies (a 4 MB parse and check is
    tens of milliseconds the event loop, and every stream, would otherwise wait)."""
    if len(raw) > _THREAD_ABOVE_BYTES:
        return await asyncio.to_thread(parse_json_sync, raw)
    return parse_json_sync(raw)


def parse_json_sync(raw: bytes) -> Any:
    try:
        value = loads_marked(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    check_json(value)
    return value


def loads_marked(raw: str | bytes) -> Any:
    """``json.loads`` as the server parses a body, without the checks: a non-finite number
    (``NaN``, ``1e400``) or an integer of more than 4300 digits is marked for ``check_json``
    to report with its field. Raises ``json.JSONDecodeError`` / ``UnicodeDecodeError`` on bad
    JSON, ``APIError`` when it is nested too deep for the parser."""
    try:
        return _loads(raw, big_ints=False)
    except ValueError as e:
        if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)):
            raise
        # An integer of more than 4300 digits: parse again, marking such numbers, to name the field.
        return _loads(raw, big_ints=True)


def _loads(raw: str | bytes, big_ints: bool) -> Any:
    kwargs: dict[str, Any] = {"parse_float": _float, "parse_constant": _NotFinite}
    if big_ints:
        kwargs["parse_int"] = _int
    try:
        return json.loads(raw, **kwargs)
    except RecursionError:
        raise _too_deep(None) from None


def _float(text: str) -> float | _NotFinite:
    value = float(text)
    return value if math.isfinite(value) else _NotFinite(text)


def _int(text: str) -> int | _NotFinite:
    return int(text) if len(text) <= 40 else _NotFinite(text[:20] + "...")


def _too_deep(param: str | None) -> APIError:
    return bad_request(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep", param,
                       code="invalid_json")


def check_json(value: Any) -> None:
    """Depth, finite numbers and valid text (object keys included), without recursion."""
    stack: list[tuple[Any, int, str | None, str]] = [(value, 0, None, "body")]
    while stack:
        item, depth, param, where = stack.pop()
        if isinstance(item, dict):
            if depth >= MAX_JSON_DEPTH:
                raise _too_deep(param)
            for key, child in item.items():
                _check_text(key, param or key, f"{where}.{key}" if depth else key)
                stack.append((child, depth + 1, param or key, f"{where}.{key}" if depth else key))
        elif isinstance(item, list):
            if depth >= MAX_JSON_DEPTH:
                raise _too_deep(param)
            if set(map(type, item)) <= {int}:  # token ids: nothing to look into (fast for long lists)
                continue
            stack.extend((child, depth + 1, param, f"{where}.{i}") for i, child in enumerate(item))
        elif isinstance(item, str):
            _check_text(item, param, where)
        elif isinstance(item, _NotFinite):
            raise bad_request(f"{where}: {item.text} is not a finite number in range", param,
                              code="invalid_value")


def _check_text(text: str, param: str | None, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"{where}: the text is not valid Unicode (it holds a lone UTF-16 "
                          "surrogate)", param, code="invalid_value") from None
