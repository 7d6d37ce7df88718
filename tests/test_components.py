"""The kustomize Components under deploy/components/, and what an operator's own kustomization
changes through them without editing the base.

Each test writes a kustomization of its own in a temporary directory, as an operator would next
to a copy of deploy/, and renders it with ``kubectl kustomize``: each Component on the base alone
(every object valid, the kinds it adds and nothing else), the base without monitoring, a
``namespace:`` set over the autoscaling overlays (the KEDA queries follow it), and the alert
settings (the runbook base URL and the PrometheusRule's labels) changed by a Component and a patch,
or by ``python -m grafana.build`` run without the test extra; and deploy/README.md's examples of
such kustomizations, as the README spells them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import yaml

from grafana import build
from grafana.alerts import ALERTS, RUNBOOK_BASE_URL, SIDECAR_TARGET_MATCHER
from tests.support.manifests import DEPLOY, of_kind, render, render_dir
from tests.support.schemas import K8S_VERSIONS, assert_valid

ROOT = DEPLOY.parent
COMPONENTS = DEPLOY / "components"

RUNBOOKS = "https://wiki.example.com/runbooks/kv-sidecar"
#: The ConfigMap the alert-settings Component reads (never applied: local-config).
ALERT_SETTINGS = {
    "apiVersion": "v1",
    "kind": "ConfigMap",
    "metadata": {
        "name": "kv-sidecar-alert-settings",
        "annotations": {"config.kubernetes.io/local-config": "true"},
    },
    "data": {"runbookBaseURL": RUNBOOKS},
}
#: A patch giving the PrometheusRule the label a kube-prometheus-stack ruleSelector matches.
RULE_LABEL_PATCH = """\
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: kv-sidecar
  labels:
    release: kube-prometheus-stack
"""


def kustomization(directory: Path, files: dict[str, Any] | None = None, **fields: Any) -> Path:
    """``directory`` with a kustomization.yaml of ``fields`` (paths under deploy/ made relative
    to it, as kustomize wants them) and ``files`` beside it."""
    directory.mkdir(parents=True, exist_ok=True)

    def where(entry: Any) -> Any:
        return os.path.relpath(entry, directory) if isinstance(entry, Path) else entry

    for key in ("resources", "components"):
        if key in fields:
            fields[key] = [where(entry) for entry in fields[key]]
    document = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", **fields}
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(document, sort_keys=False))
    for name, content in (files or {}).items():
        text = content if isinstance(content, str) else yaml.safe_dump(content, sort_keys=False)
        (directory / name).write_text(text)
    return directory


def kinds(docs: tuple[dict[str, Any], ...]) -> dict[str, int]:
    counted: dict[str, int] = {}
    for doc in docs:
        counted[doc["kind"]] = counted.get(doc["kind"], 0) + 1
    return counted


def queries(docs: tuple[dict[str, Any], ...]) -> list[str]:
    """Every KEDA trigger's PromQL query."""
    return [
        trigger["metadata"]["query"]
        for scaled in of_kind(docs, "ScaledObject")
        for trigger in scaled["spec"]["triggers"]
    ]


# --- each Component on the base -----------------------------------------------------------------

#: What each Component adds to the base (the kv-sidecar Component is the base's own), and what
#: the kustomization listing it must have beside it.
ADDS: dict[str, dict[str, int]] = {
    "monitoring": {"PodMonitor": 1, "PrometheusRule": 1, "ConfigMap": 1},
    "autoscaling-keda": {"ScaledObject": 1},
    "autoscaling-hpa": {"HorizontalPodAutoscaler": 1},
    "alert-settings": {},  # changes the monitoring Component's PrometheusRule, adds nothing
}
NEEDS: dict[str, dict[str, Any]] = {
    # its queries name the ScaledObject's namespace: something must set one
    "autoscaling-keda": {"namespace": "team-a"},
    "alert-settings": {
        "resources": ["alert-settings.yaml"],
        "components": [COMPONENTS / "monitoring"],
    },
}


