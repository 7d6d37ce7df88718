"""The runtime settings (``--admin``'s /admin/settings) and ``kv-sidecar status``.

The queue re-judged on the controller itself (a lower depth, a shorter or longer wait, a policy
that refuses or forwards what waits, a smaller headroom); the admin API refusing while off and
applying when on, through the sidecar in front of the fake vLLM (403, then 200 and the next
request decided by the new value; 400 naming the setting and nothing changed; the bearer token;
the log line and the metrics); and ``kv-sidecar status`` against a real ``kv-sidecar serve``
with relay workers, whose settings change once for the pod, and its one-line error exit.
"""

from __future__ import annotations

import asyncio
import http.server
import logging
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.fake_vllm import FakeServer, FakeVllm, write_model_dir
from harness.workload import SidecarProcess, metric_value
from sidecar.admission import tuning
from sidecar.admission.ask import Ask
from sidecar.admission.controller import AdmissionController
from sidecar.admission.decisions import Decision, Outcome
from sidecar.config import Policy
from sidecar.kv.geometry import UniformBlocks
from sidecar.kv.ledger import Ledger
from sidecar.kv.projection import Projection, project_counts
from tests.support.openai_errors import openai_error
from tests.support.snapshots import Clock, snapshot
from tests.support.stack import Stack, run_sidecar
from tests.support.wait import eventually, wait_for

BLOCKS = UniformBlocks(128)


def proj(prompt: int = 271, max_tokens: int = 700) -> Projection:  # 8 blocks at its peak
    return project_counts(
        (prompt,), requested_max_tokens=max_tokens, n=1, max_model_len=1024, blocks=BLOCKS
    )


def full_controller(clock: Clock, **kw: object) -> AdmissionController:
    """63 blocks, headroom 0, 7 requests of 8 blocks in flight: the next one queues."""
    ac = AdmissionController(
        Ledger(BLOCKS, clock=clock),
        clock=clock,
        headroom=0.0,
        **kw,  # type: ignore[arg-type]
    )
    ac.on_snapshot(snapshot(clock))
    for _ in range(7):
        d = ac.try_admit(Ask(proj(), streamed=True))
        assert d is not None and d.admitted
    assert ac.try_admit(Ask(proj(), streamed=True)) is None
    return ac


async def queue(ac: AdmissionController, count: int) -> list[asyncio.Task[Decision]]:
    tasks, depth = [], ac.queue_depth
    for _ in range(count):
        tasks.append(asyncio.ensure_future(ac.wait(Ask(proj(), streamed=True))))
        await asyncio.sleep(0)
    assert ac.queue_depth == depth + count
    return tasks


# --- the controller: what a change does to the requests already queued ------------------------


async def test_a_lower_queue_depth_refuses_the_newest_waiters_with_queue_full() -> None:
    ac = full_controller(Clock(), policy="queue", max_queue_wait=30)
    tasks = await queue(ac, 3)
    changes = tuning.apply(ac, tuning.validate({"max_queue_depth": 1}))
    assert [(c.name, c.old, c.new) for c in changes] == [("max_queue_depth", 256, 1)]
    newest = await asyncio.gather(*tasks[1:])
    assert [d.reason for d in newest] == ["queue_full", "queue_full"]
    assert all(d.retry_after is not None for d in newest)
    assert "shortened to 1" in newest[0].message
    assert not tasks[0].done() and ac.queue_depth == 1
    # the next request is judged by the new depth too
    d = ac.try_admit(Ask(proj(), streamed=True))
    assert d is not None and d.reason == "queue_full"
    ac.fail_queue()
    await tasks[0]


async def test_a_shorter_wait_ends_the_waits_past_it_and_a_longer_one_extends_them() -> None:
    clock = Clock()
    ac = full_controller(clock, policy="queue", max_queue_wait=0.2)
    (old,) = await queue(ac, 1)
    clock.now += 10  # it has waited 10 s by the controller's clock
    (young,) = await queue(ac, 1)
    tuning.apply(ac, tuning.validate({"max_queue_wait": 60}))
    await asyncio.sleep(0.4)  # past the 0.2 s both were queued with
    assert not old.done() and not young.done()
    clock.now += 0.05
    tuning.apply(ac, tuning.validate({"max_queue_wait": 5}))
    d = await asyncio.wait_for(old, 1)  # waited 10.05 s: over 5, ends now
    assert d.reason == "queue_timeout" and d.waited_seconds == pytest.approx(10.05)
    assert not young.done()  # 0.05 s of its 5 s
    clock.now += 4.9
    tuning.apply(ac, tuning.validate({"max_queue_wait": 5.0, "max_queue_depth": 10}))
    await asyncio.sleep(0.02)
    assert not young.done()  # an unchanged wait moves nothing
    tuning.apply(ac, tuning.validate({"max_queue_wait": 4.9}))
    assert (await asyncio.wait_for(young, 1)).reason == "queue_timeout"


