"""Command-line flags generated from pydantic models' fields (``--max-num-seqs 32``).

Every command's model and engine flags come from here: ``keyserve serve`` / ``keyserve batch``
from ``ServeArgs`` / ``ServeConfig``, ``keyserve generate`` from ``FlatEngineConfig`` and
``SamplingParams``. A flag is its field: the field's name (``_`` -> ``-``), its description
as help with its default and range, its choices (``Literal`` types such as the KV policies),
and the model validates the value, so a flag accepts exactly what the Python API, the YAML and
the Serve ``args`` accept and fails the same way.

An unset flag stays None and leaves the field's default: only given flags reach the model.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from keyserve.config import ENGINE_FIELD_PATHS, FlatEngineConfig

# Help-group titles of the engine's sections (EngineConfig's fields).
ENGINE_GROUPS = {
    "model": "engine: model",
    "cache": "engine: KV cache and KV budgets",
    "scheduler": "engine: scheduler",
    "spec": "engine: speculative decoding",
    "parallel": "engine: Ray cluster and tensor parallelism",
    "prefix_store": "engine: prefix KV store",
    "seed": "engine: model",
}
# Bounds at or beyond this are overflow guards, not ranges a user picks: help does not show them.
_NO_PRACTICAL_LIMIT = 2**31 - 1


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _json_object(text: str) -> dict[str, Any]:
    """A dict-valued field on the command line: a JSON object (``--worker-resources '{"a": 1}'``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


@dataclass(frozen=True)
class FlagType:
    """How argparse reads one field: its scalar type, choices, and whether it repeats (lists)."""

    kind: Any
    choices: list[Any] | None = None
    repeated: bool = False


def flag_type(annotation: Any) -> FlagType:
    """The FlagType of ``int | None``, ``Literal[...]``, ``list[str]``, ``dict[str, float]``, ..."""
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin is Annotated:
        return flag_type(args[0])
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return flag_type(args[0])
    if origin is Literal:
        return FlagType(type(args[0]), list(args))
    if origin is list:
        return FlagType(flag_type(args[0]).kind, flag_type(args[0]).choices, repeated=True)
    if origin is dict:
        return FlagType(_json_object)
    if annotation in (int, float, str, bool):
        return FlagType(annotation)
    return FlagType(str)


def _bound(value: Any) -> bool:
    return abs(value) < _NO_PRACTICAL_LIMIT


def range_text(info: FieldInfo) -> str | None:
    """The field's range as help shows it: ``[1, 16]``, ``(0, 1]``, ``>= 1``; None if unbounded."""
    low = high = None
    for m in info.metadata:
        if isinstance(m, Ge) and _bound(m.ge):
            low = f"[{m.ge}"
        elif isinstance(m, Gt) and _bound(m.gt):
            low = f"({m.gt}"
        elif isinstance(m, Le) and _bound(m.le):
            high = f"{m.le}]"
        elif isinstance(m, Lt) and _bound(m.lt):
            high = f"{m.lt})"
    if low and high:
        return f"{low}, {high}"
    if low:
        return (">= " if low[0] == "[" else "> ") + low[1:]
    if high:
        return ("<= " if high[-1] == "]" else "< ") + high[:-1]
    return None


def help_text(info: FieldInfo, default: Any = None) -> str:
    """The field's description, then its default and range (``%`` escaped for argparse)."""
    notes = []
    if default is not None:
        notes.append(f"default: {default}")
    if (bounds := range_text(info)) is not None:
        notes.append(f"range: {bounds}")
    text = (info.description or "") + (f" ({'; '.join(notes)})" if notes else "")
    return text.replace("%", "%%")


class Switch(argparse.Action):
    """A bool field: ``--x`` sets True, ``--no-x`` False; a field named ``enable_x`` also
    reads ``--no-x`` (``--no-prefix-caching``). Unset: None (the field's default)."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None,
                 **_: Any) -> None:
        flag = option_strings[0]
        negatives = ["--no-" + flag[2:]]
        if flag.startswith("--enable-"):
            negatives.append("--no-" + flag[len("--enable-"):])
        self.negatives = frozenset(negatives)
        super().__init__([*option_strings, *negatives], dest, nargs=0, default=None, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, option_string not in self.negatives)

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


@dataclass
class FieldFlags:
    """The flags one ``add_model_fields`` call added: which argparse dest holds which field."""

    model: type[BaseModel]
    fields: dict[str, str] = field(default_factory=dict)  # argparse dest -> the model's field name

    def values(self, ns: argparse.Namespace) -> dict[str, Any]:
        """The flags given on the command line, as keyword arguments of ``model``."""
        return {name: getattr(ns, dest) for dest, name in self.fields.items()
                if getattr(ns, dest, None) is not None}

    def build(self, ns: argparse.Namespace, **extra: Any) -> Any:
        """``model(**given flags, **extra)``: validated, raising pydantic's ValidationError."""
        return self.model(**self.values(ns), **extra)

    def flag(self, name: str) -> str | None:
        """The flag of field ``name`` (None: it has none here)."""
        return next((_flag(dest) for dest, field_name in self.fields.items() if field_name == name), None)


def flag_errors(error: ValidationError, *flag_sets: FieldFlags) -> str:
    """A pydantic error of a model built from flags, naming the flags (``--max-num-seqs: ...``)."""
    owners = [f for f in flag_sets if f.model.__name__ == error.title]
    parts = []
    for err in error.errors():
        name = str(err["loc"][0]) if err["loc"] else None
        flag = next((f.flag(name) for f in owners if name and f.flag(name)), None)
        where = flag or ".".join(map(str, err["loc"])) or None
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts)


