"""The kustomizations under deploy/, rendered with ``kubectl kustomize``, and lookups in them.

``render("base")`` is the objects ``kubectl kustomize deploy/base`` prints (once a session: the
answer is cached), ``render_dir(path)`` those of any kustomization; :func:`of_kind`,
:func:`container` and :func:`container_port` find a kind, a container (the sidecar's is
:data:`SIDECAR`, vLLM's :data:`VLLM`) and the number a port name means.

>>> sidecar = {"name": SIDECAR, "ports": [{"name": "metrics", "containerPort": 9091}]}
>>> container_port(sidecar, "metrics"), container_port(sidecar, 9091)
(9091, 9091)
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"

#: the containers' names in the rendered Deployments
SIDECAR = "kv-sidecar"
VLLM = "vllm"


@functools.cache
def render(kustomization: str) -> tuple[dict[str, Any], ...]:
    """The objects ``kubectl kustomize deploy/<kustomization>`` prints."""
    return render_dir(DEPLOY / kustomization)


def render_dir(directory: Path) -> tuple[dict[str, Any], ...]:
    """The objects ``kubectl kustomize <directory>`` prints (any kustomization, not cached)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not installed: these tests need it (scripts/system-deps.sh)")
    done = subprocess.run(
        [kubectl, "kustomize", str(directory)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    where = directory.relative_to(DEPLOY.parent) if directory.is_relative_to(DEPLOY) else directory
    assert done.returncode == 0, f"kubectl kustomize {where}:\n{done.stderr}"
    docs = tuple(d for d in yaml.safe_load_all(done.stdout) if d)
    assert docs, f"{where} renders nothing"
    return docs


def of_kind(docs: tuple[dict[str, Any], ...], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    containers: list[dict[str, Any]] = deployment["spec"]["template"]["spec"]["containers"]
    for c in containers:
        if c["name"] == name:
            return c
    raise AssertionError(f"{deployment['metadata']['name']} has no container {name!r}")


def container_port(c: dict[str, Any], port: int | str) -> int:
    """The number a probe's or Service's port means in this container (a name or a number)."""
    if isinstance(port, int):
        assert any(p["containerPort"] == port for p in c.get("ports", [])), (c["name"], port)
        return port
    for p in c.get("ports", []):
        if p.get("name") == port:
            return int(p["containerPort"])
    raise AssertionError(f"container {c['name']!r} has no port named {port!r}")