async def test_policy_reject_refuses_what_waits_and_observe_forwards_it() -> None:
    ac = full_controller(Clock(), policy="queue", max_queue_wait=30)
    tasks = await queue(ac, 2)
    tuning.apply(ac, tuning.validate({"policy": "reject"}))
    refused = await asyncio.gather(*tasks)
    assert [d.reason for d in refused] == ["kv_cache_full", "kv_cache_full"]
    d = ac.try_admit(Ask(proj(), streamed=True))  # nothing queues any more
    assert d is not None and d.reason == "kv_cache_full"

    tuning.apply(ac, tuning.validate({"policy": "queue"}))
    tasks = await queue(ac, 2)
    in_flight = ac.in_flight
    tuning.apply(ac, tuning.validate({"policy": "observe"}))
    forwarded = await asyncio.gather(*tasks)
    assert [d.outcome for d in forwarded] == [Outcome.ADMIT, Outcome.ADMIT]
    assert ac.in_flight == in_flight + 2 and ac.queue_depth == 0
    assert ac.policy is Policy.observe


async def test_a_smaller_headroom_lets_the_head_of_the_queue_in() -> None:
    clock = Clock()
    ac = AdmissionController(Ledger(BLOCKS, clock=clock), clock=clock, headroom=0.5)
    ac.on_snapshot(snapshot(clock))  # budget 31 blocks
    for _ in range(3):
        d = ac.try_admit(Ask(proj(), streamed=True))
        assert d is not None and d.admitted
    (waiting,) = await queue(ac, 1)
    tuning.apply(ac, tuning.validate({"headroom": 0.05}))  # budget 59
    d = await asyncio.wait_for(waiting, 1)
    assert d.outcome is Outcome.ADMIT and d.reason == "queued"


def test_a_change_is_checked_whole_before_any_of_it_is_made() -> None:
    clock = Clock()
    ac = full_controller(clock)
    before = tuning.current(ac)
    with pytest.raises(tuning.SettingError) as said:
        tuning.validate({"headroom": 0.2, "max_queue_depth": -1})
    assert said.value.name == "max_queue_depth"
    assert said.value.message.startswith("max_queue_depth (--max-queue-depth): Input should be")
    assert tuning.current(ac) == before


# --- the admin API on the metrics port ---------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture
def upstream(model_dir: Path) -> Iterator[FakeServer]:
    with FakeServer(FakeVllm(model_root=model_dir)) as server:
        yield server


def body(max_tokens: int) -> dict[str, object]:
    return {"model": "tiny", "prompt": "hello there", "max_tokens": max_tokens}


async def settings(stack: Stack) -> dict[str, object]:
    return dict((await stack.state())["settings"])


async def test_the_admin_api_refuses_while_off(upstream: FakeServer) -> None:
    async with run_sidecar(upstream) as stack:
        before = await settings(stack)
        for method, payload in (("GET", None), ("PATCH", {"headroom": 0.5}), ("PUT", {})):
            resp = await stack.ops.request(method, "/admin/settings", json=payload)
            error = openai_error(resp, 403, "admin_disabled")
            assert "--admin (KV_SIDECAR_ADMIN=true)" in error["message"]
        assert await settings(stack) == before
        assert stack.sample("kv_sidecar_setting_changes_total", setting="headroom") == 0
        state = await stack.state()
        assert state["admin_enabled"] is False and before["headroom"] == 0.05


