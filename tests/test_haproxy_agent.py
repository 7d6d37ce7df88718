"""The HAProxy agent-check the sidecar serves (``--agent-port``, ``sidecar.http.agent``) and the
HAProxy configuration shipped beside nginx's (``deploy/gateway/haproxy.cfg``).

Fast: the weight mapping and the reply line, the agent's port over a real socket, and the
shipped file as this machine's HAProxy (Debian's 2.6) parses it, including the premise its
design rests on: that HAProxy's ``retry-on`` refuses 429.

Real: a real HAProxy process on the shipped file (only its addresses, ports and socket path
changed, by ``harness.haproxy.local_config`` as in the fleet benchmark), two real sidecars in
front of two fake vLLMs, and streams held open through one sidecar so that its KV budget fills:
the weights HAProxy reports on its runtime API follow each sidecar's exported headroom, HAProxy
routes new requests by them, down to the floor of 1% once requests queue, and back; SIGTERM on a
sidecar holding a stream makes HAProxy put it in DRAIN and send new requests to the other; a
sidecar whose vLLM stops answering is marked DOWN by its agent. With relay workers the owner
serves the agent, from the admission state the workers' requests fill. Under ``--policy spill
--spill-status 503`` a request refused by a full sidecar is retried by HAProxy on the other, and
its client gets the 200.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from harness.exposition import metric_value
from harness.fake_vllm import FakeServer, FakeVllm, write_model_dir
from harness.haproxy import SHIPPED as HAPROXY_CFG
from harness.haproxy import command, haproxy_binary, local_config, show_stat
from harness.local import free_port, log_tail
from harness.workload import SidecarProcess
from sidecar.http.agent import AgentServer, Room, agent_reply, weight_percent
from sidecar.http.lifecycle import ReadyCheck
from sidecar.http.seams import Traffic
from tests.support.wait import eventually, wait_for

#: The fake vLLM's pool: 64 blocks of 128 tokens, 63 of them for requests (vLLM's null block);
#: the sidecar's budget is 95% of those, rounded down.
BUDGET = 59
#: One held request: a 1-token prompt ("hi") and max_tokens 1000, reserved to the end in
#: worst-case mode: ceil(1001 / 128) = 8 blocks.
BLOCKS_EACH = 8
HELD_BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 1000, "stream": True}
#: HAProxy's admin state bit for DRAIN set by the agent or the API (SRV_ADMF_FDRAIN).
ADMIN_DRAIN = 0x08
#: What HAProxy 2.6 shows of an agent's "down #vLLM not healthy" (of "down#...": an error).
AGENT_DOWN = "via agent : down (vLLM not healthy)"
#: Generous for a shared 2-core machine: the agent is asked every second.
WITHIN = 30.0


# --- fast: the mapping and the line -------------------------------------------------------------


@pytest.mark.parametrize(
    ("budget", "committed", "queued", "percent"),
    [
        (60, 0, 0, 100),  # empty
        (60, 24, 0, 60),  # 36 of 60 blocks free
        (60, 24, 8, 46),  # the queue's peaks are spoken for too: 28 / 60 = 46.7 -> 46
        (60, 59, 0, 1),  # 1.7% free: rounded down, still at the floor
        (60, 60, 0, 1),  # full: the floor, not 0 (HAProxy drops a weight-0 server)
        (60, 75, 20, 1),  # over the budget (vLLM holds more than predicted)
        (None, 10, 0, 100),  # capacity not known: admission admits on vLLM's word
        (0, 0, 0, 100),
        (1000, 1, 0, 99),
    ],
)
def test_the_weight_is_the_share_of_the_budget_left_free(
    budget: int | None, committed: int, queued: int, percent: int
) -> None:
    assert weight_percent(budget, committed, queued) == percent


def test_the_reply_says_the_state_and_the_weight_in_one_line() -> None:
    serving = Room(60, 24, 0, ready=True, draining=False)
    assert agent_reply(serving) == b"up ready 60%\n"
    # draining wins over everything: HAProxy sends nothing new, what runs finishes
    assert agent_reply(Room(60, 0, 0, ready=False, draining=True)) == b"drain\n"
    assert agent_reply(Room(60, 0, 0, ready=True, draining=True)) == b"drain\n"
    down = agent_reply(Room(60, 0, 0, ready=False, draining=False, why_not="vLLM not healthy"))
    assert down == b"down #vLLM not healthy\n"
    # HAProxy reads to the first CR or LF: a description never ends the line early
    odd = agent_reply(Room(None, 0, 0, ready=False, draining=False, why_not="a\r\nb\x00é"))
    assert odd == b"down #a b\n"
    assert agent_reply(Room(None, 0, 0, ready=False, draining=False)) == b"down #not ready\n"


def test_not_ready_says_why_in_the_order_readiness_checks() -> None:
    """``ReadyCheck.why_not``, the agent's ``down #`` description: empty exactly when ready."""
    traffic = Traffic()
    health = SimpleNamespace(healthy=True)
    scraper = SimpleNamespace(latest=object(), age=lambda: 1.0)
    found: list[bool] = [True]
    workers: list[bool] = [True]
    check = ReadyCheck(
        discovered=lambda: found[0],
        traffic=traffic,
        health=health,
        scraper=scraper,
        stale_after_seconds=5.0,
        discovery_error=lambda: "connect error",
        relays_ready=lambda: workers[0],
    )
    assert check.ready() and check.why_not() == ""
    workers[0] = False
    assert not check.ready() and check.why_not() == "relay workers not ready"
    scraper.age = lambda: 7.4
    assert check.why_not() == "vLLM's metrics 7s old"
    scraper.latest = None
    assert check.why_not() == "no scrape of vLLM's metrics yet"
    health.healthy = False
    assert check.why_not() == "vLLM not healthy"
    found[0] = False
    assert check.why_not() == "engine not found yet: connect error"
    traffic.draining = True
    assert check.why_not() == "draining"


