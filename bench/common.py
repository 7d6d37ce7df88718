"""What the benchmarks share, in one place: the paths a request takes and the load sent down them,
a baseline revision's sidecar, nginx, and the chores of a run on a real vLLM.

No benchmark imports another's module for a helper: what two of them need lives here. The
measurement primitives below these (machine facts, CPU from ``/proc``, tables, the results files)
are :mod:`harness.bench_util`'s, percentiles :mod:`harness.stats`', the fake vLLM
:mod:`harness.fake_vllm_fast`'s.

    with FakeVllmProcess(model) as upstream:
        direct = Target("direct", upstream.url, [upstream.pid])
        warm(direct)
        figures = wrk(direct.url, connections=8, seconds=3, script=wrk_script(path, SMALL_BODY))
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from harness.bench_util import ROOT, ProcStat, children_pids, progress
from harness.local import free_port
from harness.tiny_model import WORDS
from harness.workload import SidecarProcess

T = TypeVar("T")

#: the context of the fast fake vLLM when the benchmark sends 128k-token prompts
LONG_CONTEXT_LEN = 200_000
PROMPT = "Explain in one sentence why a proxy in front of vLLM should count prompt tokens."
#: the small non-streamed completion of the overhead and scaling benchmarks (~20-token prompt)
SMALL_BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0.0}


def rotate(items: Sequence[T], k: int) -> list[T]:
    """``items`` started at its ``k``-th (modulo its length): the order of round ``k``, so that
    the noise of a shared machine hits every path alike."""
    k %= len(items)
    return [*items[k:], *items[:k]]


# --- the paths a request takes, and load down them ----------------------------------------------


@dataclass
class Target:
    """One path a request can take to the upstream, and the processes whose cost we measure."""

    name: str
    url: str
    pids: list[int] = field(default_factory=list)
    script: Path | None = None  # another request body than the common one

    def cpu_seconds(self) -> float:
        total = 0.0
        for pid in self.pids:
            with contextlib.suppress(OSError):
                total += ProcStat(pid).cpu_seconds()
        return total


def warm(target: Target, n: int = 200) -> None:
    """``n`` small completions and one stream through ``target`` (connections, caches, JIT)."""
    with httpx.Client(timeout=60) as client:
        for _ in range(n):
            client.post(target.url + "/v1/completions", json=SMALL_BODY).raise_for_status()
        body = {**SMALL_BODY, "stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", target.url + "/v1/completions", json=body) as resp:
            resp.raise_for_status()
            for _ in resp.iter_raw():
                pass


WRK_LUA = """\
wrk.method = "POST"
wrk.body = {body}
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{{"requests":%d,"duration_us":%d,"status_errors":%d,"other_errors":%d,'
    .. '"p50_us":%d,"p90_us":%d,"p99_us":%d,"mean_us":%.1f,"max_us":%d}}\\n',
    summary.requests, summary.duration, e.status, e.connect + e.read + e.write + e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.mean, latency.max))