async def test_a_patch_applies_to_the_next_decision_and_is_logged_and_exported(
    upstream: FakeServer, caplog: pytest.LogCaptureFixture
) -> None:
    upstream.app.kv_cache_usage = 2 / 63  # vLLM holds 2 blocks the sidecar did not admit
    async with run_sidecar(upstream, admin=True) as stack:
        assert (await stack.client.post("/v1/completions", json=body(900))).status_code == 200
        assert (await stack.state())["budget_blocks"] == 59  # 63 blocks less 5 %
        with caplog.at_level(logging.WARNING, logger="sidecar.admin"):
            resp = await stack.ops.patch(
                "/admin/settings", json={"headroom": 0.9, "policy": "reject"}
            )
        assert resp.status_code == 200, resp.text
        assert resp.json()["changed"] == [
            {"name": "headroom", "old": 0.05, "new": 0.9},
            {"name": "policy", "old": "queue", "new": "reject"},
        ]
        # the budget is 6 blocks now: the same request (8 blocks at its peak) would run only
        # alone, and vLLM holds 2 blocks beside the sidecar
        refused = await stack.client.post("/v1/completions", json=body(900))
        openai_error(refused, 429, "kv_cache_full")
        state = await stack.state()
        assert state["budget_blocks"] == 6
        assert state["settings"] == {
            "headroom": 0.9,
            "max_queue_depth": 256,
            "max_queue_wait": 300.0,
            "spill_wait": 2.0,
            "policy": "reject",
        }
        assert state["refusals_total"] == {"kv_cache_full": 1}
        assert state["refusals_recent"] == {"kv_cache_full": 1}
        assert stack.sample("kv_sidecar_setting", setting="headroom") == 0.9
        assert stack.sample("kv_sidecar_setting_changes_total", setting="headroom") == 1
        assert stack.sample("kv_sidecar_setting_changes_total", setting="max_queue_wait") == 0
        config = {"reservation": "worst-case", "stale_policy": "open"}
        assert stack.sample("kv_sidecar_config_info", policy="reject", headroom="0.9", **config)
        lines = [r for r in caplog.records if r.name == "sidecar.admin"]
        assert [r.fields["setting"] for r in lines] == ["headroom", "policy"]  # type: ignore[attr-defined]
        assert lines[1].fields["old"] == "queue" and lines[1].fields["new"] == "reject"  # type: ignore[attr-defined]
        assert lines[1].fields["client"] == "127.0.0.1"  # type: ignore[attr-defined]
        # a small request that fits the new budget is admitted
        assert (await stack.client.post("/v1/completions", json=body(100))).status_code == 200


@pytest.mark.parametrize(
    ("payload", "param", "said"),
    [
        ({"headroom": 1.5}, "headroom", "headroom (--headroom): Input should be less than 1"),
        ({"max_queue_depth": -1}, "max_queue_depth", "max_queue_depth (--max-queue-depth): "),
        ({"max_queue_wait": "soon"}, "max_queue_wait", "max_queue_wait (--max-queue-wait): "),
        ({"policy": "maybe"}, "policy", "policy (--policy): Input should be 'reject'"),
        ({"port": 1}, "port", "port (--port) cannot change at runtime"),
        ({"headroom": 0.1, "bogus": 1}, "bogus", "no such setting 'bogus'"),
        ({}, None, "no setting given"),
        ([1], None, "the body must be a JSON object"),
    ],
)
async def test_a_bad_change_is_a_400_naming_the_setting_and_changes_nothing(
    upstream: FakeServer, payload: object, param: str | None, said: str
) -> None:
    async with run_sidecar(upstream, admin=True) as stack:
        before = await stack.state()
        resp = await stack.ops.patch("/admin/settings", json=payload)
        error = openai_error(resp, 400, "invalid_setting")
        assert error["param"] == param and error["message"].startswith(said), error
        after = await stack.state()
        assert after["settings"] == before["settings"]
        assert after["budget_blocks"] == before["budget_blocks"]
        for name in tuning.RUNTIME:
            assert stack.sample("kv_sidecar_setting_changes_total", setting=name) == 0


async def test_put_names_every_setting_and_not_json_is_a_400(upstream: FakeServer) -> None:
    async with run_sidecar(upstream, admin=True) as stack:
        resp = await stack.ops.put("/admin/settings", json={"policy": "spill"})
        assert "missing: headroom" in openai_error(resp, 400, "invalid_setting")["message"]
        resp = await stack.ops.patch("/admin/settings", content=b"{headroom")
        openai_error(resp, 400, "invalid_json")
        every = {
            "headroom": 0.1,
            "max_queue_depth": 4,
            "max_queue_wait": 1.5,
            "spill_wait": 0.5,
            "policy": "spill",
        }
        resp = await stack.ops.put("/admin/settings", json=every)
        assert resp.status_code == 200 and resp.json()["settings"] == every
        assert (await stack.ops.get("/admin/settings")).json() == {"settings": every}
        assert stack.sidecar.admission.policy is Policy.spill
        assert stack.sidecar.admission.max_queue_wait == 1.5


async def test_with_a_token_the_admin_api_needs_it(upstream: FakeServer) -> None:
    async with run_sidecar(upstream, admin=True, admin_token="s3cret") as stack:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
            resp = await stack.ops.patch(
                "/admin/settings", json={"max_queue_depth": 3}, headers=headers
            )
            assert "s3cret" not in openai_error(resp, 401, "invalid_admin_token")["message"]
        assert (await settings(stack))["max_queue_depth"] == 256
        resp = await stack.ops.patch(
            "/admin/settings",
            json={"max_queue_depth": 3},
            headers={"authorization": "Bearer s3cret"},
        )
        assert resp.status_code == 200 and (await settings(stack))["max_queue_depth"] == 3
        await eventually(lambda: stack.sidecar.admission.max_queue_depth == 3, "applied", 1)


