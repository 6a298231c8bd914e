"""The chart renders with Helm's engine for its defaults and every ci/ values file, lints
clean, and wires what the values say: GPU sizing, the API key Secret, the cache volume,
monitoring and disruption budgets."""

from __future__ import annotations

import pytest
import yaml

from chart_render import CHART_DIR, VALUES_CASES, by_kind, one, render, render_objects, values_for

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's engine) is not installed")

EXPECTED_KINDS = {
    "defaults": {"RayService"},
    "cpu-only.yaml": {"RayService", "Secret", "ServiceMonitor", "PodDisruptionBudget"},
    "single-gpu.yaml": {"RayService", "ServiceMonitor"},
    "tp4-gpu.yaml": {"RayService", "ServiceMonitor", "PodDisruptionBudget"},
    "batch-job-only.yaml": {"RayJob"},
}


def ray_objects(objects):
    return [obj for obj in objects if obj["kind"] in ("RayService", "RayJob")]


def cluster_spec(obj):
    return obj["spec"]["rayClusterConfig"] if obj["kind"] == "RayService" else obj["spec"]["rayClusterSpec"]


def containers(obj):
    spec = cluster_spec(obj)
    yield spec["headGroupSpec"]["template"], spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    for group in spec.get("workerGroupSpecs", []):
        yield group["template"], group["template"]["spec"]["containers"][0]


def test_every_ci_file_is_covered():
    assert set(VALUES_CASES) == set(EXPECTED_KINDS), "add the new ci/ file to EXPECTED_KINDS"
    assert {"cpu-only.yaml", "single-gpu.yaml", "tp4-gpu.yaml", "batch-job-only.yaml"} <= set(VALUES_CASES)


@pytest.mark.parametrize("case", VALUES_CASES)
def test_lint_is_clean(case):
    report = helm.lint(CHART_DIR, values_for(case), strict=True)
    assert report["errors"] == [] and report["messages"] == [], report


@pytest.mark.parametrize("case", VALUES_CASES)
def test_renders_the_expected_objects(case, rendered_cases):
    objects = rendered_cases[case]
    assert {obj["kind"] for obj in objects} == EXPECTED_KINDS[case]
    for obj in objects:
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "keyserve"
        assert labels["app.kubernetes.io/instance"] == "keyserve"
        assert labels["helm.sh/chart"] == "keyserve-0.1.0"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"


@pytest.mark.parametrize("case", VALUES_CASES)
def test_head_never_has_gpus(case, rendered_cases):
    for obj in ray_objects(rendered_cases[case]):
        head = cluster_spec(obj)["headGroupSpec"]
        assert head["rayStartParams"]["num-gpus"] == "0"
        resources = head["template"]["spec"]["containers"][0].get("resources", {})
        for part in resources.values():
            assert "nvidia.com/gpu" not in part


@pytest.mark.parametrize(
    ("case", "group", "gpus"),
    [("defaults", "workers", 0), ("cpu-only.yaml", "workers", 0), ("batch-job-only.yaml", "workers", 0),
     ("single-gpu.yaml", "workers", 1), ("tp4-gpu.yaml", "gpu-tp4", 4), ("tp4-gpu.yaml", "draft-gpu", 1)],
)
def test_worker_groups_are_sized_from_values(case, group, gpus, rendered_cases):
    (obj,) = ray_objects(rendered_cases[case])
    groups = {g["groupName"]: g for g in cluster_spec(obj)["workerGroupSpecs"]}
    spec = groups[group]
    assert spec["rayStartParams"]["num-gpus"] == str(gpus)
    pod = spec["template"]["spec"]
    resources = pod["containers"][0]["resources"]
    if gpus:
        assert resources["limits"]["nvidia.com/gpu"] == gpus
        assert resources["requests"]["nvidia.com/gpu"] == gpus
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    else:
        assert "nvidia.com/gpu" not in resources["limits"] and "tolerations" not in pod
    assert spec["minReplicas"] <= spec["replicas"] <= spec["maxReplicas"]


