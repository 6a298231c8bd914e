"""values.yaml documents every key with a `# --` comment (helm-docs style, as KubeRay's charts
do), and the schema knows every key the defaults set."""

from __future__ import annotations

import json

import yaml

from chart_render import CHART_DIR


def mapping_keys_without_doc(text: str) -> list[str]:
    """Dotted paths of mapping keys whose previous non-blank line is not a `# --` comment."""
    root = yaml.compose(text)
    lines = text.splitlines()
    missing: list[str] = []

    def documented(line_no: int) -> bool:
        for prev in range(line_no - 1, -1, -1):
            stripped = lines[prev].strip()
            if not stripped:
                continue
            if stripped.startswith("# --"):
                return True
            if stripped.startswith("#"):  # a continuation or a plain comment: keep looking up
                continue
            return False
        return False

    def walk(node, path: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                here = f"{path}.{key.value}" if path else key.value
                if not documented(key.start_mark.line):
                    missing.append(here)
                walk(value, here)
        # Items of lists (tolerations, drop) are values, not keys: not walked.

    walk(root, "")
    return missing


def schema_paths(schema: dict, path: str = "") -> set[str]:
    paths = set()
    for key, sub in schema.get("properties", {}).items():
        here = f"{path}.{key}" if path else key
        paths.add(here)
        paths |= schema_paths(sub, here)
    return paths


def value_paths(values, path: str = "") -> set[str]:
    paths = set()
    if isinstance(values, dict):
        for key, sub in values.items():
            here = f"{path}.{key}" if path else key
            paths.add(here)
            paths |= value_paths(sub, here)
    return paths


def test_every_values_key_has_a_doc_comment():
    assert mapping_keys_without_doc((CHART_DIR / "values.yaml").read_text()) == []


def test_schema_covers_the_default_values():
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    # Free-form maps (their keys are the user's) stop the walk.
    free_form = ("serve.rayActorOptions.", "head.rayStartParams.", "head.resources.", "worker.resources.",
                 "podSecurityContext.", "securityContext.")
    wanted = {p for p in value_paths(values) if not p.startswith(free_form)}
    assert wanted - schema_paths(schema) == set()
