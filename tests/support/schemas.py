"""Rendered objects against kubernetes-validate's strict schemas, and custom resources by hand.

:func:`assert_valid` checks one object at one Kubernetes version (:data:`K8S_VERSIONS`: the
oldest the manifests support and the newest the package ships). Custom resources it has no
schema for (PodMonitor, PrometheusRule, ScaledObject) get their required fields checked here
(:data:`CUSTOM_RESOURCES`); any other kind without a schema fails.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kubernetes_validate
import pytest

#: The preStop ``sleep`` action needs 1.30 (beta, on by default); the newest schemas shipped.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())


def _check_pod_monitor(doc: dict[str, Any]) -> None:
    spec = doc["spec"]
    assert spec["selector"]["matchLabels"], "a PodMonitor without a selector scrapes nothing"
    endpoints = spec["podMetricsEndpoints"]
    assert endpoints
    for endpoint in endpoints:
        assert isinstance(endpoint["port"], str) and endpoint["port"], endpoint
        assert endpoint.get("path", "/metrics").startswith("/"), endpoint


def _check_prometheus_rule(doc: dict[str, Any]) -> None:
    groups = doc["spec"]["groups"]
    assert groups
    for group in groups:
        assert group["name"]
        assert group["rules"], group["name"]
        for rule in group["rules"]:
            assert ("alert" in rule) != ("record" in rule), rule
            assert isinstance(rule["expr"], str) and rule["expr"].strip(), rule


def _check_scaled_object(doc: dict[str, Any]) -> None:
    spec = doc["spec"]
    assert spec["scaleTargetRef"]["name"]
    assert spec.get("minReplicaCount", 0) <= spec.get("maxReplicaCount", 100)
    assert spec["triggers"]
    for trigger in spec["triggers"]:
        assert trigger["type"] == "prometheus", trigger
        meta = trigger["metadata"]
        assert meta["serverAddress"].startswith(("http://", "https://")), meta
        assert meta["query"].strip(), meta
        assert float(meta["threshold"]) > 0, meta
        # KEDA's fallback works only for AverageValue triggers (ScaledObject reference, fallback)
        assert trigger.get("metricType", "AverageValue") == "AverageValue", trigger
    fallback = spec["fallback"]
    assert fallback["failureThreshold"] >= 1
    assert spec.get("minReplicaCount", 0) <= fallback["replicas"] <= spec["maxReplicaCount"]
    # a Prometheus outage never scales in: KEDA (2.17+) falls back to max(current, replicas),
    # where the default (static) would set fallback.replicas whatever the current size
    assert fallback.get("behavior") == "currentReplicasIfHigher", fallback


#: Custom resources kubernetes-validate has no schema for, and what each must carry.
CUSTOM_RESOURCES: dict[tuple[str, str], Callable[[dict[str, Any]], None]] = {
    ("monitoring.coreos.com/v1", "PodMonitor"): _check_pod_monitor,
    ("monitoring.coreos.com/v1", "PrometheusRule"): _check_prometheus_rule,
    ("keda.sh/v1alpha1", "ScaledObject"): _check_scaled_object,
}


def assert_valid(doc: dict[str, Any], version: str, where: str) -> None:
    """``doc`` passes the strict schema of Kubernetes ``version``, or its custom check."""
    where = f"{where}: {doc['kind']}/{doc['metadata']['name']}"
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        check = CUSTOM_RESOURCES.get((doc["apiVersion"], doc["kind"]))
        assert check is not None, f"{where}: no schema and no check for {doc['apiVersion']}"
        assert doc["metadata"]["name"], where
        check(doc)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{where} fails the {version} schema: {exc.message} at {list(exc.path)}")