end
"""


def wrk_script(path: Path, body: dict[str, Any]) -> Path:
    """A wrk Lua script at ``path`` that POSTs ``body`` and prints its figures as JSON."""
    path.write_text(WRK_LUA.format(body=json.dumps(json.dumps(body))))
    return path


def wrk(url: str, *, connections: int, seconds: float, script: Path) -> dict[str, Any]:
    """One wrk run (its own process, one thread); the figures its Lua ``done`` prints."""
    out = subprocess.run(
        [
            "wrk",
            "-t1",
            f"-c{connections}",
            f"-d{seconds:g}s",
            "--timeout",
            "10s",
            "-s",
            str(script),
            url + "/v1/completions",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = next(ln for ln in reversed(out.splitlines()) if ln.startswith("{"))
    data: dict[str, Any] = json.loads(line)
    data["rps"] = data["requests"] / (data["duration_us"] / 1e6)
    return data


async def stream_once(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> tuple[int, int, float]:
    """Send one raw HTTP/1.1 request on a kept-alive connection and read its answer.

    Returns (SSE events, HTTP chunks, seconds to the first event). A proxy relays each read from
    its upstream as one chunk, so events per chunk tells how much the relay coalesced. A
    length-delimited answer (plain JSON, or an error) is read whole and counts as one chunk.
    """
    t0 = time.perf_counter()
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    status = head.split(b" ", 2)[1]
    if status != b"200":
        raise RuntimeError(f"HTTP {status.decode()}: {head[:200]!r}")
    lower = head.lower()
    if b"transfer-encoding: chunked" not in lower:
        length = int(lower.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        body = await reader.readexactly(length)
        return body.count(b"data:"), 1, time.perf_counter() - t0
    events = 0
    chunks = 0
    first: float | None = None
    tail = b""
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";", 1)[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")  # the empty trailer
            break
        data = await reader.readexactly(size + 2)
        window = tail + data[:-2]
        n = window.count(b"data:")
        if n and first is None:
            first = time.perf_counter() - t0
        events += n
        chunks += 1
        tail = window[-4:]
    return events, chunks, first if first is not None else float("nan")


def make_texts(model_dir: Path, tokens: int, count: int, *, seed: int = 0) -> list[str]:
    """``count`` distinct texts of about ``tokens`` tokens each (cut at a token boundary; the
    counts reported are the sidecar's own)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        words = [str(rng.randint(0, 10**9)), *(rng.choice(WORDS) for _ in range(tokens))]
        ids = tok(" ".join(words), add_special_tokens=False)["input_ids"][:tokens]
        texts.append(str(tok.decode(ids)))
    return texts


# --- nginx --------------------------------------------------------------------------------------


def nginx_binary() -> str:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else "")
    if not found:
        raise RuntimeError("nginx is not installed: scripts/system-deps.sh --bench installs it")
    return found


def nginx_user() -> str:
    """The ``user`` line nginx needs when it runs as root (its workers would be ``nobody``)."""
    return "user root;\n" if os.geteuid() == 0 else ""


def terminate(proc: subprocess.Popen[bytes] | None, timeout: float = 15.0) -> None:
    """SIGTERM a gateway process still running, SIGKILL it after ``timeout`` seconds."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Nginx:
    """nginx in the foreground (``daemon off``) on a free port, with the config ``render`` writes
    for (its directory, its port) in a temp directory; ready once ``ready_path`` answers 200."""

    def __init__(self, render: Callable[[Path, int], str], *, ready_path: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="bench-nginx-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.conf = self.dir / "nginx.conf"
        self.conf.write_text(render(self.dir, self.port))
        self.ready_path = ready_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> Nginx:
        binary = nginx_binary()
        command = [binary, "-c", str(self.conf), "-p", str(self.dir)]
        check = subprocess.run([binary, "-t", *command[1:]], capture_output=True, text=True)
        if check.returncode != 0:
            raise RuntimeError(f"nginx -t failed:\n{check.stderr}")
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + self.ready_path, timeout=5).status_code == 200:
                    return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"nginx did not start: {self.error_log()}")

    def worker_pids(self) -> list[int]:
        return children_pids(self.proc.pid) if self.proc is not None else []

    def error_log(self) -> str:
        path = self.dir / "error.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def access_log(self) -> list[dict[str, str]]:
        """The access log's lines, for a config that logs one JSON object per line."""
        path = self.dir / "access.log"
        if not path.exists():
            return []
        lines = []
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                lines.append(json.loads(line))
        return lines

    def stop(self) -> None:
        terminate(self.proc)  # SIGTERM: nginx's fast shutdown
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Nginx:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- a baseline revision's sidecar --------------------------------------------------------------


