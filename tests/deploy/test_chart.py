"""The Helm chart, rendered by Helm's Go SDK and validated against the Kubernetes schemas.

Each scenario renders the chart as ``helm template`` would (values schema, templates, hooks),
validates every manifest against the Kubernetes 1.30 OpenAPI schemas (strict: unknown fields
fail), and checks the facts that matter for running the tracker. The tracker settings the chart
writes (TOML file + environment) are loaded by the real settings model, so chart and tracker
cannot disagree on a setting's name.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

from tracker.settings import TrackerSettings
from tracker.settings_loading import load_settings

from .charts import (
    CHART,
    NAMESPACE,
    RELEASE,
    Rendered,
    container,
    env_of,
    pod_spec,
    render,
    user_app,
    validate_all,
)

pytestmark = pytest.mark.unit

FULLNAME = f"{RELEASE}-kmq-tracker"
PG_URL = "postgresql+asyncpg://kmq:pg-secret@postgres.db:5432/kmq"

POSTGRES_HA: dict[str, Any] = {
    "database": {"type": "postgres", "url": PG_URL},
    "replicaCount": 3,
    "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 8},
    "podDisruptionBudget": {"enabled": True, "minAvailable": 1},
    "metrics": {
        "serviceMonitor": {
            "enabled": True,
            "labels": {"release": "prometheus"},
            "useReadToken": True,
        }
    },
    "api": {"readToken": "read-only-token"},
    "networkPolicy": {
        "enabled": True,
        "ingress": {"from": [{"namespaceSelector": {"matchLabels": {"team": "ops"}}}]},
        "egress": {
            "enabled": True,
            "rules": [{"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}], "ports": [{"port": 9092}]}],
        },
    },
    "policies": {
        "topics": {
            "orders": {"max_attempts": 10, "dlq_topic": "orders.dead", "processing_timeout": "2m"}
        }
    },
}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KMQ_"):
            monkeypatch.delenv(name)


# -- checks shared by the scenarios -----------------------------------------------------------


def secret_values(rendered: Rendered, name: str) -> dict[str, str]:
    secret = rendered.one("Secret", name)
    return {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}


def resolve_env(
    rendered: Rendered, c: dict[str, Any], external: dict[str, dict[str, str]] | None = None
) -> dict[str, str]:
    """The container's environment as the kubelet would build it (secrets resolved)."""
    env: dict[str, str] = {}
    for item in c.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
            continue
        source = item["valueFrom"]
        if "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == "metadata.name"
            env[item["name"]] = "kmq-tracker-pod-0"
            continue
        ref = source["secretKeyRef"]
        if external and ref["name"] in external:
            data = external[ref["name"]]
        else:
            data = secret_values(rendered, ref["name"])
        if ref["key"] in data:
            env[item["name"]] = data[ref["key"]]
        else:
            assert ref.get("optional"), f"{item['name']}: key {ref['key']} missing in the Secret"
    return env


def load_tracker_settings(
    rendered: Rendered,
    c: dict[str, Any],
    configmap: str,
    *,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    external: dict[str, dict[str, str]] | None = None,
) -> TrackerSettings:
    """What the tracker in container ``c`` would load: its env and the ConfigMap's TOML."""
    env = resolve_env(rendered, c, external)
    assert env.pop("KMQ_CONFIG_FILE") == "/etc/kmq/config/kmq.toml"
    fields = TrackerSettings.model_fields
    unknown = [n for n in env if n.removeprefix("KMQ_").lower() not in fields]
    assert not unknown, f"environment variables that are no tracker setting: {unknown}"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    path = tmp_path / "kmq.toml"
    path.write_text(rendered.one("ConfigMap", configmap)["data"]["kmq.toml"])
    return load_settings(path)