def test_every_component_is_tested_here() -> None:
    shipped = {d.name for d in COMPONENTS.iterdir() if (d / "kustomization.yaml").exists()}
    assert shipped == set(ADDS) | {"kv-sidecar"}


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("component", sorted(ADDS))
def test_each_component_renders_into_the_base_and_passes_the_schemas(
    component: str, version: str, tmp_path: Path
) -> None:
    definition = yaml.safe_load((COMPONENTS / component / "kustomization.yaml").read_text())
    assert definition["apiVersion"] == "kustomize.config.k8s.io/v1alpha1"
    assert definition["kind"] == "Component"
    needs = NEEDS.get(component, {})
    directory = kustomization(
        tmp_path / "operator",
        {"alert-settings.yaml": ALERT_SETTINGS},
        resources=[DEPLOY / "base", *needs.get("resources", [])],
        components=[*needs.get("components", []), COMPONENTS / component],
        **({"namespace": needs["namespace"]} if "namespace" in needs else {}),
    )
    docs = render_dir(directory)
    for doc in docs:
        assert_valid(doc, version, f"base + components/{component}")
    wanted = dict(kinds(render("base")))
    for extra in [*needs.get("components", []), COMPONENTS / component]:
        for kind, n in ADDS[Path(extra).name].items():
            wanted[kind] = wanted.get(kind, 0) + n
    assert kinds(docs) == wanted
    (deployment,) = of_kind(docs, "Deployment")
    if component.startswith("autoscaling-"):
        assert "replicas" not in deployment["spec"], "the autoscaler owns the replica count"
    else:
        assert deployment["spec"]["replicas"] == 1


def test_the_base_renders_without_monitoring() -> None:
    """For a cluster without the prometheus-operator CRDs: nothing of monitoring.coreos.com, and
    no dashboard; the overlays that list the monitoring Component have all three."""
    docs = render("base")
    assert not [d for d in docs if d["apiVersion"].startswith("monitoring.coreos.com/")]
    (configmap,) = of_kind(docs, "ConfigMap")
    assert configmap["metadata"]["name"].startswith("kv-sidecar-config-")
    with_it = kinds(render("overlays/queue"))
    assert with_it["PodMonitor"] == with_it["PrometheusRule"] == 1
    assert with_it["ConfigMap"] == 2


# --- the namespace --------------------------------------------------------------------------------


def test_the_keda_queries_name_the_namespace_a_kustomization_on_top_sets(tmp_path: Path) -> None:
    shipped = render("overlays/autoscaling-keda")
    assert {d["metadata"]["namespace"] for d in shipped} == {"default"}
    assert len(queries(shipped)) == 2
    assert all('namespace="default"' in q for q in queries(shipped))

    docs = render_dir(
        kustomization(
            tmp_path / "team-a",
            namespace="team-a",
            resources=[DEPLOY / "overlays" / "autoscaling-keda"],
        )
    )
    assert {d["metadata"]["namespace"] for d in docs} == {"team-a"}
    assert len(queries(docs)) == 2
    for query in queries(docs):
        assert 'namespace="team-a"' in query, query
        assert "default" not in query, query
        assert "$(" not in query, query


def test_the_keda_component_on_another_overlay_follows_a_namespace_two_levels_up(
    tmp_path: Path,
) -> None:
    """The reject overlay autoscaled by KEDA, in a kustomization of its own, with the namespace
    set by another over that one: kustomize resolves the queries' namespace last."""
    inner = kustomization(
        tmp_path / "reject-keda",
        resources=[DEPLOY / "overlays" / "reject"],
        components=[COMPONENTS / "autoscaling-keda"],
    )
    docs = render_dir(kustomization(tmp_path / "team-b", namespace="team-b", resources=[inner]))
    assert len(queries(docs)) == 2
    assert all('namespace="team-b"' in q and "default" not in q for q in queries(docs))
    (deployment,) = of_kind(docs, "Deployment")
    assert "replicas" not in deployment["spec"]


def test_the_hpa_names_no_namespace_the_adapter_fills_it_in(tmp_path: Path) -> None:
    docs = render_dir(
        kustomization(
            tmp_path / "team-a",
            namespace="team-a",
            resources=[DEPLOY / "overlays" / "autoscaling-hpa"],
        )
    )
    (hpa,) = of_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["metadata"]["namespace"] == "team-a"
    assert "namespace" not in yaml.safe_dump(hpa["spec"])
    rules = DEPLOY / "overlays" / "autoscaling-hpa" / "prometheus-adapter-rules.yaml"
    (configmap,) = yaml.safe_load_all(rules.read_text())
    for rule in yaml.safe_load(configmap["data"]["config.yaml"])["rules"]:
        assert "<<.LabelMatchers>>" in rule["metricsQuery"]
        assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}


# --- the alert settings ---------------------------------------------------------------------------


