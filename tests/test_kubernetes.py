"""The Kubernetes manifests: generated from one table, valid against the Kubernetes API's
schemas (``kubernetes-validate``, no cluster needed), naming only settings the code reads, and
probing endpoints the services serve."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tools.kubernetes_manifests import SERVICES, render

from .test_compose import env_names_read_by_code

ROOT = Path(__file__).parents[1]
K8S = ROOT / "deploy" / "kubernetes"
DOCS = [(p.name, d) for p in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text())]


def test_the_shipped_manifests_are_generated():
    assert (K8S / "freshrec.yaml").read_text() == render(), (
        "run `python -m tools.kubernetes_manifests` and commit the result"
    )


@pytest.mark.parametrize("name, doc", DOCS, ids=[f"{n}:{d['kind']}" for n, d in DOCS])
def test_every_manifest_is_valid_for_the_kubernetes_api(name, doc):
    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_each_service_has_a_deployment_with_probes_resources_and_a_disruption_budget():
    kinds = {(d["kind"], d["metadata"]["name"]) for _, d in DOCS}
    for service, *_ in SERVICES:
        assert ("Deployment", f"freshrec-{service}") in kinds
        assert ("PodDisruptionBudget", f"freshrec-{service}") in kinds
    for _, d in DOCS:
        if d["kind"] != "Deployment":
            continue
        (c,) = d["spec"]["template"]["spec"]["containers"]
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert {"cpu", "memory"} <= set(c["resources"]["requests"])
        refs = {next(iter(r.values()))["name"] for r in c["envFrom"]}
        assert refs == {"freshrec-settings", "freshrec-credentials"}


def test_the_gpu_pool_asks_for_a_gpu_on_gpu_nodes_and_joins_the_workers_group():
    deployments = {d["metadata"]["name"]: d for _, d in DOCS if d["kind"] == "Deployment"}
    gpu, cpu = deployments["freshrec-worker-gpu"], deployments["freshrec-worker"]
    (c,) = gpu["spec"]["template"]["spec"]["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["args"] == ["worker"]
    assert {"name": "FRESHREC_DEVICE", "value": "cuda"} in c["env"]
    pod = gpu["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    (cpu_c,) = cpu["spec"]["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in cpu_c["resources"]["limits"]
    # one consumer group: both read FRESHREC_TOPIC_PREFIX from the same ConfigMap, and no
    # setting of either names a group of its own
    assert c["envFrom"] == cpu_c["envFrom"]


def test_settings_and_credentials_are_ones_the_code_reads_with_no_default_secret():
    read = env_names_read_by_code()
    config = next(d for _, d in DOCS if d["kind"] == "ConfigMap")
    secret = next(d for _, d in DOCS if d["kind"] == "Secret")
    assert not set(config["data"]) - read, set(config["data"]) - read
    assert not set(secret["stringData"]) - read
    assert set(secret["stringData"].values()) == {""}  # no password ships
    assert config["data"]["FRESHREC_METRICS_HOST"] == "0.0.0.0"  # the kubelet probes the pod IP
