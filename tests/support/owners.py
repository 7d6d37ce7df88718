"""An admission owner (``AdmissionOwner``) in this process, for the tests of the workers' wire
protocol (tests/test_workers_wire.py, tests/test_workers.py): a real admission controller over
blocks of 128 tokens, fed one snapshot of an idle engine of 64 blocks (a budget of 59 with the
default headroom), with the sidecar's metrics on a registry of its own and the default settings;
no engine config is known."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry

from sidecar.admission.controller import AdmissionController
from sidecar.config import Settings
from sidecar.http.seams import Traffic
from sidecar.http.workers.owner import AdmissionOwner
from sidecar.kv.geometry import UniformBlocks
from sidecar.kv.ledger import Ledger
from sidecar.observability.exporter import Metrics
from tests.support.snapshots import snapshot


def admission_owner(workers: int) -> tuple[AdmissionController, AdmissionOwner]:
    """The controller and an owner of it for ``workers`` workers (not started: no socket yet)."""
    admission = AdmissionController(Ledger(UniformBlocks(128)), max_queue_wait=30)
    admission.on_snapshot(snapshot(time.monotonic))
    metrics = Metrics(
        CollectorRegistry(),
        admission,
        engine=lambda: None,
        vllm_up=lambda: True,
        ready=lambda: True,
        scrape_errors=lambda: 0,
        config_labels={},
    )
    owner = AdmissionOwner(
        admission,
        metrics,
        settings=Settings(),
        workers=workers,
        engine=lambda: None,
        traffic=Traffic(),
    )
    return admission, owner
