"""Rendering the Helm chart with Helm's own Go SDK and validating the manifests offline.

``helm-python-sdk`` (import ``helm_python``) ships ``libhelm_c``, Helm v4's SDK compiled as a
shared library, in its wheel: lint, values-schema validation and rendering run in-process with
no ``helm`` binary, no cluster and no network. ``kubernetes-validate`` ships the Kubernetes
OpenAPI schemas (strict variants reject unknown fields) for every minor version it supports.
"""

from __future__ import annotations

import shutil
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kmq-tracker"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
USER_APP = FIXTURES / "user-app"
KUBE_VERSION = "1.30.0"
RELEASE = "kmq"
NAMESPACE = "queues"

#: prometheus-operator's ServiceMonitor is a CRD, so kubernetes-validate has no schema for it.
#: This one covers the fields the chart writes, by the CRD's field names, and refuses others.
SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "required": ["matchLabels"],
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "additionalProperties": {"type": "string"},
                        }
                    },
                },
                "namespaceSelector": {
                    "type": "object",
                    "properties": {"matchNames": {"type": "array", "items": {"type": "string"}}},
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["port"],
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "authorization": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {
                                    "type": {"type": "string"},
                                    "credentials": {
                                        "type": "object",
                                        "required": ["name", "key"],
                                        "properties": {
                                            "name": {"type": "string"},
                                            "key": {"type": "string"},
                                        },
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


@dataclass
class Rendered:
    """The manifests of one render, by template and as parsed objects."""

    files: dict[str, str]
    objects: list[dict[str, Any]] = field(default_factory=list)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict[str, Any]:
        found = [o for o in self.of_kind(kind) if name is None or o["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
        return found[0]

    def kinds(self) -> list[str]:
        return sorted(o["kind"] for o in self.objects)

    def notes(self) -> str:
        return next((text for path, text in self.files.items() if path.endswith("NOTES.txt")), "")


def render(
    values: Mapping[str, Any] | None = None,
    *,
    chart: Path = CHART,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
) -> Rendered:
    """Render ``chart`` as ``helm template`` would for an install (values schema included)."""
    with helm.Chart.load(chart) as loaded:
        files = loaded.render(
            values=dict(values or {}), name=release, namespace=namespace, is_install=True
        )
    rendered = Rendered(files)
    for path, text in sorted(files.items()):
        if path.endswith("NOTES.txt"):
            continue
        for obj in yaml.safe_load_all(text):
            if obj:
                rendered.objects.append(obj)
    return rendered


def validate(obj: Mapping[str, Any], version: str = KUBE_VERSION) -> None:
    """Validate one object against the Kubernetes schemas (strict: unknown fields fail)."""
    if obj.get("kind") == "ServiceMonitor":
        jsonschema.validate(dict(obj), SERVICE_MONITOR_SCHEMA)
        return
    kubernetes_validate.validate(dict(obj), version, strict=True)


def validate_all(rendered: Rendered) -> None:
    for obj in rendered.objects:
        try:
            validate(obj)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as exc:
            where = ".".join(str(p) for p in exc.path)
            raise AssertionError(
                f"{obj['kind']}/{obj['metadata']['name']} is not valid Kubernetes "
                f"{KUBE_VERSION}: {where}: {exc.message}"
            ) from None


def user_app(tmp_path: Path) -> Path:
    """The user-app fixture with this chart as its dependency (as `helm dependency update`)."""
    app = tmp_path / "user-app"
    shutil.copytree(USER_APP, app)
    shutil.copytree(CHART, app / "charts" / "kmq-tracker")
    return app


# -- reading rendered objects -----------------------------------------------------------------


def pod_spec(workload: Mapping[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def container(spec: Mapping[str, Any], name: str, *, init: bool = False) -> dict[str, Any]:
    key = "initContainers" if init else "containers"
    found = [c for c in spec.get(key, []) if c["name"] == name]
    assert len(found) == 1, f"no {key[:-1]} {name!r} in {[c['name'] for c in spec.get(key, [])]}"
    result: dict[str, Any] = found[0]
    return result


def env_of(c: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in c.get("env", [])}


def settings_file(rendered: Rendered, configmap: str) -> dict[str, Any]:
    text = rendered.one("ConfigMap", configmap)["data"]["kmq.toml"]
    return tomllib.loads(text)
