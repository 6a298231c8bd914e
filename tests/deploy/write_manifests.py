"""Write manifests/ from the chart's defaults (release "keyserve"), so the plain manifests stay
exactly what the chart installs; test_manifests.py fails when they drift.

    .venv/bin/python tests/deploy/write_manifests.py
"""

from __future__ import annotations

import re

from chart_render import MANIFESTS_DIR, render

RAYSERVICE_HEADER = """\
# keyserve as a KubeRay RayService, for clusters without Helm: the Helm chart's defaults
# (helm/keyserve, release name "keyserve") written out by tests/deploy/write_manifests.py.
# A CPU-only Ray cluster (one head, one worker) serves SmolLM2-135M-Instruct through Ray
# Serve's OpenAI-compatible HTTP API on port 8000.
#
#   kubectl apply -f manifests/rayservice.yaml
#   kubectl get rayservice keyserve -w
#   kubectl port-forward svc/keyserve-serve-svc 8000:8000
#
# Needs the KubeRay operator and the image built from the repo's Dockerfile
# (`docker build -t keyserve:0.1.0-cpu .`, pushed to or loaded into your cluster).
#
# To require an API key, create a Secret and add this env entry to every Ray container
# (head and workers); the server then answers 401 without `Authorization: Bearer <key>`:
#   kubectl create secret generic keyserve-api-key --from-literal=api-key="$(openssl rand -hex 16)"
#                 - name: KEYSERVE_API_KEY
#                   valueFrom:
#                     secretKeyRef:
#                       name: keyserve-api-key
#                       key: api-key
# For GPUs, use the chart (ci/single-gpu.yaml, ci/tp4-gpu.yaml) or add `nvidia.com/gpu: 1` to
# the worker's requests and limits and use the image tag `0.1.0-cuda` (the replica runs the Ray
# engine's front; its target shard actors reserve the GPUs).
"""

RAYJOB_HEADER = """\
# A one-off batch run as a KubeRay RayJob, for clusters without Helm: the Helm chart with
# `batchJob.enabled=true, serve.enabled=false` written out by tests/deploy/write_manifests.py.
# KubeRay creates a Ray cluster, runs `python -m keyserve.cluster.batch_job` on its head over
# /data/in.jsonl (OpenAI batch format) and writes one result line per input line to
# /data/out.jsonl; the cluster is deleted ten minutes after the job ends. A rerun skips ids
# already in the output.
#
#   kubectl apply -f manifests/rayjob.yaml
#   kubectl get rayjob keyserve-batch -w
#
# The input and output live on the PersistentVolumeClaim `keyserve-batch-data`, which must
# exist (and hold in.jsonl) before the job starts.
"""

RAYCLUSTER_HEADER = """\
# A long-lived Ray cluster with keyserve installed, for clusters without Helm: the same head
# and worker groups as manifests/rayservice.yaml (written out by tests/deploy/write_manifests.py),
# without the Serve application, for `ray job submit` and `serve deploy` by hand:
#
#   kubectl apply -f manifests/raycluster.yaml
#   HEAD=$(kubectl get pod -l ray.io/cluster=keyserve-cluster,ray.io/node-type=head -o name)
#   kubectl cp in.jsonl "${HEAD#pod/}":/tmp/in.jsonl
#   kubectl port-forward svc/keyserve-cluster-head-svc 8265:8265 8000:8000 &
#   ray job submit --address http://localhost:8265 -- \\
#     python -m keyserve.cluster.batch_job --input /tmp/in.jsonl --output /tmp/out.jsonl
#   kubectl cp "${HEAD#pod/}":/tmp/out.jsonl out.jsonl
#   serve deploy --address http://localhost:8265 serve-config.yaml  # serveConfigV2 of rayservice.yaml
#
# The head declares the `serve` port (8000), so `serve deploy` answers on the head service.
"""


def plain(text: str) -> str:
    """A rendered object without Helm's own labels, with simple map keys unquoted."""
    text = text.lstrip("\n")
    text = re.sub(r"\n    (helm\.sh/chart|app\.kubernetes\.io/managed-by): .*", "", text)
    return re.sub(r'^( +)"([a-z][a-z-]*)": ', r"\1\2: ", text, flags=re.M)


def raycluster_from(rayservice: str) -> str:
    """The RayService's rayClusterConfig as a standalone RayCluster named keyserve-cluster."""
    lines = rayservice.splitlines()
    start = lines.index("  rayClusterConfig:")
    spec = "\n".join(line[2:] for line in lines[start + 1:])
    spec = spec.replace("component: serve-head", "component: cluster-head")
    spec = spec.replace("component: serve-worker", "component: cluster-worker")
    meta = rayservice[rayservice.index("metadata:"):rayservice.index("\nspec:") + 1]
    meta = meta.replace("  name: keyserve\n", "  name: keyserve-cluster\n", 1)
    meta = meta.replace("component: serve\n", "component: cluster\n")
    return f"apiVersion: ray.io/v1\nkind: RayCluster\n{meta}spec:\n{spec}\n"


def manifests() -> dict[str, str]:
    """File name -> text of every plain manifest."""
    service = plain(render({})["keyserve/templates/rayservice.yaml"])
    batch_values = {"serve": {"enabled": False}, "batchJob": {"enabled": True}}
    job = plain(render(batch_values)["keyserve/templates/rayjob.yaml"])
    return {
        "rayservice.yaml": RAYSERVICE_HEADER + service,
        "rayjob.yaml": RAYJOB_HEADER + job,
        "raycluster.yaml": RAYCLUSTER_HEADER + raycluster_from(service),
    }


if __name__ == "__main__":
    for name, text in manifests().items():
        (MANIFESTS_DIR / name).write_text(text)
        print(f"wrote manifests/{name}")