def test_main_gpu_group_follows_the_tensor_parallel_size():
    for tp in (1, 2, 8):
        values = {"model": {"tensorParallelSize": tp}, "worker": {"accelerator": "nvidia"}}
        service = one(render_objects(values), "RayService")
        worker = service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
        assert worker["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == tp
        assert yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]["tp"] == tp
    values = {"model": {"tensorParallelSize": 2}, "worker": {"accelerator": "nvidia", "gpusPerPod": 8}}
    worker = one(render_objects(values), "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert worker["rayStartParams"]["num-gpus"] == "8"


def test_node_selectors_merge_group_over_gpu_defaults():
    values = {
        "gpu": {"nodeSelector": {"pool": "gpu", "zone": "a"}},
        "worker": {"accelerator": "nvidia", "nodeSelector": {"zone": "b"}},
        "additionalWorkerGroups": {"cpu-extra": {"replicas": 1, "nodeSelector": {"pool": "cpu"}}},
    }
    service = one(render_objects(values), "RayService")
    groups = {g["groupName"]: g for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert groups["workers"]["template"]["spec"]["nodeSelector"] == {"pool": "gpu", "zone": "b"}
    assert groups["cpu-extra"]["template"]["spec"]["nodeSelector"] == {"pool": "cpu"}


@pytest.mark.parametrize("case", VALUES_CASES)
def test_image_variant_follows_the_hardware(case, rendered_cases):
    objects = rendered_cases[case]
    gpu = case in ("single-gpu.yaml", "tp4-gpu.yaml")
    for obj in ray_objects(objects):
        for _, container in containers(obj):
            assert container["image"] == ("keyserve:0.1.0-cuda" if gpu else "keyserve:0.1.0-cpu")


@pytest.mark.parametrize("case", VALUES_CASES)
def test_every_ray_container_mounts_the_model_cache(case, rendered_cases):
    for obj in ray_objects(rendered_cases[case]):
        for template, container in containers(obj):
            env = {e["name"]: e for e in container["env"]}
            cache = env["KEYSERVE_CACHE_DIR"]["value"]
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            volumes = {v["name"]: v for v in template["spec"]["volumes"]}
            assert mounts[cache] in volumes
            assert mounts["/dev/shm"] in volumes and volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


@pytest.mark.parametrize(
    ("case", "secret"),
    [("cpu-only.yaml", "keyserve-api-key"), ("single-gpu.yaml", "keyserve-api-key"),
     ("tp4-gpu.yaml", "keyserve-api-key"), ("defaults", None), ("batch-job-only.yaml", None)],
)
def test_api_key_comes_from_a_secret(case, secret, rendered_cases):
    objects = rendered_cases[case]
    for obj in ray_objects(objects):
        for _, container in containers(obj):
            env = {e["name"]: e for e in container["env"]}
            if secret is None:
                assert "KEYSERVE_API_KEY" not in env
                continue
            ref = env["KEYSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": secret, "key": "api-key"}
        if obj["kind"] == "RayService":
            assert "api_key" not in yaml.safe_load(obj["spec"]["serveConfigV2"])["applications"][0]["args"]
    created = by_kind(objects, "Secret")
    if case == "cpu-only.yaml":
        assert created[0]["metadata"]["name"] == secret and "api-key" in created[0]["data"]
    else:
        assert created == []


def test_created_secret_holds_the_key_base64():
    values = {"apiKey": {"create": True, "value": "s3cret"}}
    secret = one(render_objects(values), "Secret")
    assert secret["data"] == {"api-key": "czNjcmV0"}


def test_servicemonitor_selects_the_serve_service(rendered_cases):
    objects = rendered_cases["cpu-only.yaml"]
    monitor = one(objects, "ServiceMonitor")
    serve_service = one(objects, "RayService")["spec"]["serveService"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= serve_service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in serve_service["spec"]["ports"]}
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["keyserve"]}


@pytest.mark.parametrize("case", ["cpu-only.yaml", "tp4-gpu.yaml"])
def test_pdb_selects_serving_workers_only(case, rendered_cases):
    objects = rendered_cases[case]
    selector = one(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items()
    service = one(objects, "RayService")
    spec = service["spec"]["rayClusterConfig"]
    assert not selector <= spec["headGroupSpec"]["template"]["metadata"]["labels"].items()
    for group in spec["workerGroupSpecs"]:
        assert selector <= group["template"]["metadata"]["labels"].items()


def test_serve_port_is_declared_on_the_head(rendered_cases):
    service = one(rendered_cases["defaults"], "RayService")
    ports = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]
    assert {"name": "serve", "containerPort": 8000} in ports
    assert service["spec"]["serveService"]["spec"]["ports"] == [{"name": "serve", "port": 8000, "targetPort": 8000}]


def test_batch_job_runs_on_its_own_cluster_and_mounts_the_data(rendered_cases):
    job = one(rendered_cases["batch-job-only.yaml"], "RayJob")
    spec = job["spec"]
    assert spec["entrypoint"].startswith("python -m keyserve.cluster.batch_job ")
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] == 600
    head = spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in head["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {"batch-data": "keyserve-batch-data"}
    assert {"name": "batch-data", "mountPath": "/data"} in head["containers"][0]["volumeMounts"]


def test_gpu_batch_driver_runs_on_a_worker_that_sees_the_data():
    values = {"serve": {"enabled": False}, "worker": {"accelerator": "nvidia"},
              "batchJob": {"enabled": True, "entrypointNumGpus": 1, "entrypointNumCpus": 4,
                           "data": {"mountOnWorkers": True}}}
    spec = one(render_objects(values), "RayJob")["spec"]
    assert spec["entrypointNumGpus"] == 1 and spec["entrypointNumCpus"] == 4
    for template in [spec["rayClusterSpec"]["headGroupSpec"]["template"]] + [
            g["template"] for g in spec["rayClusterSpec"]["workerGroupSpecs"]]:
        assert {"name": "batch-data", "mountPath": "/data"} in template["spec"]["containers"][0]["volumeMounts"]


def test_cpu_batch_driver_stays_on_the_head(rendered_cases):
    spec = one(rendered_cases["batch-job-only.yaml"], "RayJob")["spec"]
    assert "entrypointNumGpus" not in spec and "entrypointNumCpus" not in spec
    for group in spec["rayClusterSpec"]["workerGroupSpecs"]:
        mounts = group["template"]["spec"]["containers"][0]["volumeMounts"]
        assert all(m["name"] != "batch-data" for m in mounts)


def test_additional_worker_groups_can_be_disabled():
    values = {"additionalWorkerGroups": {"on": {"replicas": 1}, "off": {"replicas": 1, "disabled": True}}}
    service = one(render_objects(values), "RayService")
    names = [g["groupName"] for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]]
    assert names == ["workers", "on"]


