"""The Dockerfile cannot be built here (no Docker engine); these checks read it: the versions it
pins agree with pyproject.toml and the chart, torch is installed before keyserve from the
variant's index, pip keeps no cache, and the image runs as a numeric non-root user."""

from __future__ import annotations

import re
import tomllib

import yaml

from chart_render import CHART_DIR, REPO


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    logical: list[str] = []
    pending = ""
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "the Dockerfile ends in a continuation line"
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1]) for text in logical]


def arg_defaults() -> dict[str, str]:
    return dict(arg.split("=", 1) for kind, arg in instructions() if kind == "ARG" and "=" in arg)


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_base_is_a_ray_image_matching_the_chart():
    args = arg_defaults()
    chart_ray = yaml.safe_load((CHART_DIR / "values.yaml").read_text())["rayVersion"]
    assert args["RAY_VERSION"] == chart_ray
    assert re.fullmatch(rf"rayproject/ray:{re.escape(chart_ray)}-py3(1[1-9])-cpu", args["BASE"]), args["BASE"]
    froms = [arg for kind, arg in instructions() if kind == "FROM"]
    assert froms == ["${BASE}"]


def test_torch_pin_and_cpu_index_match_pyproject():
    pins = [d for d in pyproject()["project"]["dependencies"] if d.startswith("torch==")]
    assert pins == [f"torch=={arg_defaults()['TORCH_VERSION']}"]
    assert arg_defaults()["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"


def test_torch_is_installed_before_keyserve():
    runs = [arg for kind, arg in instructions() if kind == "RUN"]
    torch_at = next(i for i, run in enumerate(runs) if '"torch==${TORCH_VERSION}"' in run)
    keyserve_at = next(i for i, run in enumerate(runs) if "pip install --no-cache-dir --no-deps ./keyserve-src" in run)
    assert torch_at < keyserve_at
    assert '--index-url "${TORCH_INDEX_URL}"' in runs[torch_at]


def test_every_pip_install_keeps_no_cache():
    for kind, arg in instructions():
        if kind == "RUN":
            for command in re.findall(r"pip install[^&]*", arg):
                assert "--no-cache-dir" in command, command


def test_runs_as_numeric_non_root_user():
    users = [arg for kind, arg in instructions() if kind == "USER"]
    assert users, "no USER instruction"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0  # numeric, so the kubelet can check runAsNonRoot
    chart = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert int(uid) == chart["podSecurityContext"]["runAsUser"]


def test_image_tag_follows_the_package_version():
    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    assert chart["appVersion"] == pyproject()["project"]["version"]


def test_dockerignore_keeps_what_the_build_copies():
    lines = (REPO / ".dockerignore").read_text().splitlines()
    for needed in ("!pyproject.toml", "!README.md", "!src/"):
        assert needed in lines
    copied = [arg for kind, arg in instructions() if kind == "COPY"]
    assert copied == ["--chown=1000:100 pyproject.toml README.md keyserve-src/",
                      "--chown=1000:100 src keyserve-src/src"]