# --- kv-sidecar status against a real kv-sidecar serve -------------------------------------------


def status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar", "status", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


class _Text(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/plain")
        self.end_headers()
        self.wfile.write(b"hello\n")

    def log_message(self, *args: object) -> None:
        pass


def test_status_prints_a_served_sidecar_and_a_change_applies_to_every_worker(
    upstream: FakeServer,
) -> None:
    upstream.app.max_model_len = 10_000  # room for a sequence over vLLM's pool of 63 blocks
    with SidecarProcess(upstream.url, "--admin", "--workers", "2", "--log-level", "warning") as sc:
        resp = httpx.patch(
            sc.metrics_url + "/admin/settings",
            json={"headroom": 0.9, "max_queue_depth": 7, "max_queue_wait": 12},
            timeout=10,
        )
        assert resp.status_code == 200, resp.text
        # both relay workers ask the owner, who refuses a sequence of 71 blocks (more than the
        # 63 of vLLM's pool): new connections until each worker has taken some (the kernel
        # picks the worker)
        sent = 0
        with httpx.Client(base_url=sc.url, timeout=30) as client:
            for _ in range(40):
                sent += 1
                refused = client.post(
                    "/v1/completions",
                    json=body(9_000),
                    headers={
                        "connection": "close",
                        "x-kv-sidecar-tenant": "etl",
                        "x-kv-sidecar-priority": "5",
                    },
                )
                assert refused.status_code == 413, refused.text
                assert refused.json()["error"]["code"] == "kv_budget_exceeded"
                by_worker = [
                    metric_value(sc.metrics(), "kv_sidecar_relay_worker_requests_total", worker=w)
                    for w in ("0", "1")
                ]
                if all(by_worker):
                    break
            assert all(by_worker), by_worker
        wait_for(
            lambda: (
                metric_value(sc.metrics(), "kv_sidecar_requests_total", reason="too_large") == sent
            ),
            "every refusal reported to the owner",
            10,
        )
        metrics = sc.metrics()
        assert metric_value(metrics, "kv_sidecar_setting", setting="max_queue_depth") == 7
        assert metric_value(metrics, "kv_sidecar_setting_changes_total", setting="headroom") == 1
        proc = status(sc.metrics_url)
        assert proc.returncode == 0, proc.stderr
        out = proc.stdout
        assert out.startswith(f"kv-sidecar at {sc.metrics_url}: ready\n"), out
        lines = {line.split(" ", 1)[0]: line for line in out.splitlines()[1:]}
        assert lines["pool"].startswith("pool      63 blocks; budget 6: 0 committed, 6 free"), out
        assert lines["in"].startswith("in flight 0 requests"), out
        assert lines["queue"] == "queue     empty (limits: 7 requests, 12.0 s)", out
        assert "headroom 0.9," in lines["settings"] and "admin API on" in lines["settings"], out
        assert f"since start: too_large {sent}" in lines["refused"], out
        assert lines["priority"] == f"priority  5: 0 admitted, {sent} refused", out
        assert lines["tenants"] == f"tenants   etl: 0 admitted, {sent} refused", out
        assert "Traceback" not in proc.stderr
        as_json = status(sc.metrics_url.removeprefix("http://"), "--json")
        assert as_json.returncode == 0, as_json.stderr
        assert '"max_queue_depth": 7' in as_json.stdout
        port = sc.metrics_port
    refused = status(f"http://127.0.0.1:{port}")  # stopped: nothing listens there now
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.startswith(
        f"kv-sidecar status: error: cannot reach http://127.0.0.1:{port}/state"
    )
    assert len(refused.stderr.splitlines()) == 1


def test_status_exits_1_in_one_line_on_an_answer_that_is_not_json() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Text)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        proc = status(url)
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == (
        f"kv-sidecar status: error: {url}/state did not answer JSON (status 200): is {url} the "
        "sidecar's metrics port (--metrics-port)?\n"
    )
    bad = status("ftp://127.0.0.1:9091")
    assert (bad.returncode, bad.stdout) == (1, "")
    assert bad.stderr == (
        "kv-sidecar status: error: URL must be the metrics port's http:// or https:// URL, got "
        "'ftp://127.0.0.1:9091'\n"
    )