async def test_the_agent_port_answers_each_connection_with_one_line_and_closes() -> None:
    rooms = iter(
        [Room(60, 24, 0, ready=True, draining=False), Room(60, 24, 0, ready=True, draining=True)]
    )
    port = free_port()
    agent = AgentServer("127.0.0.1", port, lambda: next(rooms))
    serving = asyncio.ensure_future(agent.serve())
    try:
        await eventually(lambda: agent.started, "the agent listens")

        async def ask() -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            answer = await reader.read()  # to EOF: the agent closes after its line
            writer.close()
            return answer

        assert await ask() == b"up ready 60%\n"
        assert await ask() == b"drain\n"
    finally:
        agent.should_exit = True
        await asyncio.wait_for(serving, 5)
    assert serving.exception() is None
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


async def test_an_agent_port_that_cannot_be_bound_is_reported_not_started(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        agent = AgentServer("127.0.0.1", port, lambda: Room(None, 0, 0, True, False))
        await asyncio.wait_for(agent.serve(), 5)
    assert not agent.started  # serve_until_stopped then exits 1, as for the other ports
    assert f"could not bind the agent port {port} (--agent-port)" in caplog.text


# --- the shipped file, as Debian's HAProxy reads it -----------------------------------------


def haproxy() -> str:
    try:
        return haproxy_binary()
    except RuntimeError as e:
        pytest.fail(f"{e}: these tests need it")


def _lines(text: str) -> list[str]:
    return [line.split("#", 1)[0].strip() for line in text.splitlines() if line.split("#", 1)[0]]


def _check(cfg: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [haproxy(), "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=30, check=False
    )


def test_the_shipped_haproxy_config_is_valid_and_balances_on_the_agent(tmp_path: Path) -> None:
    done = _check(HAPROXY_CFG)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = _lines(HAPROXY_CFG.read_text())
    assert "balance roundrobin" in lines  # dynamic weights, and no bias for idle servers
    (defaults,) = [line for line in lines if line.startswith("default-server ")]
    words = defaults.split()
    # the agent's N% is a share of the configured weight: 100 makes it N
    assert words[words.index("weight") + 1] == "100"
    assert "agent-check" in words and "check" in words
    servers = [line for line in lines if line.startswith("server ")]
    assert len(servers) == 2
    for server in servers:
        w = server.split()
        assert w[w.index("port") + 1] == "9091"  # the sidecar's metrics port: /readyz
        assert w[w.index("agent-port") + 1] == "9092"
    assert "option httpchk GET /readyz" in lines
    (retry_on,) = [line for line in lines if line.startswith("retry-on ")]
    assert "503" in retry_on.split() and "429" not in retry_on.split()
    assert "option redispatch 1" in lines
    # without it 2.6 does not retry a request whose body came apart from its headers (httpx's)
    assert "option http-buffer-request" in lines


def test_the_kubernetes_form_in_the_shipped_comments_is_valid_too(tmp_path: Path) -> None:
    """The server-template and resolvers lines the config's comments give for Kubernetes
    (deploy/overlays/haproxy), put in place of the two server lines, pass ``haproxy -c``."""
    text = HAPROXY_CFG.read_text()
    (template,) = re.findall(r"(?m)^#\s+(server-template .*)$", text)
    resolvers = re.search(r"(?m)^#\s+(resolvers \S+)\n((?:#\s{8,}\S.*\n)+)", text)
    assert resolvers is not None
    body = "".join("    " + line.lstrip("#").strip() + "\n" for line in resolvers[2].splitlines())
    servers = re.compile(r"(?m)^\s*server pod1 .*\n\s*server pod2 .*\n")
    assert servers.search(text)
    k8s = servers.sub(lambda _: f"    {template}\n", text) + f"\n{resolvers[1]}\n{body}"
    cfg = tmp_path / "k8s.cfg"
    cfg.write_text(k8s)
    done = _check(cfg)
    assert done.returncode == 0, done.stdout + done.stderr + k8s


def test_haproxy_2_6_refuses_to_retry_on_429(tmp_path: Path) -> None:
    """The premise of the shipped config's design: this HAProxy's retry-on has no 429, so the
    agent's weights, not a retry, keep requests off full pods. If a newer HAProxy takes it, this
    fails: then a 429 can be retried as nginx does (deploy/README.md)."""
    version = subprocess.run([haproxy(), "-v"], capture_output=True, text=True, check=True)
    assert re.search(r"HAProxy version 2\.6\.", version.stdout), version.stdout
    text = HAPROXY_CFG.read_text()
    cfg = tmp_path / "retry-429.cfg"
    cfg.write_text(re.sub(r"(?m)^(\s*retry-on) .*$", r"\1 conn-failure 503 429", text))
    done = _check(cfg)
    assert done.returncode != 0
    assert "'retry-on': unknown keyword '429'" in done.stdout + done.stderr


# --- a real HAProxy on the shipped file, two real sidecars --------------------------------------


class Pod:
    """A fake vLLM and a sidecar with its agent, as one pod."""

    def __init__(self, model_dir: Path, *args: str) -> None:
        self.fake = FakeVllm(model_root=model_dir)
        self.fake.token_delay = 1.0  # a held stream stays open for the whole test
        self.server = FakeServer(self.fake).start()
        self.agent_port = free_port()
        self.sidecar = SidecarProcess(
            self.server.url,
            "--agent-port",
            str(self.agent_port),
            "--reservation",
            "worst-case",
            "--policy",
            "queue",
            "--max-queue-wait",
            "120",
            "--drain-timeout",
            "120",
            *args,
        )
        self.held: list[socket.socket] = []

    def hold(self, count: int) -> None:
        """Open ``count`` streamed completions straight to the sidecar, never read them."""
        body = json.dumps(HELD_BODY).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nhost: pod\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode()
        for _ in range(count):
            conn = socket.create_connection(("127.0.0.1", self.sidecar.port), timeout=10)
            conn.sendall(head + body)
            self.held.append(conn)

    def release(self) -> None:
        for conn in self.held:
            conn.close()
        self.held.clear()

    def state(self) -> dict[str, Any]:
        return self.sidecar.state()

    def expected_weight(self) -> int:
        """The weight the exported figures give: the headroom gauge (budget less committed)
        less the queued peaks, over the budget."""
        headroom = metric_value(self.sidecar.metrics(), "kv_sidecar_kv_headroom_blocks")
        state = self.state()
        assert headroom is not None and state["budget_blocks"] == BUDGET, state
        free = int(headroom) - state["peak_blocks_queued"]
        return max(1, 100 * free // state["budget_blocks"])

    def close(self) -> None:
        self.release()
        self.sidecar.stop(signal.SIGKILL)
        self.server.stop()


class HAProxy:
    """The shipped haproxy.cfg run by a real HAProxy, its servers (``pod1``, ``pod2``, as
    shipped) pointed at ``pods``."""

    def __init__(self, tmp_path: Path, pods: list[Pod]) -> None:
        self.pods = pods
        self.port = free_port()
        self.socket_path = tmp_path / "admin.sock"
        servers = {
            f"pod{n}": (pod.sidecar.port, pod.sidecar.metrics_port, pod.agent_port)
            for n, pod in enumerate(pods, start=1)
        }
        self.cfg = tmp_path / "haproxy.cfg"
        self.cfg.write_text(
            local_config(HAPROXY_CFG.read_text(), self.port, self.socket_path, servers)
        )
        self.log_path = tmp_path / "haproxy.log"
        with open(self.log_path, "wb") as log:
            # -db: in the foreground, as in a container
            self.proc = subprocess.Popen(
                [haproxy(), "-db", "-f", str(self.cfg)], stdout=log, stderr=subprocess.STDOUT
            )
        wait_for(self._up, "HAProxy's runtime API answers", WITHIN, step=0.05)

    def _up(self) -> bool:
        assert self.proc.poll() is None, self.log_path.read_text()
        try:
            command(self.socket_path, "show info")
        except OSError:
            return False
        return True

    def servers(self) -> dict[str, dict[str, str]]:
        """``show stat`` and ``show servers state`` merged, per server of the backend."""
        out = show_stat(self.socket_path)
        lines = command(self.socket_path, "show servers state kv_sidecars").splitlines()
        header = lines[1].lstrip("# ").split()
        for line in lines[2:]:
            if line.strip():
                row = dict(zip(header, line.split(), strict=False))
                out[row["srv_name"]].update(row)
        return out

    def wait_checked(self) -> None:
        """Until both servers have passed their first health check and heard their agent (until
        then HAProxy shows them "UP 1/2", and the weight it was configured with)."""

        def checked() -> bool:
            servers = self.servers().values()
            return all(s["status"] == "UP" and s["agent_status"] == "L7OK" for s in servers)

        try:
            wait_for(checked, "both servers checked and their agents heard", WITHIN)
        except AssertionError as e:  # what HAProxy saw of each pod, and whether its sidecar runs
            raise AssertionError(f"{e}\n{self.diagnosis()}") from None

    def diagnosis(self) -> str:
        """Each server's check and agent figures, its sidecar's exit code (None: running) and
        log's tail, and HAProxy's log's tail (its health-check transitions)."""
        keys = ("status", "check_status", "last_chk", "agent_status", "last_agt", "chkfail")
        lines = []
        for (name, row), pod in zip(sorted(self.servers().items()), self.pods, strict=True):
            proc = pod.sidecar.proc
            code = proc.poll() if proc is not None else "not started"
            lines.append(f"{name}: { ({k: row.get(k) for k in keys}) } sidecar exit code {code}")
            lines.append(log_tail(pod.sidecar.log_path, 10))
        return "\n".join([*lines, log_tail(self.log_path, 30)])

    def weights(self) -> tuple[int, int]:
        s = self.servers()
        return int(s["pod1"]["weight"]), int(s["pod2"]["weight"])

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_model_dir(tmp_path / "tiny")


@pytest.fixture
def pods(model_dir: Path) -> Iterator[list[Pod]]:
    made: list[Pod] = []
    try:
        made.extend(Pod(model_dir) for _ in range(2))
        for pod in made:
            pod.sidecar.start()
        yield made
    finally:
        for pod in made:
            pod.close()


@pytest.fixture
def gateway(tmp_path: Path, pods: list[Pod]) -> Iterator[HAProxy]:
    proxy = HAProxy(tmp_path, pods)
    try:
        yield proxy
    finally:
        proxy.close()


def _served_by(pods: list[Pod], before: list[int]) -> list[int]:
    return [len(p.fake.generations()) - b for p, b in zip(pods, before, strict=True)]


def test_haproxy_weights_follow_each_sidecars_kv_headroom(
    pods: list[Pod], gateway: HAProxy
) -> None:
    a, b = pods
    gateway.wait_checked()
    assert gateway.weights() == (100, 100)
    for server in gateway.servers().values():  # READY: no drain, no maint
        assert server["srv_admin_state"] == "0", server

    # three streams held on the first pod: 24 of its 59 blocks spoken for, 59% left
    a.hold(3)
    wait_for(lambda: a.state()["in_flight"] == 3, "three streams admitted", WITHIN)
    assert a.state()["committed_blocks"] == 3 * BLOCKS_EACH
    assert a.expected_weight() == 100 * (BUDGET - 3 * BLOCKS_EACH) // BUDGET == 59
    wait_for(lambda: gateway.weights() == (59, 100), "HAProxy sees 59% and 100%", WITHIN)

    # seven held (56 blocks, 3 free: 5%), then an eighth that must queue: its peak is spoken
    # for too, and the weight drops to the floor
    a.hold(4)
    wait_for(lambda: a.state()["in_flight"] == 7, "seven streams admitted", WITHIN)
    assert a.expected_weight() == 5
    wait_for(lambda: gateway.weights() == (5, 100), "HAProxy sees 5%", WITHIN)
    # and HAProxy routes by them: of 21 small requests through it, the pod at 5% gets about 1
    # (taking turns, it would get 10 or 11); its answers are slow (its fake's 1 s per token)
    b.fake.token_delay = 0.0
    url = f"http://127.0.0.1:{gateway.port}/v1/completions"
    before = [len(p.fake.generations()) for p in pods]
    with httpx.Client(timeout=WITHIN) as client:
        for _ in range(21):
            reply = client.post(url, json={"model": "tiny", "prompt": "hello", "max_tokens": 1})
            assert reply.status_code == 200, reply.text
    to_a, to_b = _served_by(pods, before)
    assert to_a + to_b == 21 and to_a <= 2, (to_a, to_b)
    b.fake.token_delay = 1.0
    wait_for(lambda: a.state()["in_flight"] == 7, "A back to its seven streams", WITHIN)
    wait_for(lambda: gateway.weights() == (5, 100), "HAProxy back at 5% and 100%", WITHIN)
    a.hold(1)
    wait_for(lambda: a.state()["queue_depth"] == 1, "the eighth queued", WITHIN)
    assert a.expected_weight() == 1
    wait_for(lambda: gateway.weights() == (1, 100), "HAProxy sees the floor of 1%", WITHIN)
    # at the floor the pod is still in the farm: UP, not drained
    assert gateway.servers()["pod1"]["status"] == "UP"

    # the weight follows the headroom on the other pod too, independently
    b.hold(2)
    wait_for(lambda: b.state()["in_flight"] == 2, "two streams on the second pod", WITHIN)
    assert b.expected_weight() == 72  # 43 of 59 free
    wait_for(lambda: gateway.weights() == (1, 72), "HAProxy sees 1% and 72%", WITHIN)

    # streams end: the room comes back, and so does the weight
    a.release()
    b.release()
    wait_for(lambda: a.state()["in_flight"] == 0 == a.state()["queue_depth"], "A empty", WITHIN)
    wait_for(lambda: b.state()["in_flight"] == 0, "B empty", WITHIN)
    wait_for(lambda: gateway.weights() == (100, 100), "both back at 100%", WITHIN)


def test_sigterm_makes_haproxy_drain_the_sidecar_and_send_new_work_elsewhere(
    pods: list[Pod], gateway: HAProxy
) -> None:
    b = pods[1]
    gateway.wait_checked()
    assert gateway.weights() == (100, 100)
    # requests through HAProxy reach both pods before the drain (round robin over equal weights)
    url = f"http://127.0.0.1:{gateway.port}/v1/completions"
    small = {"model": "tiny", "prompt": "hello", "max_tokens": 1}
    for pod in pods:
        pod.fake.token_delay = 0.0
    before = [len(p.fake.generations()) for p in pods]
    with httpx.Client(timeout=30) as client:
        for _ in range(8):
            assert client.post(url, json=small).status_code == 200
    assert all(n > 0 for n in _served_by(pods, before)), _served_by(pods, before)

    # one stream held on the second pod keeps its drain going after SIGTERM
    b.fake.token_delay = 1.0
    b.hold(1)
    wait_for(lambda: b.state()["in_flight"] == 1, "a stream held on the second pod", WITHIN)
    assert b.sidecar.proc is not None
    b.sidecar.proc.send_signal(signal.SIGTERM)

    def drained() -> bool:
        pod2 = gateway.servers()["pod2"]
        return bool(int(pod2["srv_admin_state"]) & ADMIN_DRAIN)

    wait_for(drained, "HAProxy puts the draining pod in DRAIN", WITHIN)
    assert gateway.servers()["pod1"]["srv_admin_state"] == "0"
    assert b.sidecar.proc.poll() is None, "the sidecar still drains its stream"
    # new requests go to the other pod only, while the drained one finishes its stream
    before = [len(p.fake.generations()) for p in pods]
    with httpx.Client(timeout=30) as client:
        for _ in range(6):
            assert client.post(url, json=small).status_code == 200
    assert _served_by(pods, before) == [6, 0]
    assert b.state()["in_flight"] == 1
    b.release()
    assert b.sidecar.proc.wait(timeout=WITHIN) == 0


def test_a_sidecar_whose_vllm_stops_is_marked_down_by_its_agent(
    pods: list[Pod], gateway: HAProxy
) -> None:
    a, _ = pods
    gateway.wait_checked()
    assert gateway.weights() == (100, 100)
    a.server.stop()  # vLLM gone: /health fails, the sidecar is not ready

    def down_by_agent() -> bool:
        pod1 = gateway.servers()["pod1"]
        # stopped (op state 0), and the agent's own answer understood, reason and all
        return pod1["srv_op_state"] == "0" and pod1["last_agt"] == AGENT_DOWN

    wait_for(down_by_agent, "HAProxy marks the pod down, with the agent's reason", WITHIN)
    assert gateway.servers()["pod2"]["status"] == "UP"


def test_with_relay_workers_the_owner_serves_the_agent(model_dir: Path) -> None:
    """The workers relay the requests; the owner, which admits them, answers the agent."""
    pod = Pod(model_dir, "--workers", "2")
    try:
        pod.sidecar.start()

        def ask() -> bytes:
            with socket.create_connection(("127.0.0.1", pod.agent_port), timeout=5) as s:
                return s.recv(100)

        wait_for(lambda: ask() == b"up ready 100%\n", "the owner's agent answers", WITHIN)
        pod.hold(3)
        wait_for(lambda: pod.state()["in_flight"] == 3, "three streams admitted", WITHIN)
        assert pod.expected_weight() == 59
        wait_for(lambda: ask() == b"up ready 59%\n", "the agent sees the workers' streams", WITHIN)
        assert pod.sidecar.proc is not None
        pod.sidecar.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: ask() == b"drain\n", "drain on SIGTERM", WITHIN)
    finally:
        pod.close()


def test_a_503_spilled_by_a_full_pod_is_retried_by_haproxy_on_the_other(
    model_dir: Path, tmp_path: Path
) -> None:
    """``--policy spill --spill-status 503`` behind the shipped file: a request the first pod
    would queue for long (its held streams run ~1000 steps of ~1 s) is refused there with the
    503 before its vLLM sees it, HAProxy retries it once on the other pod (``retry-on ... 503``,
    ``option redispatch 1``), and the client gets that pod's 200. The agent's weights send the
    first pod some of them (59 of 159: its three streams leave it 59% of its budget), and each of
    those is answered by the second."""
    made: list[Pod] = []
    gateway: HAProxy | None = None
    try:
        made.extend(Pod(model_dir, "--policy", "spill", "--spill-status", "503") for _ in range(2))
        for pod in made:
            pod.sidecar.start()
        a, b = made
        b.fake.token_delay = 0.0
        gateway = HAProxy(tmp_path, made)
        gateway.wait_checked()
        a.hold(3)
        wait_for(lambda: a.state()["in_flight"] == 3, "three streams on the first pod", WITHIN)
        # five sequences of 8 blocks: 40 do not fit beside the first pod's 24 of 59, and fit
        # in the second's empty pool
        big = {"model": "tiny", "prompt": "hi", "max_tokens": 1000, "n": 5}
        # vLLM's running gauge: with it, the first pod learns its step time from the token
        # counter; until then spill queues (cold), and a probe sent to it straight gives up
        a.fake.running = 3

        def spills_at_once() -> bool:
            direct = f"http://127.0.0.1:{a.sidecar.port}/v1/completions"
            try:
                probe = httpx.post(direct, json=big, timeout=1.0)
            except httpx.TimeoutException:
                return False  # queued, cold: its client gone, it leaves the queue
            return probe.status_code == 503

        wait_for(spills_at_once, "the first pod refuses it at once: its step is known", WITHIN)
        probes = metric_value(
            a.sidecar.metrics(), "kv_sidecar_requests_total", decision="reject", reason="spilled"
        )
        wait_for(lambda: gateway.weights() == (59, 100), "HAProxy sees 59% and 100%", WITHIN)
        before = [len(p.fake.generations()) for p in made]
        url = f"http://127.0.0.1:{gateway.port}/v1/completions"
        with httpx.Client(timeout=WITHIN) as client:
            for _ in range(8):
                reply = client.post(url, json=big)
                assert reply.status_code == 200, reply.text
        assert _served_by(made, before) == [0, 8]
        spilled = metric_value(
            a.sidecar.metrics(), "kv_sidecar_requests_total", decision="reject", reason="spilled"
        )
        assert probes is not None and spilled is not None
        spilled -= probes
        assert spilled >= 1, spilled
        backend = show_stat(gateway.socket_path)["pod1"]
        assert int(backend["wredis"]) == spilled, backend  # each redispatched, once
    finally:
        if gateway is not None:
            gateway.close()
        for pod in made:
            pod.close()
