"""Command-line flags generated from a pydantic model's fields (``--max-num-seqs 32``), so
``keyserve serve`` / ``keyserve batch`` accept exactly what ``build_app(args)`` accepts, with
the fields' descriptions as help, and fail the same way on a bad value."""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _plain_type(annotation: Any) -> tuple[Any, list[Any] | None]:
    """(argparse type, choices) for an annotation like ``int | None`` or ``Literal[...]``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _plain_type(args[0])
    if origin is Literal:
        return type(args[0]), list(args)
    if annotation in (int, float, str, bool):
        return annotation, None
    return str, None


def add_model_fields(parser: argparse.ArgumentParser, model: type[BaseModel],
                     exclude: set[str] = frozenset()) -> None:
    """One flag per field; unset flags stay None and leave the model's default."""
    for name, field in model.model_fields.items():
        if name in exclude:
            continue
        kind, choices = _plain_type(field.annotation)
        default = field.default if field.default is not None and not callable(field.default) else None
        help_text = (field.description or "") + (f" (default: {default})" if default is not None else "")
        if kind is bool:
            parser.add_argument(_flag(name), dest=name, default=None,
                                action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(_flag(name), dest=name, default=None, type=kind, choices=choices,
                                help=help_text)


def model_kwargs(ns: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    """The flags given on the command line, as keyword arguments for ``model``."""
    return {k: v for k, v in vars(ns).items() if k in model.model_fields and v is not None}