def _group(parser: argparse.ArgumentParser, title: str | None) -> Any:
    if title is None:
        return parser
    for group in parser._action_groups:  # one group per title, whichever call adds to it
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def add_model_fields(parser: argparse.ArgumentParser, model: type[BaseModel],
                     exclude: Mapping[str, str] | None = None,
                     rename: Mapping[str, str] | None = None, title: str | None = None,
                     defaults: Mapping[str, Any] | None = None) -> FieldFlags:
    """One flag per field of ``model`` but those in ``exclude`` (field -> the reason it has
    no flag). ``rename`` gives a field another flag name (``seed`` -> ``engine_seed``) where a
    command has two fields of one name; ``defaults`` are the command's own defaults for a field
    (shown in help, used when the flag is not given). Engine fields go to their section's help
    group, the others to ``title``. Other spellings a field accepts (its validation aliases,
    ``--tensor-parallel-size`` for ``--tp``) are the same flag."""
    rename, defaults, excluded = rename or {}, defaults or {}, dict(exclude or {})
    for name, reason in excluded.items():
        if name not in model.model_fields or not reason.strip():
            raise ValueError(f"exclude {name!r}: not a field of {model.__name__}, or no reason given")
    flags = FieldFlags(model)
    for name, info in model.model_fields.items():
        if name in excluded:
            continue
        dest = rename.get(name, name)
        options = [_flag(dest)]
        aliases = getattr(info.validation_alias, "choices", ())
        options += [_flag(a) for a in aliases if isinstance(a, str) and a not in (name, dest)]
        shown = defaults.get(name, None if info.is_required() or info.default_factory else info.default)
        path = ENGINE_FIELD_PATHS.get(name) if issubclass(model, FlatEngineConfig) else None
        group = _group(parser, ENGINE_GROUPS[path[0]] if path else title)
        ftype = flag_type(info.annotation)
        kw: dict[str, Any] = {"dest": dest, "help": help_text(info, shown)}
        if ftype.kind is bool and not ftype.repeated:
            group.add_argument(*options, action=Switch, **kw)
        elif ftype.repeated:
            kw["help"] += " (repeat the flag for more)"
            group.add_argument(*options, type=ftype.kind, choices=ftype.choices, action="append", **kw)
        else:
            metavar = "JSON" if ftype.kind is _json_object else None
            group.add_argument(*options, type=ftype.kind, choices=ftype.choices, metavar=metavar, **kw)
        if name in defaults:
            parser.set_defaults(**{dest: defaults[name]})
        flags.fields[dest] = name
    return flags


def model_kwargs(ns: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    """The flags given on the command line whose dest is a field of ``model`` (no renames)."""
    return {k: v for k, v in vars(ns).items() if k in model.model_fields and v is not None}
