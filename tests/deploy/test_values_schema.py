"""Bad values fail `helm install` / `helm template` before anything reaches the cluster, with a
message that names the key: values.schema.json for types and ranges, template checks for
rules that span keys."""

from __future__ import annotations

import pytest

from chart_render import CHART_DIR, VALUES_CASES, render, values_for

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's engine) is not installed")

# (case id, values, words the error must contain)
SCHEMA_ERRORS = [
    ("negative worker replicas", {"worker": {"replicas": -1}}, ["/worker/replicas", "minimum: got -1, want 0"]),
    ("negative serve replicas", {"serve": {"numReplicas": -2}}, ["/serve/numReplicas", "minimum"]),
    ("negative extra group replicas", {"additionalWorkerGroups": {"g": {"replicas": -1}}},
     ["/additionalWorkerGroups/g/replicas", "minimum"]),
    ("tp zero", {"model": {"tensorParallelSize": 0}}, ["/model/tensorParallelSize", "minimum: got 0, want 1"]),
    ("tp fractional", {"model": {"tensorParallelSize": 2.5}}, ["/model/tensorParallelSize", "want integer"]),
    ("tp a string", {"model": {"tensorParallelSize": "4"}}, ["/model/tensorParallelSize", "want integer"]),
    ("tp negative", {"model": {"tensorParallelSize": -4}}, ["/model/tensorParallelSize", "minimum"]),
    ("gpu group without a gpu count",
     {"additionalWorkerGroups": {"gpu": {"accelerator": "nvidia", "replicas": 1}}},
     ["/additionalWorkerGroups/gpu", "missing property 'gpusPerPod'"]),
    ("gpu group with zero gpus",
     {"additionalWorkerGroups": {"gpu": {"accelerator": "nvidia", "replicas": 1, "gpusPerPod": 0}}},
     ["/additionalWorkerGroups/gpu/gpusPerPod", "minimum"]),
    ("unknown accelerator", {"worker": {"accelerator": "tpu"}}, ["/worker/accelerator", "value must be one of 'cpu', 'nvidia'"]),
    ("unknown kv policy", {"kv": {"defaultPolicy": "lru"}}, ["/kv/defaultPolicy", "value must be one of 'full', 'window'"]),
    ("non-positive kv budget", {"kv": {"defaultBudget": 0}}, ["/kv/defaultBudget"]),
    ("unknown dtype", {"model": {"dtype": "int4"}}, ["/model/dtype"]),
    ("too many speculative tokens", {"model": {"numSpeculativeTokens": 64}}, ["/model/numSpeculativeTokens", "maximum"]),
    ("api key to create but empty", {"apiKey": {"create": True}}, ["/apiKey/value", "minLength"]),
    ("misspelt top-level key", {"wokrer": {"replicas": 1}}, ["additional properties 'wokrer' not allowed"]),
    ("misspelt worker key", {"worker": {"replica": 1}}, ["/worker", "'replica' not allowed"]),
    ("bad group name", {"additionalWorkerGroups": {"GPU_Group": {"replicas": 1}}}, ["invalid propertyName 'GPU_Group'", "does not match pattern"]),
    ("port out of range", {"serve": {"port": 70000}}, ["/serve/port", "maximum"]),
    ("serve port taken by the ray head", {"serve": {"port": 8265}}, ["/serve/port"]),
    ("tp above what build_app takes", {"model": {"tensorParallelSize": 100}}, ["/model/tensorParallelSize", "maximum"]),
    ("pdb minAvailable not a count or a percentage", {"podDisruptionBudget": {"minAvailable": "abc"}},
     ["/podDisruptionBudget/minAvailable"]),
    ("relative batch input", {"batchJob": {"enabled": True, "input": "in.jsonl"}}, ["/batchJob/input"]),
    ("batch job without a claim", {"batchJob": {"enabled": True, "data": {"existingClaim": ""}}},
     ["/batchJob/data/existingClaim"]),
    # Label and annotation maps: Kubernetes would refuse what they render. (Helm names a bad
    # key itself, not its map: its schema library reports propertyNames at the root.)
    ("label key with a space", {"commonLabels": {"my team": "a"}}, ["invalid propertyName 'my team'"]),
    ("label key with two slashes", {"head": {"labels": {"a/b/c": "x"}}}, ["invalid propertyName 'a/b/c'"]),
    ("label value too long", {"worker": {"labels": {"team": "x" * 64}}}, ["/worker/labels/team", "maxLength"]),
    ("label value with a slash", {"commonLabels": {"team": "a/b"}}, ["/commonLabels/team", "does not match pattern"]),
    ("node selector key with a colon", {"worker": {"nodeSelector": {"gpu:type": "a100"}}},
     ["invalid propertyName 'gpu:type'"]),
    ("annotation key with a space", {"serviceMonitor": {"enabled": True, "labels": {"release": "x"}},
                                     "head": {"annotations": {"bad key": "v"}}}, ["invalid propertyName 'bad key'"]),
]

