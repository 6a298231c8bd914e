"""Write one benchmark's results into its own section of docs/BENCHMARKS.md.

Each benchmark owns the text between ``<!-- BEGIN name -->`` and ``<!-- END name -->``, so
benchmarks run at different times never overwrite each other's numbers.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import re
import shlex
import sys
from pathlib import Path

import torch

BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md"
HEADER = "# Benchmarks\n\nEvery section below was written by the benchmark it names; rerun its command to refresh it.\n"


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {os.cpu_count()} cores, {gpu}, torch {torch.__version__}, Python {platform.python_version()}"


def command_line() -> str:
    return "python " + " ".join(shlex.quote(a) for a in sys.argv)


def markdown_table(headers: list[str], rows: list[list[object]]) -> str:
    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def update_section(name: str, title: str, body: str, path: Path = BENCHMARKS_MD) -> None:
    """Replace (or append) the section ``name`` with ``body`` plus command, date and machine."""
    stamp = (
        f"Command: `{command_line()}`  \nDate: {_dt.date.today().isoformat()}  \n"
        f"Machine: {machine_description()}\n"
    )
    block = f"<!-- BEGIN {name} -->\n## {title}\n\n{stamp}\n{body.strip()}\n<!-- END {name} -->"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.exists() else HEADER
    pattern = re.compile(rf"<!-- BEGIN {re.escape(name)} -->.*?<!-- END {re.escape(name)} -->", re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)