def check_tracker_container(c: dict[str, Any], *, port: int = 8080) -> None:
    assert c["args"] == ["run"]
    assert c["ports"] == [{"name": "kmq-http", "containerPort": port, "protocol": "TCP"}]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "kmq-http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "kmq-http"}
    assert c["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "kmq-http"}
    check_security_context(c)
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["kmq-config"]["readOnly"] is True
    assert mounts["kmq-tmp"]["mountPath"] == "/tmp"
    assert c["resources"]["limits"]["memory"]


def check_security_context(c: dict[str, Any]) -> None:
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["runAsUser"] == 10001
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sc["seccompProfile"]["type"] == "RuntimeDefault"


def check_pod(spec: dict[str, Any]) -> None:
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["fsGroup"] == 10001
    assert spec["enableServiceLinks"] is False  # no KMQ_*-looking service variables
    assert spec["automountServiceAccountToken"] is False
    assert spec["terminationGracePeriodSeconds"] >= 40
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["kmq-config"]["configMap"]["name"] == FULLNAME


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# -- lint ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [{}, POSTGRES_HA], ids=["defaults", "postgres-ha"])
def test_helm_lint_is_clean(values: dict[str, Any]) -> None:
    report = helm.lint(CHART, values, strict=True, kube_version="v1.30.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [], report
    assert problems == [], report


# -- scenarios ------------------------------------------------------------------------------------


def test_defaults_sqlite_statefulset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rendered = render()
    validate_all(rendered)
    assert rendered.kinds() == [
        "ConfigMap",
        "ConfigMap",
        "PodDisruptionBudget",
        "Secret",
        "Service",
        "ServiceAccount",
        "StatefulSet",
    ]
    sts = rendered.one("StatefulSet")
    assert sts["spec"]["replicas"] == 1
    spec = pod_spec(sts)
    check_pod(spec)
    tracker = container(spec, "kmq-tracker")
    check_tracker_container(tracker)
    # SQLite: the migration runs in the pod, on the same volume, before the tracker starts.
    migrate = container(spec, "kmq-migrate", init=True)
    assert migrate["args"] == ["migrate"]
    check_security_context(migrate)
    [claim] = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "kmq-data"
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    for c in (tracker, migrate):
        assert {"name": "kmq-data", "mountPath": "/data"} in c["volumeMounts"]
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Retain"
    assert not rendered.of_kind("Job")
    # The API token is generated into the chart's Secret and reaches the tracker from there.
    assert len(secret_values(rendered, FULLNAME)["api-token"]) == 40
    assert env_of(tracker)["KMQ_API_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == FULLNAME
    # Service -> pods.
    service = rendered.one("Service")
    labels = spec_labels(sts)
    assert selects(service["spec"]["selector"], labels)
    assert service["spec"]["ports"][0]["targetPort"] == "kmq-http"
    assert selects(rendered.one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"], labels)
    assert spec["serviceAccountName"] == rendered.one("ServiceAccount")["metadata"]["name"]

    settings = load_tracker_settings(
        rendered, tracker, FULLNAME, tmp_path=tmp_path, monkeypatch=monkeypatch
    )
    assert settings.database_url == "sqlite+aiosqlite:////data/kmq-tracker.db"
    assert settings.http_host == "0.0.0.0"  # noqa: S104 - the pod's address, for the probes
    assert settings.replica_id == "kmq-tracker-pod-0"
    assert settings.log_format == "json"
    assert settings.default_policy.max_attempts == 5
    assert settings.markers_replication_factor == 3
    toml = rendered.one("ConfigMap", FULLNAME)["data"]["kmq.toml"]
    assert "token" not in toml
    assert "password" not in toml


def spec_labels(workload: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    assert selects(workload["spec"]["selector"]["matchLabels"], labels)
    return labels


def test_sqlite_runs_exactly_one_replica_whatever_replica_count_says() -> None:
    rendered = render({"replicaCount": 3})
    validate_all(rendered)
    assert rendered.one("StatefulSet")["spec"]["replicas"] == 1
    assert not rendered.of_kind("Deployment")
    assert "exactly one replica" in rendered.notes()


def test_postgres_deployment_with_hpa_pdb_servicemonitor_networkpolicy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rendered = render(POSTGRES_HA)
    validate_all(rendered)
    assert not rendered.of_kind("StatefulSet")
    deployment = rendered.one("Deployment")
    assert "replicas" not in deployment["spec"]  # the HPA owns the replica count
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    spec = pod_spec(deployment)
    check_pod(spec)
    tracker = container(spec, "kmq-tracker")
    check_tracker_container(tracker)
    assert "initContainers" not in spec  # the hook Job migrates
    assert "kmq-data" not in {v["name"] for v in spec["volumes"]}
    labels = spec_labels(deployment)

    hpa = rendered.one("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": FULLNAME,
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)
    pdb = rendered.one("PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    assert "maxUnavailable" not in pdb["spec"]
    assert selects(pdb["spec"]["selector"]["matchLabels"], labels)

    service = rendered.one("Service")
    monitor = rendered.one("ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert endpoint["authorization"]["credentials"] == {"name": FULLNAME, "key": "api-read-token"}
    assert secret_values(rendered, FULLNAME)["api-read-token"] == "read-only-token"

    policy = rendered.one("NetworkPolicy")
    assert selects(policy["spec"]["podSelector"]["matchLabels"], labels)
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert policy["spec"]["ingress"][0]["from"] == [
        {"namespaceSelector": {"matchLabels": {"team": "ops"}}}
    ]
    egress_ports = [p["port"] for rule in policy["spec"]["egress"] for p in rule["ports"]]
    assert egress_ports == [53, 53, 9092]

    # Migration: a pre-install/pre-upgrade hook Job, reading the URL from a hook Secret that
    # exists before the release's own objects do.
    job = rendered.one("Job")
    annotations = job["metadata"]["annotations"]
    assert annotations["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert "before-hook-creation" in annotations["helm.sh/hook-delete-policy"]
    job_container = container(job["spec"]["template"]["spec"], "kmq-migrate")
    assert job_container["args"] == ["migrate"]
    check_security_context(job_container)
    url_ref = env_of(job_container)["KMQ_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
    hook_secret = rendered.one("Secret", url_ref["name"])
    assert hook_secret["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert int(hook_secret["metadata"]["annotations"]["helm.sh/hook-weight"]) < int(
        annotations["helm.sh/hook-weight"]
    )
    assert secret_values(rendered, url_ref["name"])[url_ref["key"]] == PG_URL

    # The database URL reaches the tracker from the Secret, never the ConfigMap.
    ref = env_of(tracker)["KMQ_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == (FULLNAME, "database-url")
    assert "pg-secret" not in json.dumps(rendered.of_kind("ConfigMap"))
    settings = load_tracker_settings(
        rendered, tracker, FULLNAME, tmp_path=tmp_path, monkeypatch=monkeypatch
    )
    assert settings.database_url == PG_URL
    assert settings.policy_for("orders").max_attempts == 10
    assert settings.policy_for("orders").processing_timeout.total_seconds() == 120
    assert settings.policy_for("orders").dlq_for("orders") == "orders.dead"
    assert settings.policy_for("other").max_attempts == 5


def test_postgres_api_deployment_runs_the_api_apart_from_the_tracker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """apiDeployment: `kmq-tracker api` pods behind a Service of their own; neither workload's
    selector (nor Service, nor PodDisruptionBudget) takes the other's pods; the NetworkPolicy
    and the ServiceMonitors cover both."""
    rendered = render(
        {
            **POSTGRES_HA,
            "apiDeployment": {
                "enabled": True,
                "replicaCount": 3,
                "resources": {"requests": {"cpu": "250m", "memory": "200Mi"}},
            },
        }
    )
    validate_all(rendered)
    tracker = rendered.one("Deployment", FULLNAME)
    api = rendered.one("Deployment", f"{FULLNAME}-api")
    tracker_labels, api_labels = spec_labels(tracker), spec_labels(api)
    assert not selects(tracker["spec"]["selector"]["matchLabels"], api_labels)
    assert not selects(api["spec"]["selector"]["matchLabels"], tracker_labels)
    assert api["spec"]["replicas"] == 3
    assert api["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    spec = pod_spec(api)
    check_pod(spec)
    assert "initContainers" not in spec  # the hook Job migrates
    c = container(spec, "kmq-api")
    assert c["args"] == ["api"]
    assert c["resources"] == {  # its own, merged over the chart's defaults
        "requests": {"cpu": "250m", "memory": "200Mi"},
        "limits": {"memory": "384Mi"},
    }
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "kmq-http"}
    check_security_context(c)
    ref = env_of(c)["KMQ_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == (FULLNAME, "database-url")
    settings = load_tracker_settings(
        rendered, c, FULLNAME, tmp_path=tmp_path, monkeypatch=monkeypatch
    )
    assert settings.database_url == PG_URL
    # The tracker pods are unchanged.
    check_tracker_container(container(pod_spec(tracker), "kmq-tracker"))

    service = rendered.one("Service", FULLNAME)
    api_service = rendered.one("Service", f"{FULLNAME}-api")
    assert selects(api_service["spec"]["selector"], api_labels)
    assert not selects(api_service["spec"]["selector"], tracker_labels)
    assert not selects(service["spec"]["selector"], api_labels)
    pdb = rendered.one("PodDisruptionBudget")
    assert not selects(pdb["spec"]["selector"]["matchLabels"], api_labels)

    policy = rendered.one("NetworkPolicy")["spec"]["podSelector"]
    [components] = policy["matchExpressions"]
    for labels in (tracker_labels, api_labels):
        assert selects(policy["matchLabels"], labels)
        assert labels[components["key"]] in components["values"]

    monitors = {m["metadata"]["name"]: m for m in rendered.of_kind("ServiceMonitor")}
    assert set(monitors) == {FULLNAME, f"{FULLNAME}-api"}
    for name, target in ((FULLNAME, service), (f"{FULLNAME}-api", api_service)):
        matched = monitors[name]["spec"]["selector"]["matchLabels"]
        assert selects(matched, target["metadata"]["labels"])
    assert not selects(
        monitors[FULLNAME]["spec"]["selector"]["matchLabels"], api_service["metadata"]["labels"]
    )
    assert f"svc/{FULLNAME}-api" in rendered.notes()


def test_postgres_without_autoscaling_and_with_init_container_migration() -> None:
    rendered = render(
        {
            "database": {"type": "postgres", "url": PG_URL},
            "replicaCount": 3,
            "migration": {"mode": "initContainer"},
            "podDisruptionBudget": {"enabled": False},
        }
    )
    validate_all(rendered)
    deployment = rendered.one("Deployment")
    assert deployment["spec"]["replicas"] == 3
    migrate = container(pod_spec(deployment), "kmq-migrate", init=True)
    assert env_of(migrate)["KMQ_DATABASE_URL"]["valueFrom"]["secretKeyRef"]["name"] == FULLNAME
    assert not rendered.of_kind("Job")
    assert not rendered.of_kind("HorizontalPodAutoscaler")
    assert not rendered.of_kind("PodDisruptionBudget")


def test_existing_secret_with_sasl_and_mutual_tls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = {
        "database": {"type": "postgres"},
        "existingSecret": "kmq-credentials",
        "kafka": {
            "bootstrapServers": "kafka.example.com:9094",
            "security": {
                "protocol": "SASL_SSL",
                "sasl": {"mechanism": "SCRAM-SHA-512"},
                "tls": {
                    "secretName": "kafka-client-tls",
                    "certKey": "tls.crt",
                    "keyKey": "tls.key",
                },
            },
        },
    }
    rendered = render(values)
    validate_all(rendered)
    assert not rendered.of_kind("Secret")  # neither the main one nor the hook one
    spec = pod_spec(rendered.one("Deployment"))
    tracker = container(spec, "kmq-tracker")
    env = env_of(tracker)
    for name, key in [
        ("KMQ_DATABASE_URL", "database-url"),
        ("KMQ_API_TOKEN", "api-token"),
        ("KMQ_KAFKA_SASL_USERNAME", "kafka-sasl-username"),
        ("KMQ_KAFKA_SASL_PASSWORD", "kafka-sasl-password"),
        ("KMQ_KAFKA_SSL_KEY_PASSWORD", "kafka-ssl-key-password"),
    ]:
        assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "kmq-credentials", name
        assert env[name]["valueFrom"]["secretKeyRef"]["key"] == key, name
    job = container(rendered.one("Job")["spec"]["template"]["spec"], "kmq-migrate")
    assert env_of(job)["KMQ_DATABASE_URL"]["valueFrom"]["secretKeyRef"]["name"] == (
        "kmq-credentials"
    )
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["kmq-kafka-tls"]["secret"]["secretName"] == "kafka-client-tls"
    mounts = {m["name"]: m for m in tracker["volumeMounts"]}
    assert mounts["kmq-kafka-tls"] == {
        "name": "kmq-kafka-tls",
        "mountPath": "/etc/kmq/kafka-tls",
        "readOnly": True,
    }
    external = {
        "kmq-credentials": {
            "database-url": PG_URL,
            "api-token": "t0ken-for-tests",
            "kafka-sasl-username": "tracker",
            "kafka-sasl-password": "sasl-pw",
        }
    }
    settings = load_tracker_settings(
        rendered, tracker, FULLNAME, tmp_path=tmp_path, monkeypatch=monkeypatch, external=external
    )
    assert settings.kafka_security_protocol == "SASL_SSL"
    assert settings.kafka_sasl_mechanism == "SCRAM-SHA-512"
    assert settings.kafka_sasl_username == "tracker"
    assert settings.kafka_sasl_password is not None
    assert settings.kafka_sasl_password.get_secret_value() == "sasl-pw"
    assert settings.kafka_ssl_cafile == "/etc/kmq/kafka-tls/ca.crt"
    assert settings.kafka_ssl_certfile == "/etc/kmq/kafka-tls/tls.crt"
    assert settings.kafka_ssl_keyfile == "/etc/kmq/kafka-tls/tls.key"
    assert settings.kafka_ssl_key_password is None  # optional key, absent from the Secret


def test_chart_secret_carries_sasl_credentials_and_tokens() -> None:
    rendered = render(
        {
            "api": {"token": "admin-token", "readToken": "read-token"},
            "kafka": {
                "security": {
                    "protocol": "SASL_PLAINTEXT",
                    "sasl": {"mechanism": "PLAIN", "username": "u", "password": "p"},
                }
            },
        }
    )
    validate_all(rendered)
    assert secret_values(rendered, FULLNAME) == {
        "api-token": "admin-token",
        "api-read-token": "read-token",
        "kafka-sasl-username": "u",
        "kafka-sasl-password": "p",
    }


def test_grafana_dashboard_configmap() -> None:
    rendered = render()
    dashboard = rendered.one("ConfigMap", f"{FULLNAME}-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = (CHART / "dashboards" / "kmq-tracker.json").read_text()
    assert json.loads(dashboard["data"]["kmq-tracker.json"]) == json.loads(shipped)
    off = render({"dashboards": {"enabled": False}})
    assert not [c for c in off.of_kind("ConfigMap") if c["metadata"]["name"].endswith("board")]


@pytest.mark.parametrize("native", [False, True], ids=["container", "native-sidecar"])
def test_sidecar_templates_in_a_user_chart(
    native: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = user_app(tmp_path)
    values = {"kmq-tracker": {"sidecar": {"native": native}}}
    rendered = render(values, chart=app, release="billing")
    validate_all(rendered)
    # The dependency renders only the shared objects: no workload, Service or PDB of its own.
    assert rendered.kinds() == ["ConfigMap", "ConfigMap", "Deployment", "Job", "Secret", "Secret"]
    deployment = rendered.one("Deployment")
    assert deployment["metadata"]["name"] == "billing-worker"
    assert deployment["spec"]["replicas"] == 3
    spec = deployment["spec"]["template"]["spec"]
    names = [c["name"] for c in spec["containers"]]
    if native:
        assert names == ["worker"]
        tracker = container(spec, "kmq-tracker", init=True)
        assert tracker["restartPolicy"] == "Always"
    else:
        assert names == ["worker", "kmq-tracker"]
        tracker = container(spec, "kmq-tracker")
        assert "initContainers" not in spec
    check_tracker_container(tracker)
    assert tracker["resources"]["requests"]["memory"] == "192Mi"  # sidecar.resources
    # The app container learns where the marker endpoint is, and gets the token it needs.
    app_env = env_of(container(spec, "worker"))
    assert app_env["KMQ_SIDECAR_URL"]["value"] == "http://127.0.0.1:8080"
    token = app_env["KMQ_API_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert (token["name"], token["key"]) == ("billing-kmq-tracker", "api-token")
    assert "api-token" in secret_values(rendered, "billing-kmq-tracker")
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert set(annotations) >= {"checksum/config", "checksum/secret"}
    volumes = {v["name"] for v in spec["volumes"]}
    assert volumes == {"kmq-config", "kmq-tmp"}
    config = rendered.one("ConfigMap", "billing-kmq-tracker")
    assert {v["name"]: v for v in spec["volumes"]}["kmq-config"]["configMap"]["name"] == (
        config["metadata"]["name"]
    )
    settings = load_tracker_settings(
        rendered, tracker, "billing-kmq-tracker", tmp_path=tmp_path, monkeypatch=monkeypatch
    )
    assert settings.kafka_bootstrap_servers == "kafka-0.kafka:9092,kafka-1.kafka:9092"
    assert settings.policy_for("billing").max_attempts == 8
    assert settings.database_url.startswith("postgresql+asyncpg://")


def test_sidecar_with_sqlite_uses_the_given_claim_and_migrates_in_the_pod(tmp_path: Path) -> None:
    app = user_app(tmp_path)
    values = {
        "replicaCount": 1,
        "kmq-tracker": {"database": {"type": "sqlite"}, "persistence": {"existingClaim": "q"}},
    }
    rendered = render(values, chart=app, release="billing")
    validate_all(rendered)
    spec = rendered.one("Deployment")["spec"]["template"]["spec"]
    assert container(spec, "kmq-migrate", init=True)["args"] == ["migrate"]
    claims = [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
    assert claims == [{"name": "kmq-data", "persistentVolumeClaim": {"claimName": "q"}}]
    assert not rendered.of_kind("Job")


def test_sidecar_mode_standalone_renders_no_workload() -> None:
    rendered = render({"mode": "sidecar", "database": {"type": "postgres", "url": PG_URL}})
    validate_all(rendered)
    assert not {"Deployment", "StatefulSet", "Service", "PodDisruptionBudget"} & set(
        rendered.kinds()
    )
    assert "kmq-tracker.sidecar" in rendered.notes()


# -- values the schema (or the templates) refuse ---------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"replicaCount": -1}, "/replicaCount"),
        ({"replicaCount": "3"}, "/replicaCount"),
        ({"mode": "daemonset"}, "/mode"),
        ({"database": {"type": "mysql"}}, "/database/type"),
        ({"database": {"type": "postgres"}}, "/database/url"),
        ({"database": {"type": "postgres", "url": "postgres://x/y"}}, "/database/url"),
        ({"autoscaling": {"enabled": True}}, "/autoscaling/enabled"),  # SQLite
        ({"apiDeployment": {"enabled": True}}, "/apiDeployment/enabled"),  # SQLite
        (
            {"database": {"type": "postgres", "url": PG_URL}, "apiDeployment": {"replicaCount": 0}},
            "/apiDeployment/replicaCount",
        ),
        ({"replicas": 2}, "additional properties 'replicas'"),
        ({"image": {"repository": "kmq", "pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
        ({"image": {"repository": "kmq", "pullPolicy": "Always", "digest": "v1"}}, "/digest"),
        ({"kafka": {"security": {"protocol": "TLS"}}}, "/kafka/security/protocol"),
        ({"kafka": {"security": {"protocol": "SASL_SSL"}}}, "/kafka/security/sasl"),
        (
            {"kafka": {"security": {"protocol": "PLAINTEXT", "tls": {"secretName": "x"}}}},
            "/kafka/security/tls/secretName",
        ),
        ({"kafka": {"clientConfig": {"security_protocol": "SSL"}}}, "/kafka/clientConfig"),
        ({"kafka": {"markersPartitions": 0}}, "/kafka/markersPartitions"),
        ({"kafka": {"bootstrapServers": "kafka"}}, "/kafka/bootstrapServers"),
        ({"policies": {"default": {"max_attempts": 0}}}, "/policies/default/max_attempts"),
        ({"policies": {"default": {"processing_timeout": "30 sec"}}}, "processing_timeout"),
        ({"policies": {"default": {"max_attempt": 3}}}, "max_attempt"),
        ({"policies": {"topics": {"bad topic": {}}}}, "'bad topic'"),
        ({"config": {"database_url": "sqlite+aiosqlite:///x"}}, "'database_url'"),
        ({"config": {"api_token": "x" * 10}}, "'api_token'"),
        ({"api": {"token": "short"}}, "/api/token"),
        ({"securityContext": {"runAsNonRoot": False}}, "/securityContext"),
        ({"podDisruptionBudget": {"maxUnavailable": "half"}}, "/podDisruptionBudget"),
        ({"mode": "sidecar"}, "/persistence"),  # SQLite sidecar without a claim
        ({"httpPort": 80}, "/httpPort"),
        ({"probes": {"liveness": {"path": "healthz"}}}, "/probes"),
    ],
)
def test_bad_values_are_rejected_by_the_schema(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmValuesError) as caught:
        render(values)
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {
                "database": {"type": "postgres", "url": PG_URL},
                "autoscaling": {"enabled": True, "maxReplicas": 20},
            },
            "autoscaling.maxReplicas (20) exceeds kafka.markersPartitions (12)",
        ),
        (
            {"database": {"type": "postgres", "url": PG_URL}, "replicaCount": 13},
            "replicaCount (13) exceeds kafka.markersPartitions (12)",
        ),
    ],
)
def test_template_checks_refuse_pointless_replicas(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=message.replace("(", r"\(").replace(")", r"\)")):
        render(values)


def test_every_default_value_is_accepted_by_the_schema_and_namespaced() -> None:
    """The defaults pass their own schema, and no manifest hard-codes a namespace."""
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(chart.values)
    rendered = render(namespace=NAMESPACE)
    assert all("namespace" not in o["metadata"] for o in rendered.objects)