@contextlib.contextmanager
def worktree(ref: str) -> Iterator[tuple[Path, str]]:
    """A detached git worktree of ``ref`` in a temporary directory, and the commit it resolved
    to; removed on the way out (``git worktree remove --force``), also when the body fails."""
    rev = subprocess.run(
        ["git", "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if rev.returncode != 0:
        raise SystemExit(f"--baseline {ref}: not a commit in {ROOT}")
    sha = rev.stdout.strip()
    parent = Path(tempfile.mkdtemp(prefix="bench-baseline-"))
    tree = parent / "tree"
    try:
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(tree), sha],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        yield tree, sha
    finally:
        if tree.exists():
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(tree)],
                cwd=ROOT,
                capture_output=True,
            )
        shutil.rmtree(parent, ignore_errors=True)


class BaselineSidecar(SidecarProcess):
    """The sidecar of another revision: the same ``python -m sidecar serve`` command and flags
    as :class:`SidecarProcess`, but run in ``tree`` with ``PYTHONPATH=tree``, so that the
    ``sidecar`` package it imports is the worktree's (``-m`` puts the working directory first on
    ``sys.path``, ahead of the editable install's finder)."""

    def __init__(self, tree: Path, upstream: str, *args: str) -> None:
        super().__init__(upstream, *args, env={"PYTHONPATH": str(tree)}, cwd=tree)
        self.tree = tree

    def verify(self) -> dict[str, Any]:
        """Evidence that the running process is the worktree's code, not this checkout's: its
        cwd and ``PYTHONPATH`` (from /proc), where the same interpreter, cwd and environment
        import ``sidecar.cli`` from, and the source files in the live process's stack
        (``py-spy dump``, where py-spy can attach). Raises when any of them points elsewhere."""
        assert self.proc is not None
        pid = self.proc.pid
        tree = self.tree.resolve()
        cwd = Path(os.readlink(f"/proc/{pid}/cwd")).resolve()
        environ = dict(
            kv.split("=", 1)
            for kv in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
            if "=" in kv
        )
        probe = subprocess.run(
            [sys.executable, "-c", "import sidecar.cli; print(sidecar.cli.__file__)"],
            cwd=self.tree,
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        out: dict[str, Any] = {
            "pid": pid,
            "cwd": str(cwd),
            "pythonpath": environ.get("PYTHONPATH"),
            "imports_sidecar_cli_from": probe,
        }
        problems = []
        if cwd != tree:
            problems.append(f"cwd is {cwd}")
        if environ.get("PYTHONPATH") != str(self.tree):
            problems.append(f"PYTHONPATH is {environ.get('PYTHONPATH')!r}")
        if not Path(probe).resolve().is_relative_to(tree):
            problems.append(f"sidecar.cli imports from {probe}")
        problems += self._stack_problems(pid, tree, out)
        if problems:
            raise RuntimeError(f"baseline sidecar is not the worktree's code: {problems}")
        return out

    @staticmethod
    def _stack_problems(pid: int, tree: Path, out: dict[str, Any]) -> list[str]:
        """The sidecar source files in ``py-spy dump``'s stack of ``pid`` (into ``out``), and
        what is wrong with them; nothing when py-spy cannot attach."""
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            dump = subprocess.run(
                [spy, "dump", "--full-filenames", "--pid", str(pid)],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if dump.returncode == 0:
                ours = sorted(
                    {
                        line.split("(", 1)[1].split(":", 1)[0]
                        for line in dump.stdout.splitlines()
                        if "/sidecar/" in line and "(" in line
                    }
                )
                out["stack_sidecar_files"] = ours
                if not ours:
                    return ["no sidecar frame in py-spy dump"]
                if any(not Path(f).resolve().is_relative_to(tree) for f in ours):
                    return [f"py-spy dump shows sidecar frames outside the tree: {ours}"]
        return []


# --- runs on a real vLLM ------------------------------------------------------------------------

_VLLM_RE = {
    name: re.compile(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.eE+-]+)$", re.M)
    for name in (
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_preemptions_total",
    )
}


def read_vllm(text: str) -> dict[str, float]:
    """The gauges a run samples from vLLM's /metrics (summed over engines), by short name."""
    return {
        name.split(":")[1]: sum(float(v) for v in rx.findall(text)) for name, rx in _VLLM_RE.items()
    }


def reset_prefix_cache(url: str) -> None:
    """Empty vLLM's prefix cache between runs (served in its dev mode only)."""
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(url + "/reset_prefix_cache", timeout=30)


def wait_idle(*urls: str, timeout: float = 120.0) -> None:
    """Until no vLLM at ``urls`` runs or queues a request (a /metrics that fails: not idle), or
    ``timeout`` has passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = 0.0
        for url in urls:
            try:
                m = read_vllm(httpx.get(url + "/metrics", timeout=5).text)
            except httpx.HTTPError:
                busy += 1
                continue
            busy += m["num_requests_running"] + m["num_requests_waiting"]
        if not busy:
            return
        time.sleep(0.5)


def queue_flags(policy: str, reservation: str | None = None) -> list[str]:
    """The flags a benchmark runs a sidecar with: the ``policy`` (and ``reservation``, else the
    default), a queue long and deep enough that the run measures admission rather than the
    queue's limits, and the info log that says the tokenizer is loaded (:func:`wait_tokenizer`)."""
    flags = ["--policy", policy]
    if reservation is not None:
        flags += ["--reservation", reservation]
    return [*flags, "--max-queue-wait", "600", "--max-queue-depth", "1024", "--log-level", "info"]


def wait_tokenizer(sidecar: SidecarProcess, timeout: float = 120.0) -> None:
    """Wait until the sidecar has loaded the model's tokenizer.

    /readyz says ready before the tokenizer (loaded in a background thread, seconds) is there; the
    load holds the GIL in long stretches, and requests that arrive meanwhile were seen to wait
    seconds. A sidecar in production has long finished loading when traffic peaks, so the
    workload starts after it.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = sidecar.log()
        if "loaded the tokenizer" in log or "cannot load the tokenizer" in log:
            return
        time.sleep(0.2)
    progress("the sidecar did not report its tokenizer loaded; starting anyway")


def warm_up_vllm(url: str) -> None:
    """A throwaway mix of requests on a fresh vLLM before the first measured run.

    The first traffic on a fresh vLLM CPU server was seen to stall every stream for seconds;
    without a warm-up the first configuration of the first workload pays for it alone."""
    rng = random.Random(3)

    async def one_warm(client: httpx.AsyncClient, i: int) -> None:
        await asyncio.sleep(i * 0.1)
        words = " ".join(rng.choice(WORDS) for _ in range(rng.choice((20, 100, 250, 500))))
        common: dict[str, Any] = {
            "model": "tiny",
            "max_tokens": rng.randint(16, 200),
            "ignore_eos": True,
            "stream": i % 4 != 0,
        }
        body: dict[str, Any]
        if i % 3 == 0:
            path = "/v1/chat/completions"
            body = {"messages": [{"role": "user", "content": words}]}
        else:
            path, body = "/v1/completions", {"prompt": words}
        if i == 5:
            # no seed: vLLM 0.32's CPU build dies when it preempts a seeded request
            body.update(n=2, temperature=1.0)
        with contextlib.suppress(httpx.HTTPError):
            await client.post(url + path, json={**common, **body})

    async def go() -> None:
        async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
            await asyncio.gather(*(one_warm(client, i) for i in range(32)))

    asyncio.run(go())


def retry_delay(headers: httpx.Headers, retries: int, rng: random.Random) -> float:
    """The openai client's rule: the server's hint when given (<= 60 s), else backoff."""
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is not None:
            with contextlib.suppress(ValueError):
                seconds = float(value) * scale
                if 0 <= seconds <= 60:
                    return seconds
    return float(min(0.5 * 2 ** (retries - 1), 8.0) * (1 - 0.25 * rng.random()))
