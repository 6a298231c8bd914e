"""Validate Kubernetes objects offline: KubeRay kinds against their CRD's openAPIV3Schema,
core kinds with ``kubernetes-validate``.

The CRD schemas are structural OpenAPI v3 schemas with Kubernetes extensions. The API server
checks them with a few rules plain JSON Schema does not know; this module adds them:

- unknown fields are errors (``kubectl apply --validate=strict``), except under
  ``x-kubernetes-preserve-unknown-fields``;
- ``nullable: true`` admits null;
- ``x-kubernetes-int-or-string`` (the CRDs spell it as an ``anyOf`` of integer and string);
- ``x-kubernetes-list-type``: ``map`` lists must have unique ``x-kubernetes-list-map-keys``,
  ``set`` lists unique items;
- ``format`` ``int32`` / ``int64`` ranges;
- ``x-kubernetes-validations`` (CEL): transition rules (``oldSelf``) hold trivially on
  create, membership rules ``self in [...]`` are checked; any other rule on a field that is
  present fails loudly, so nothing is silently skipped.

``metadata`` is only ``type: object`` in a CRD (the API server validates ObjectMeta itself);
:func:`check_object_meta` applies the ObjectMeta rules that matter for these manifests.
"""

from __future__ import annotations

import ast
import copy
import os
import re
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

KUBE_VERSION = "1.33.0"  # a recent release kubernetes-validate ships; the chart needs >= 1.25
OLDEST_KUBE_VERSION = "1.25.0"  # the chart's kubeVersion floor
RAY_KINDS = {"RayCluster": "rayclusters", "RayJob": "rayjobs", "RayService": "rayservices"}

_INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def crds_dir() -> Path:
    """The shared KubeRay CRDs: ``$KEYSERVE_CRDS_DIR`` or ``<repo>/../shared/crds``."""
    env = os.environ.get("KEYSERVE_CRDS_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "shared" / "crds"


def load_yaml_documents(text: str) -> list[dict[str, Any]]:
    """Every non-empty document of a YAML stream."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return [doc for doc in yaml.load_all(text, Loader=loader) if doc]


@lru_cache(maxsize=None)
def crd_schema(kind: str, version: str) -> dict[str, Any]:
    """The openAPIV3Schema of ``kind`` at ``version`` (e.g. ``"v1"``), made strict."""
    path = crds_dir() / f"ray.io_{RAY_KINDS[kind]}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"KubeRay CRD for {kind} not found at {path} (set KEYSERVE_CRDS_DIR)")
    (crd,) = load_yaml_documents(path.read_text())
    assert crd["spec"]["names"]["kind"] == kind, f"{path} defines {crd['spec']['names']['kind']}"
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            if not entry.get("served", False):
                raise ValueError(f"{kind} {version} is not served by the CRD in {path}")
            return _strict(copy.deepcopy(entry["schema"]["openAPIV3Schema"]))
    raise ValueError(f"{path} has no version {version} of {kind}")


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """Close every object schema that lists its properties, and spell nullable as JSON Schema."""
    if schema.get("nullable") and "type" in schema:
        schema["type"] = [schema["type"], "null"]
    preserve = schema.get("x-kubernetes-preserve-unknown-fields", False)
    if "properties" in schema and "additionalProperties" not in schema and not preserve:
        schema["additionalProperties"] = False
    for key in ("properties", "patternProperties"):
        for sub in schema.get(key, {}).values():
            _strict(sub)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            _strict(schema[key])
    for key in ("anyOf", "allOf", "oneOf"):
        for sub in schema.get(key, []):
            _strict(sub)
    return schema


def _list_type(validator, list_type, instance, schema) -> Iterator[jsonschema.ValidationError]:
    if not isinstance(instance, list):
        return
    if list_type == "map":
        keys = schema.get("x-kubernetes-list-map-keys", [])
        seen: set[tuple] = set()
        for item in instance:
            # A key with a default counts as that default when absent (e.g. protocol: TCP).
            props = schema.get("items", {}).get("properties", {})
            key = tuple(item.get(k, props.get(k, {}).get("default")) for k in keys)
            if key in seen:
                yield jsonschema.ValidationError(f"duplicate entry with {dict(zip(keys, key))} in a map list")
            seen.add(key)
    elif list_type == "set":
        seen_items: list = []
        for item in instance:
            if item in seen_items:
                yield jsonschema.ValidationError(f"duplicate item {item!r} in a set list")
            seen_items.append(item)


_IN_RULE = re.compile(r"^self in (\[.*\])$")


def _cel_rules(validator, rules, instance, schema) -> Iterator[jsonschema.ValidationError]:
    for entry in rules:
        rule = entry["rule"]
        if "oldSelf" in rule:
            continue  # a transition rule: only constrains updates
        match = _IN_RULE.match(rule)
        if match:
            allowed = ast.literal_eval(match.group(1))
            if instance not in allowed:
                yield jsonschema.ValidationError(entry.get("message", f"{instance!r} violates {rule}"))
            continue
        yield jsonschema.ValidationError(f"CEL rule {rule!r} is not evaluated here; the field is set")


def _int_format(validator, fmt, instance, schema) -> Iterator[jsonschema.ValidationError]:
    low_high = _INT_RANGES.get(fmt)
    if low_high and isinstance(instance, int) and not isinstance(instance, bool):
        low, high = low_high
        if not low <= instance <= high:
            yield jsonschema.ValidationError(f"{instance} is out of the {fmt} range")


_CrdValidator = jsonschema.validators.extend(
    jsonschema.Draft4Validator,
    {
        "x-kubernetes-list-type": _list_type,
        "x-kubernetes-validations": _cel_rules,
        "format": _int_format,
    },
)


@lru_cache(maxsize=None)
def _crd_validator(kind: str, version: str):
    return _CrdValidator(crd_schema(kind, version))


def crd_errors(obj: dict[str, Any]) -> list[str]:
    """Every schema violation of a RayService / RayJob / RayCluster, as readable strings."""
    group, _, version = obj["apiVersion"].partition("/")
    if group != "ray.io":
        raise ValueError(f"{obj['apiVersion']} is not a KubeRay apiVersion")
    validator = _crd_validator(obj["kind"], version)
    errors = [
        f"{'/'.join(str(p) for p in err.absolute_path) or '<root>'}: {err.message}"
        for err in validator.iter_errors(obj)
    ]
    return errors + check_object_meta(obj)


def check_object_meta(obj: dict[str, Any]) -> list[str]:
    """ObjectMeta rules the API server applies to every object: name, labels, annotations."""
    meta = obj.get("metadata") or {}
    errors = []
    name = meta.get("name", "")
    if not (name and len(name) <= 253 and _DNS_SUBDOMAIN.match(name)):
        errors.append(f"metadata.name {name!r} is not a DNS-1123 subdomain")
    for key, value in (meta.get("labels") or {}).items():
        prefix, _, label = key.rpartition("/")
        if prefix and not _DNS_SUBDOMAIN.match(prefix):
            errors.append(f"label key {key!r}: bad prefix")
        if not (label and len(label) <= 63 and _LABEL_NAME.match(label)):
            errors.append(f"label key {key!r}: bad name")
        if not (isinstance(value, str) and len(value) <= 63 and _LABEL_VALUE.match(value)):
            errors.append(f"label {key}={value!r}: bad value")
    for key, value in (meta.get("annotations") or {}).items():
        if not isinstance(value, str):
            errors.append(f"annotation {key}: value {value!r} is not a string")
    return errors


def core_errors(obj: dict[str, Any], kube_version: str = KUBE_VERSION) -> list[str]:
    """Validate a core Kubernetes object (strict: unknown fields are errors)."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, kube_version, strict=True)
    except kubernetes_validate.ValidationError as err:
        path = "/".join(str(p) for p in err.absolute_path) or "<root>"
        return [f"{path}: {err.message}"]
    return check_object_meta(obj)


def pod_templates(obj: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, pod template) for the head and every worker group of a KubeRay object."""
    spec = obj["spec"]
    cluster = {
        "RayCluster": lambda: spec,
        "RayService": lambda: spec["rayClusterConfig"],
        "RayJob": lambda: spec.get("rayClusterSpec"),
    }[obj["kind"]]()
    if not cluster:
        return
    yield "head", cluster["headGroupSpec"]["template"]
    for group in cluster.get("workerGroupSpecs", []):
        yield f"worker group {group['groupName']}", group["template"]


def pod_template_errors(template: dict[str, Any], kube_version: str = KUBE_VERSION) -> list[str]:
    """A Ray pod template, checked as a core v1 PodTemplate (the kubelet's view of the pod)."""
    wrapped = {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": "ray-pod-template"},
        "template": template,
    }
    return core_errors(wrapped, kube_version)