# Rules that span keys: checked by the templates.
TEMPLATE_ERRORS = [
    ("gpus not a multiple of tp",
     {"model": {"tensorParallelSize": 2}, "worker": {"accelerator": "nvidia", "gpusPerPod": 3}},
     ["worker.gpusPerPod (3) must be a multiple of model.tensorParallelSize (2)"]),
    ("gpu count on a cpu group", {"worker": {"gpusPerPod": 2}},
     ['worker group "workers" sets gpusPerPod (2) but its accelerator is "cpu"']),
    ("replicas above max", {"worker": {"replicas": 3, "minReplicas": 1, "maxReplicas": 2}},
     ['worker group "workers": replicas (3) must lie between minReplicas (1) and maxReplicas (2)']),
    ("autoscaling min above max", {"serve": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
     ["serve.autoscaling.minReplicas (5) must not exceed serve.autoscaling.maxReplicas (2)"]),
    ("api key in serveConfigV2", {"serve": {"extraArgs": {"api_key": "sk-secret"}}},
     ["serve.extraArgs.api_key is not allowed: set apiKey instead"]),
    ("deployment name in extraArgs", {"serve": {"extraArgs": {"deployment_name": "Other"}}},
     ["serve.extraArgs.deployment_name is not allowed: set serve.deploymentName instead"]),
    ("gpu batch driver without the data on workers", {"batchJob": {"enabled": True, "entrypointNumGpus": 1}},
     ["batchJob.entrypointNumGpus puts the job's driver on a GPU worker", "mountOnWorkers=true"]),
]


@pytest.mark.parametrize(("values", "words"), [c[1:] for c in SCHEMA_ERRORS], ids=[c[0] for c in SCHEMA_ERRORS])
def test_schema_rejects_bad_values(values, words):
    with pytest.raises(helm.HelmValuesError) as caught:
        render(values)
    message = str(caught.value)
    assert "values don't meet the specifications of the schema" in message
    for word in words:
        assert word in message, message


@pytest.mark.parametrize(("values", "words"), [c[1:] for c in TEMPLATE_ERRORS], ids=[c[0] for c in TEMPLATE_ERRORS])
def test_templates_reject_inconsistent_values(values, words):
    with pytest.raises(helm.HelmRenderError) as caught:
        render(values)
    for word in words:
        assert word in str(caught.value), str(caught.value)


@pytest.mark.parametrize(("values", "words"), [c[1:] for c in SCHEMA_ERRORS], ids=[c[0] for c in SCHEMA_ERRORS])
def test_lint_reports_bad_values(values, words):
    report = helm.lint(CHART_DIR, values)
    assert report["errors"] or any(m["severity"] == 3 for m in report["messages"]), report


@pytest.mark.parametrize("case", VALUES_CASES)
def test_good_values_pass_the_schema(case):
    with helm.Chart.load(CHART_DIR) as chart:
        chart.validate_schema(chart.merge_values(values_for(case)))