def test_worker_group_can_be_turned_off_entirely():
    service = one(render_objects({"worker": {"enabled": False}}), "RayService")
    assert "workerGroupSpecs" not in service["spec"]["rayClusterConfig"]


@pytest.mark.parametrize(
    ("values", "release", "name"),
    [({}, "prod", "prod-keyserve"), ({}, "keyserve-prod", "keyserve-prod"),
     ({"nameOverride": "llm"}, "prod", "prod-llm"), ({"fullnameOverride": "chat"}, "prod", "chat")],
)
def test_name_overrides(values, release, name):
    objects = render_objects({**values, "apiKey": {"create": True, "value": "k"}}, release=release)
    assert one(objects, "RayService")["metadata"]["name"] == name
    assert one(objects, "Secret")["metadata"]["name"] == f"{name}-api-key"
    if "nameOverride" in values:
        assert one(objects, "RayService")["metadata"]["labels"]["app.kubernetes.io/name"] == "llm"


def test_notes_tell_how_to_reach_the_server():
    notes = render({"apiKey": {"create": True, "value": "k"}})["keyserve/templates/NOTES.txt"]
    assert "kubectl port-forward -n keyserve svc/keyserve-serve-svc 8000:8000" in notes
    assert "curl -s localhost:8000/v1/completions" in notes
    assert "Authorization: Bearer $KEYSERVE_API_KEY" in notes
