"""Plain ``--help`` text from docstrings and field descriptions written in reStructuredText.

Module docstrings and pydantic descriptions double as help text; the markup that reads well in
the code (````literal````, ``:class:`X```) is noise in a terminal, so help is formatted through
``PlainHelpFormatter``, which strips it and keeps the description's own line layout (its
example command blocks).
"""

from __future__ import annotations

import argparse
import re

# :role:`target` or :role:`text <target>` -> the text (the last dotted part when "~" asks so).
_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`(~?)([^`<]*?)\s*(?:<([^`>]*)>)?`")
_LITERAL = re.compile(r"``(.+?)``", re.S)


def _role_text(m: re.Match[str]) -> str:
    tilde, text, target = m.group(1), m.group(2), m.group(3)
    if target is not None and text:
        return text
    name = text or target or ""
    return name.rsplit(".", 1)[-1] if tilde else name


def plain_text(text: str) -> str:
    """``text`` without reStructuredText inline markup: roles become their text, literals lose
    their double backticks. Anything else (single backticks included) is kept."""
    return _LITERAL.sub(r"\1", _ROLE.sub(_role_text, text))


class PlainHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's line breaks (RawDescription) and strips rST from every text."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain_text(text))

    def _expand_help(self, action: argparse.Action) -> str:
        return plain_text(super()._expand_help(action))
