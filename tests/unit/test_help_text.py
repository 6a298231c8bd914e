"""``--help`` is plain text: the reStructuredText of the docstrings and field descriptions it is
built from (````literal````, ``:class:`X```) does not reach the terminal."""

from __future__ import annotations

import re

import pytest

from keyserve.cli import build_parser as keyserve_parser
from keyserve.cluster.batch_job import build_parser as batch_parser
from keyserve.cluster.help_format import plain_text
from keyserve.cluster.serve_cli import build_parser as serve_parser

RST = re.compile(r"``|:[a-z]+(:[a-z]+)?:`")


def _sub(name: str):
    sub = next(a for a in keyserve_parser()._actions if a.dest == "command")
    return sub.choices[name]


@pytest.mark.parametrize(
    "parser",
    [keyserve_parser, lambda: _sub("generate"), lambda: _sub("distill-draft"), serve_parser, batch_parser],
    ids=["keyserve", "generate", "distill-draft", "serve", "batch"],
)
def test_help_has_no_rst_markup(parser) -> None:
    text = parser().format_help()
    assert not RST.search(text), RST.search(text).group(0)


def test_serve_help_keeps_its_text_and_example_layout() -> None:
    text = serve_parser().format_help()
    assert "Every ServeArgs field is a flag (--max-queued-requests" in text
    # The description's example block keeps its own lines (not re-wrapped into a paragraph).
    assert "\n    keyserve serve --address auto" in text


def test_plain_text_strips_roles_and_literals_only() -> None:
    assert plain_text("the ``ServeArgs`` model") == "the ServeArgs model"
    assert plain_text("see :class:`~keyserve.config.EngineConfig`") == "see EngineConfig"
    assert plain_text(":func:`keyserve.cluster.serve_app.build_app`") == "keyserve.cluster.serve_app.build_app"
    assert plain_text(":py:meth:`LLM.generate`, :ref:`the guide <serving>`") == "LLM.generate, the guide"
    assert plain_text("a `model` field, 2 * 3") == "a `model` field, 2 * 3"


def test_argument_help_is_plain_too() -> None:
    import argparse

    from keyserve.cluster.help_format import PlainHelpFormatter

    p = argparse.ArgumentParser(prog="x", formatter_class=PlainHelpFormatter)
    p.add_argument("--n", help="the ``n`` of :class:`~keyserve.SamplingParams` (default: %(default)s)", default=1)
    assert "the n of SamplingParams (default: 1)" in p.format_help()
