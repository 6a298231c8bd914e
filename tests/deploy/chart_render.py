"""Render the keyserve chart with Helm's own engine (``helm-python-sdk`` binds Helm's Go library)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kube_schemas import load_yaml_documents

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "helm" / "keyserve"
CI_DIR = CHART_DIR / "ci"
MANIFESTS_DIR = REPO / "manifests"
RELEASE = "keyserve"
NAMESPACE = "keyserve"


def ci_values_files() -> list[Path]:
    return sorted(CI_DIR.glob("*.yaml"))


def load_values(path: Path) -> dict[str, Any]:
    """A values file, parsed the way `helm install -f` parses it."""
    import helm_python as helm

    return helm.values_from_yaml(path.read_text())


def render(values: dict[str, Any] | None = None, *, release: str = RELEASE) -> dict[str, str]:
    """Template path -> rendered text (NOTES.txt included), as `helm template` would produce."""
    import helm_python as helm

    with helm.Chart.load(CHART_DIR) as chart:
        return chart.render(values or {}, name=release, namespace=NAMESPACE, is_install=True)


def render_objects(values: dict[str, Any] | None = None, *, release: str = RELEASE) -> list[dict[str, Any]]:
    """Every Kubernetes object the chart renders."""
    objects: list[dict[str, Any]] = []
    for path, text in sorted(render(values, release=release).items()):
        if path.endswith(".yaml"):
            objects.extend(load_yaml_documents(text))
    return objects


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


# The chart's defaults plus every file in helm/keyserve/ci/.
VALUES_CASES = ["defaults"] + [path.name for path in ci_values_files()]


def values_for(case: str) -> dict[str, Any]:
    """The values of a case: {} for the defaults, else the ci/ file of that name."""
    return {} if case == "defaults" else load_values(CI_DIR / case)
