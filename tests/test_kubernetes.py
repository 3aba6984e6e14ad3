"""The Kubernetes manifests: generated from one table, valid against the Kubernetes API's
schemas (``kubernetes-validate``, no cluster needed), naming only settings the code reads, and
probing endpoints the services serve."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from freshrec.acls import DEPLOYED_AS, service_acls
from tools.kubernetes_manifests import SERVICES, kafka_secret, render

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
        principal = DEPLOYED_AS[c["args"][0]]
        assert refs == {"freshrec-settings", "freshrec-credentials", kafka_secret(principal)}


def test_each_service_logs_in_to_kafka_as_the_principal_its_acls_are_granted_to():
    """The Secret a Deployment reads its Kafka user from names the principal its command
    runs as (``freshrec.acls.DEPLOYED_AS``, as in docker-compose), one the ACLs are written
    for; the Secret shows it, and holds that user's password only."""
    secrets = {d["metadata"]["name"]: d["stringData"] for _, d in DOCS if d["kind"] == "Secret"}
    for _, d in DOCS:
        if d["kind"] != "Deployment":
            continue
        (c,) = d["spec"]["template"]["spec"]["containers"]
        principal = DEPLOYED_AS[c["args"][0]]
        assert principal in service_acls("")
        assert secrets[kafka_secret(principal)] == {
            "KAFKA_SASL_USERNAME": principal,
            "KAFKA_SASL_PASSWORD": "",
        }
    assert "KAFKA_SASL_PASSWORD" not in secrets["freshrec-credentials"]


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
    assert not set(config["data"]) - read, set(config["data"]) - read
    for _, secret in DOCS:
        if secret["kind"] == "Secret":
            assert not set(secret["stringData"]) - read
            secrets = {k: v for k, v in secret["stringData"].items() if k != "KAFKA_SASL_USERNAME"}
            assert set(secrets.values()) == {""}  # no password ships
    assert config["data"]["FRESHREC_METRICS_HOST"] == "0.0.0.0"  # the kubelet probes the pod IP
