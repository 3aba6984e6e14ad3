"""Generates the Kubernetes manifests of FreshRec's three services
(``deploy/kubernetes/freshrec.yaml``) from one table, so that the three Deployments and their
PodDisruptionBudgets cannot drift apart. ``configmap.yaml`` and ``secret.example.yaml`` beside
it are written by hand (they are yours to edit).

    .venv/bin/python -m tools.kubernetes_manifests      # rewrites deploy/kubernetes/freshrec.yaml

Every Deployment takes its settings from the ``freshrec-settings`` ConfigMap, Redis's URL from
the ``freshrec-credentials`` Secret and its Kafka user from the Secret of the principal its
command logs in as (``freshrec-kafka-worker``...: ``freshrec.acls.DEPLOYED_AS``, the user
``freshrec topics create --acls`` grants that service's ACLs to), answers ``/readyz`` (it owns partitions and reaches Redis) and
``/healthz`` (its loop goes round) on the metrics port, and has resource requests from the
figures to start from (sizing and scaling: ``docs/operations.md``, "Kubernetes").
"""

from __future__ import annotations

from pathlib import Path

import yaml

from freshrec.acls import DEPLOYED_AS

OUT = Path(__file__).parents[1] / "deploy" / "kubernetes" / "freshrec.yaml"
IMAGE = "freshrec:latest"  # built from the repository's Dockerfile; push it where you pull from
PORT = 9100

# name, replicas, requests (cpu, memory), memory limit: a start, to be sized from your own
# consumer lag and memory (docs/operations.md, "Kubernetes")
SERVICES = (
    ("streams", 2, ("1", "1Gi"), "2Gi"),
    ("param-server", 2, ("1", "1Gi"), "4Gi"),
    ("worker", 2, ("2", "2Gi"), "6Gi"),
    # workers on a GPU node pool (docs/operations.md, "GPUs"): the same consumer group as the
    # CPU workers, so scaling this up moves request and event partitions to GPUs; 0 replicas
    # until a cluster has GPU nodes (the NVIDIA device plugin advertises nvidia.com/gpu)
    ("worker-gpu", 0, ("2", "4Gi"), "12Gi"),
)
GPU_POOL_LABEL = "nvidia.com/gpu.present"
"""The node label GPU feature discovery (NVIDIA's GPU operator) puts on GPU nodes."""


def kafka_secret(principal: str) -> str:
    """The Secret holding a principal's ``KAFKA_SASL_USERNAME`` and ``KAFKA_SASL_PASSWORD``."""
    return f"freshrec-kafka-{principal}"


def deployment(name: str, replicas: int, requests: tuple[str, str], limit: str):
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "freshrec"}
    command = "worker" if name.startswith("worker") else name
    gpu = name == "worker-gpu"
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": f"freshrec-{name}", "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(PORT),
                    },
                },
                "spec": {
                    # leaving a consumer group cleanly (SIGTERM) takes a commit and a flush
                    "terminationGracePeriodSeconds": 60,
                    "securityContext": {"runAsUser": 1000, "fsGroup": 1000},
                    "containers": [container(name, command, gpu, requests, limit)],
                    "volumes": volumes(command),
                    **(gpu_placement() if gpu else {}),
                },
            },
        },
    }


def container(name: str, command: str, gpu: bool, requests: tuple[str, str], limit: str):
    """The one container of a service's pods: its settings, probes, resources and mounts."""
    probe = {"httpGet": {"path": "/healthz", "port": "metrics"}, "periodSeconds": 10}
    out = {
        "name": name,
        "image": IMAGE,
        "args": [command],
        "workingDir": "/tmp",  # an emptyDir: the streams app keeps its table files here
        "envFrom": [
            {"configMapRef": {"name": "freshrec-settings"}},
            {"secretRef": {"name": "freshrec-credentials"}},
            # its own Kafka user: every service a principal of its own, with its own ACLs
            {"secretRef": {"name": kafka_secret(DEPLOYED_AS[command])}},
        ],
        "env": [
            {
                "name": "FRESHREC_WORKER_ID",
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
            }
        ]
        + ([{"name": "FRESHREC_DEVICE", "value": "cuda"}] if gpu else [])
        if command == "worker"
        else [],
        "ports": [{"name": "metrics", "containerPort": PORT}],
        # ready once it owns partitions and reaches Redis: a consumer-group rebalance moves
        # partitions between pods, so a pod without any is alive but not serving
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": "metrics"},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        "livenessProbe": {**probe, "failureThreshold": 3},
        # starting takes a group join (and, for a worker, loading the models and rows)
        "startupProbe": {**probe, "periodSeconds": 5, "failureThreshold": 36},
        "resources": {
            "requests": {"cpu": requests[0], "memory": requests[1]},
            # a GPU is requested by its limit (extended resources are not overcommitted);
            # time-slicing or MPS on the node lets several pods share one (operations.md)
            "limits": {"memory": limit, **({"nvidia.com/gpu": 1} if gpu else {})},
        },
        "securityContext": {
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    if command == "worker":
        out["volumeMounts"].append({"name": "models", "mountPath": "/models", "readOnly": True})
    return out


def volumes(command: str) -> list[dict]:
    """Scratch space for every service; the trained models, read-only, for workers."""
    out = [{"name": "tmp", "emptyDir": {}}]
    if command == "worker":
        out.append({"name": "models", "persistentVolumeClaim": {"claimName": "freshrec-models"}})
    return out


def gpu_placement() -> dict:
    """A GPU worker's pods go to the GPU node pool, and tolerate its taint."""
    return {
        "nodeSelector": {GPU_POOL_LABEL: "true"},
        "tolerations": [
            {
                "key": "nvidia.com/gpu",
                "operator": "Exists",
                "effect": "NoSchedule",
            }
        ],
    }


def disruption_budget(name: str) -> dict:
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "freshrec"}
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": f"freshrec-{name}", "labels": labels},
        # one pod at a time: each eviction is a rebalance of the group
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels}},
    }


def models_claim() -> dict:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": "freshrec-models",
            "labels": {"app.kubernetes.io/part-of": "freshrec"},
        },
        # written by `freshrec train --out /models` (a Job of your own), read by every worker
        "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "2Gi"}}},
    }


def build() -> list[dict]:
    docs = [models_claim()]
    for name, replicas, requests, limit in SERVICES:
        docs += [deployment(name, replicas, requests, limit), disruption_budget(name)]
    return docs


def render() -> str:
    head = "# Generated by `python -m tools.kubernetes_manifests`: edit that, not this file.\n"
    return head + yaml.safe_dump_all(build(), sort_keys=False, width=1000)


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    print(f"wrote {OUT}")