def _runbooks(rule: dict[str, Any]) -> dict[str, str]:
    return {
        r["alert"]: r["annotations"]["runbook_url"]
        for group in rule["spec"]["groups"]
        for r in group["rules"]
    }


def test_the_alert_settings_component_and_a_patch_change_the_rule(tmp_path: Path) -> None:
    (shipped,) = of_kind(render("overlays/reject"), "PrometheusRule")
    names = [alert.name for alert in ALERTS]
    assert _runbooks(shipped) == {n: f"{RUNBOOK_BASE_URL}#{n.lower()}" for n in names}
    assert "release" not in shipped["metadata"]["labels"]

    docs = render_dir(
        kustomization(
            tmp_path / "operator",
            {"alert-settings.yaml": ALERT_SETTINGS},
            resources=[DEPLOY / "overlays" / "reject", "alert-settings.yaml"],
            components=[COMPONENTS / "alert-settings"],
            patches=[{"patch": RULE_LABEL_PATCH}],
        )
    )
    (rule,) = of_kind(docs, "PrometheusRule")
    assert _runbooks(rule) == {n: f"{RUNBOOKS}#{n.lower()}" for n in names}
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    # the other labels stay, and the settings ConfigMap is not rendered (local-config)
    assert shipped["metadata"]["labels"].items() <= rule["metadata"]["labels"].items()
    assert not [d for d in docs if d["metadata"]["name"] == "kv-sidecar-alert-settings"]
    assert (
        rule["spec"]["groups"][0]["rules"][0]["expr"]
        == shipped["spec"]["groups"][0]["rules"][0]["expr"]
    )


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _test_only_modules() -> list[str]:
    """Top-level modules of the test extra's distributions that the base install (the lock, of
    the package's dependencies and the otlp extra) does not bring."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = {
        _canonical(re.match(r"[A-Za-z0-9._-]+", r).group())  # type: ignore[union-attr]
        for r in project["optional-dependencies"]["test"]
    }
    locked = {
        _canonical(m)
        for m in re.findall(r"^([A-Za-z0-9._-]+)==", (ROOT / "requirements.lock").read_text(), re.M)
    }
    test_only = extra - locked
    return sorted(
        module
        for module, dists in metadata.packages_distributions().items()
        if any(_canonical(d) in test_only for d in dists) and module.isidentifier()
    )


def _build_without_the_test_extra(where: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m grafana.build ARGS`` on a copy of grafana/ and deploy/monitoring/ in
    ``where``, with every module only the test extra installs made unimportable."""
    blocked = _test_only_modules()
    assert "grafana_foundation_sdk" in blocked and "kubernetes_validate" in blocked, blocked
    prelude = (
        "import runpy, sys\n"
        f"for name in {blocked!r}:\n"
        "    sys.modules[name] = None\n"
        f"sys.path[:0] = [{str(where)!r}, {str(ROOT)!r}]\n"
        "sys.argv[0] = 'python -m grafana.build'\n"
        "runpy.run_module('grafana.build', run_name='__main__')\n"
    )
    return subprocess.run(
        [sys.executable, "-c", prelude, *args],
        cwd=where,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def test_grafana_build_takes_the_alert_settings_without_the_test_extra(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "grafana", tmp_path / "grafana")
    shutil.copytree(DEPLOY / "monitoring", tmp_path / "deploy" / "monitoring")
    (tmp_path / "grafana" / "kv-sidecar.json").unlink()
    matcher = 'job="team-a/kv-sidecar"'
    args = [
        f"--runbook-base={RUNBOOKS}",
        "--rule-label=release=kube-prometheus-stack",
        "--rule-label=team=a",
        f"--sidecar-matcher={matcher}",
    ]
    done = _build_without_the_test_extra(tmp_path, *args)
    assert done.returncode == 0, done.stderr
    assert "grafana-foundation-sdk" in done.stderr
    # the dashboard needs the SDK: left as it is (here, not there at all)
    assert not (tmp_path / "grafana" / "kv-sidecar.json").exists()
    checked = _build_without_the_test_extra(tmp_path, "--check", *args)
    assert checked.returncode == 2 and "--rules-only" in checked.stderr, checked.stderr
    checked = _build_without_the_test_extra(tmp_path, "--check", "--rules-only", *args)
    assert checked.returncode == 0, checked.stderr

    (rule,) = of_kind(render_dir(tmp_path / "deploy" / "monitoring"), "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["metadata"]["labels"]["team"] == "a"
    assert rule["metadata"]["labels"]["app.kubernetes.io/part-of"] == "vllm-kv-sidecar"
    assert _runbooks(rule) == {a.name: f"{RUNBOOKS}#{a.name.lower()}" for a in ALERTS}
    (down,) = [r for r in rule["spec"]["groups"][0]["rules"] if r["alert"] == "KVSidecarDown"]
    assert down["expr"] == f"up{{{matcher}}} == 0\nor\nabsent(up{{{matcher}}})"
    assert SIDECAR_TARGET_MATCHER not in down["expr"]
    rules_file = yaml.safe_load((tmp_path / "grafana" / "alerts.yaml").read_text())
    assert rules_file["groups"] == rule["spec"]["groups"]


def test_grafana_build_parameters_change_the_rule_files_only() -> None:
    """(tests/test_alerts.py checks that the defaults build the committed files.)"""
    default = build.render()
    changed = build.render(runbook_base=RUNBOOKS, rule_labels={"release": "kps"})
    assert changed.keys() == default.keys()
    differ = {path for path in default if default[path] != changed[path]}
    assert differ == {build.ALERTS_YAML, build.PROMETHEUS_RULE}
    assert RUNBOOK_BASE_URL in default[build.ALERTS_YAML]
    assert all(RUNBOOK_BASE_URL not in changed[path] for path in differ)
    assert "release: kps" in changed[build.PROMETHEUS_RULE]
    assert "release" not in default[build.PROMETHEUS_RULE]


@pytest.mark.parametrize(
    "argument",
    [
        "--runbook-base=https://wiki.example.com/r#anchor",
        "--runbook-base=wiki.example.com/r",
        "--rule-label=release",
        "--rule-label=bad key=x",
        "--sidecar-matcher=container=kv-sidecar",
    ],
)
def test_grafana_build_refuses_settings_it_cannot_build(argument: str) -> None:
    with pytest.raises(SystemExit) as exited:
        build.main(["--check", "--rules-only", argument])
    assert exited.value.code == 2


# --- the README's examples ------------------------------------------------------------------------

README = DEPLOY / "README.md"


def _readme_examples() -> list[tuple[str, str]]:
    """(file name, text) of each yaml block in deploy/README.md that starts ``# my-llm/NAME``."""
    blocks = re.findall(r"^```yaml\n(.*?)^```", README.read_text(encoding="utf-8"), re.M | re.S)
    found = []
    for block in blocks:
        first = re.match(r"# my-llm/([\w.-]+)", block)
        if first:
            found.append((first.group(1), block))
    return found


def test_the_readme_examples_render_as_described(tmp_path: Path) -> None:
    """Each kustomization.yaml of deploy/README.md's Components section, in a directory my-llm/
    beside deploy/ (a link to this one), with the README's other files beside it."""
    examples = _readme_examples()
    others = {name: text for name, text in examples if name != "kustomization.yaml"}
    kustomizations = [text for name, text in examples if name == "kustomization.yaml"]
    assert set(others) == {"alert-settings.yaml"} and len(kustomizations) == 2, examples
    rendered = []
    for n, text in enumerate(kustomizations):
        directory = tmp_path / f"example-{n}" / "my-llm"
        directory.mkdir(parents=True)
        (tmp_path / f"example-{n}" / "deploy").symlink_to(DEPLOY, target_is_directory=True)
        (directory / "kustomization.yaml").write_text(text)
        for name, other in others.items():
            (directory / name).write_text(other)
        rendered.append(render_dir(directory))
    without_monitoring, team_a = rendered

    assert kinds(without_monitoring) == kinds(render("base"))
    (configmap,) = of_kind(without_monitoring, "ConfigMap")
    assert configmap["data"]["KV_SIDECAR_POLICY"] == "queue"

    assert {d["metadata"]["namespace"] for d in team_a} == {"team-a"}
    assert len(queries(team_a)) == 2
    assert all('namespace="team-a"' in q and "default" not in q for q in queries(team_a))
    (rule,) = of_kind(team_a, "PrometheusRule")
    assert _runbooks(rule) == {a.name: f"{RUNBOOKS}#{a.name.lower()}" for a in ALERTS}
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (configmap,) = [c for c in of_kind(team_a, "ConfigMap") if "KV_SIDECAR_POLICY" in c["data"]]
    assert configmap["data"]["KV_SIDECAR_POLICY"] == "reject"
    assert kinds(team_a) == {**kinds(render("overlays/reject")), "ScaledObject": 1}
