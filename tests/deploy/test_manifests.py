"""The plain manifests are the chart's defaults written out: the same specs, so a user without
Helm runs exactly what the chart would install (their schema validity is checked in
test_kube_validation)."""

from __future__ import annotations

import copy

import pytest

from chart_render import MANIFESTS_DIR, one, render_objects
from kube_schemas import load_yaml_documents
from write_manifests import manifests

pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's engine) is not installed")

HELM_ONLY_LABELS = {"helm.sh/chart", "app.kubernetes.io/managed-by"}


def manifest(name):
    (obj,) = load_yaml_documents((MANIFESTS_DIR / name).read_text())
    return obj


def plain_labels(obj):
    return {k: v for k, v in obj["metadata"]["labels"].items() if k not in HELM_ONLY_LABELS}


def relabel_components(spec, old, new):
    """The cluster spec with its pods' component labels renamed from old-* to new-*."""
    spec = copy.deepcopy(spec)
    templates = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec.get("workerGroupSpecs", [])]
    for template in templates:
        labels = template["metadata"]["labels"]
        labels["app.kubernetes.io/component"] = labels["app.kubernetes.io/component"].replace(old, new, 1)
    return spec


def test_rayservice_manifest_is_the_chart_default():
    chart = one(render_objects({}), "RayService")
    plain = manifest("rayservice.yaml")
    assert plain["metadata"]["name"] == chart["metadata"]["name"] == "keyserve"
    assert plain["metadata"]["labels"] == plain_labels(chart)
    assert plain["spec"] == chart["spec"]


def test_rayjob_manifest_is_the_chart_batch_job():
    chart = one(render_objects({"serve": {"enabled": False}, "batchJob": {"enabled": True}}), "RayJob")
    plain = manifest("rayjob.yaml")
    assert plain["metadata"]["name"] == chart["metadata"]["name"] == "keyserve-batch"
    assert plain["metadata"]["labels"] == plain_labels(chart)
    assert plain["spec"] == chart["spec"]


def test_raycluster_manifest_is_the_rayservice_cluster():
    service = manifest("rayservice.yaml")
    cluster = manifest("raycluster.yaml")
    assert cluster["metadata"]["name"] == "keyserve-cluster"  # not the RayService's: its services differ
    assert cluster["spec"] == relabel_components(service["spec"]["rayClusterConfig"], "serve-", "cluster-")


@pytest.mark.parametrize("name", ["rayservice.yaml", "rayjob.yaml", "raycluster.yaml"])
def test_manifest_files_are_up_to_date(name):
    assert (MANIFESTS_DIR / name).read_text() == manifests()[name], (
        f"manifests/{name} differs from the chart: run .venv/bin/python tests/deploy/write_manifests.py"
    )
