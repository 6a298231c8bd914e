"""Every object the chart renders, and every file in manifests/, is a valid Kubernetes object:
KubeRay kinds against the openAPIV3Schema of the shared KubeRay CRDs (strict: unknown fields
are errors), core kinds and the Ray pod templates with kubernetes-validate, the ServiceMonitor
(whose CRD is not shipped here) against a minimal structural schema."""

from __future__ import annotations

import copy

import jsonschema
import pytest

from chart_render import MANIFESTS_DIR, VALUES_CASES, one
from kube_schemas import (
    KUBE_VERSION,
    OLDEST_KUBE_VERSION,
    RAY_KINDS,
    check_object_meta,
    core_errors,
    crd_errors,
    crds_dir,
    load_yaml_documents,
    pod_template_errors,
    pod_templates,
)

pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")

CORE_KINDS = {"Secret", "PodDisruptionBudget"}
MANIFEST_FILES = ["rayservice.yaml", "rayjob.yaml", "raycluster.yaml"]

# The monitoring.coreos.com CRD is not among the shared CRDs: this checks the structure of the
# fields the chart writes (names and types follow prometheus-operator's ServiceMonitor v1).
_DURATION = "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchLabels": _STRING_MAP, "matchExpressions": {"type": "array"}},
                },
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"any": {"type": "boolean"},
                                   "matchNames": {"type": "array", "items": {"type": "string"}}},
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["port"],
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string", "minLength": 1},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": _DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": _DURATION},
                        },
                    },
                },
            },
        },
    },
}


def object_errors(obj, kube_version=KUBE_VERSION):
    """All errors of one object, by kind."""
    if obj["kind"] in RAY_KINDS:
        errors = crd_errors(obj)
        for where, template in pod_templates(obj):
            errors += [f"{where}: {e}" for e in pod_template_errors(template, kube_version)]
        return errors
    if obj["kind"] in CORE_KINDS:
        return core_errors(obj, kube_version)
    if obj["kind"] == "ServiceMonitor":
        validator = jsonschema.Draft7Validator(SERVICE_MONITOR_SCHEMA)
        return [err.message for err in validator.iter_errors(obj)] + check_object_meta(obj)
    raise AssertionError(f"no validation for kind {obj['kind']}: add it here")


def test_shared_crds_are_present():
    for plural in RAY_KINDS.values():
        assert (crds_dir() / f"ray.io_{plural}.yaml").is_file(), f"set KEYSERVE_CRDS_DIR (looked in {crds_dir()})"


@pytest.mark.parametrize("kube_version", [KUBE_VERSION, OLDEST_KUBE_VERSION])
@pytest.mark.parametrize("case", VALUES_CASES)
def test_rendered_objects_validate(case, kube_version, rendered_cases):
    for obj in rendered_cases[case]:
        assert object_errors(obj, kube_version) == [], f"{obj['kind']} {obj['metadata']['name']}"


@pytest.mark.parametrize("name", MANIFEST_FILES)
def test_manifests_validate(name):
    docs = load_yaml_documents((MANIFESTS_DIR / name).read_text())
    assert docs, f"manifests/{name} is empty"
    for obj in docs:
        assert obj["apiVersion"] == "ray.io/v1"
        assert object_errors(obj) == [], f"manifests/{name}: {obj['kind']} {obj['metadata']['name']}"


def _mutations():
    """Broken copies of a valid RayService, each with the error the validator must report."""

    def cluster(svc):
        return svc["spec"]["rayClusterConfig"]

    def head_container(svc):
        return cluster(svc)["headGroupSpec"]["template"]["spec"]["containers"][0]

    return [
        ("unknown spec field", lambda s: s["spec"].__setitem__("serveConfig", "x"), "serveConfig"),
        ("serveConfigV2 not a string", lambda s: s["spec"].__setitem__("serveConfigV2", {"a": 1}), "string"),
        ("rayStartParams value not a string",
         lambda s: cluster(s)["headGroupSpec"]["rayStartParams"].__setitem__("num-gpus", 0), "string"),
        ("worker group without maxReplicas",
         lambda s: cluster(s)["workerGroupSpecs"][0].pop("maxReplicas"), "maxReplicas"),
        ("replicas beyond int32",
         lambda s: cluster(s)["workerGroupSpecs"][0].__setitem__("replicas", 2**31), "int32"),
        ("duplicate container port",
         lambda s: head_container(s)["ports"].append({"name": "again", "containerPort": 8000}), "duplicate"),
        ("unknown container field", lambda s: head_container(s).__setitem__("gpus", 1), "gpus"),
        ("bad managedBy", lambda s: s["spec"].__setitem__("managedBy", "me"), "managedBy"),
        ("bad label value",
         lambda s: s["metadata"]["labels"].__setitem__("app.kubernetes.io/version", "a b"), "bad value"),
    ]


@pytest.mark.parametrize(("what", "mutate", "needle"), _mutations(), ids=[m[0] for m in _mutations()])
def test_validator_rejects_broken_objects(what, mutate, needle, rendered_cases):
    service = copy.deepcopy(one(rendered_cases["defaults"], "RayService"))
    assert crd_errors(service) == []
    mutate(service)
    errors = crd_errors(service)
    assert errors and any(needle in e for e in errors), errors


def test_core_validation_rejects_a_broken_pdb(rendered_cases):
    pdb = copy.deepcopy(one(rendered_cases["cpu-only.yaml"], "PodDisruptionBudget"))
    pdb["spec"]["minAvailble"] = 1
    assert core_errors(pdb) != []


def test_pod_template_validation_rejects_a_bad_volume(rendered_cases):
    service = copy.deepcopy(one(rendered_cases["defaults"], "RayService"))
    template = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    template["spec"]["volumes"][0]["emptyDir"]["sizeLimit"] = ["10Gi"]
    assert pod_template_errors(template) != []
