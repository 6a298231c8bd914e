"""The malloc settings for CPU inference: applied once per process, off with the switch."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import keyserve.engine.malloc_tuning as m
print(m.tune_malloc(), m.tune_malloc())
"""


def _run(env_value: str | None) -> str:
    import os

    env = dict(os.environ)
    env.pop("KEYSERVE_MALLOC_TUNING", None)
    if env_value is not None:
        env["KEYSERVE_MALLOC_TUNING"] = env_value
    return subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_applied_once_on_glibc() -> None:
    assert _run(None) == "True True"


def test_switch_off() -> None:
    assert _run("0") == "False False"
