"""This checkout and this machine: the repository root, the cache, free loopback ports, a GET,
and the chores of a server process the harness starts (wait until healthy, stop its group).

A leaf: it imports nothing from the project, so every other harness module (the vLLM launcher,
the workloads, the benchmark helpers) can share these without importing each other.

    port = free_port()
    body = http_get(f"http://127.0.0.1:{port}/health")
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

#: the repository root (where ``python -m sidecar`` runs from in the harness)
ROOT = Path(__file__).resolve().parent.parent
#: where the harness keeps the vLLM venv, the generated models and the logs
CACHE = Path(os.environ.get("KV_SIDECAR_CACHE", Path.home() / ".cache" / "vllm-kv-sidecar"))


#: ports this process has handed out: never twice, though the first holder may not bind it yet
_HANDED_OUT: set[int] = set()
#: its own generator, so that a test seeding ``random`` cannot replay the ports it picks
_PICK = random.Random()
#: the lowest port picked below the ephemeral range
_LOWEST = 10_000


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (where ``bind(0)`` and every outgoing
    connection's local port come from); Linux's default where it cannot be read."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port free on loopback now, and never handed out before by this process.

    Picked at random below the ephemeral range: a port the OS picks (``bind(0)``) comes from
    that range, and so does the local port of every outgoing connection the tests and their
    servers open, so between this call and the server's bind such a port can be taken, and the
    server (a sidecar's agent port, say) exits on it. Below the range, only another listener
    can take it, and the probe bind sees those."""
    low = _ephemeral_low()
    if low - _LOWEST >= 1000:
        for _ in range(200):
            port = _PICK.randrange(_LOWEST, low)
            if port not in _HANDED_OUT and _bindable(port):
                _HANDED_OUT.add(port)
                return port
    with socket.socket() as s:  # a small or odd range: the OS picks, as before
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    _HANDED_OUT.add(port)
    return port


def http_get(url: str, timeout: float = 5.0) -> bytes:
    """The body of ``GET url`` (raises ``OSError`` on a failure or a non-2xx status)."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return bytes(resp.read())


def log_tail(path: Path | None, n: int = 40) -> str:
    """The last ``n`` lines of a log file ("" when there is none)."""
    if path is None or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


def wait_healthy(
    url: str, proc: subprocess.Popen[bytes] | None, timeout: float, what: str, log: Path | None
) -> None:
    """Poll ``url + /health`` until it answers; raise (with the log's tail) when ``proc`` exits
    or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log_tail(log)}")
        with contextlib.suppress(OSError):
            http_get(url + "/health", timeout=2)
            return
        time.sleep(0.25)
    raise TimeoutError(f"{what} not healthy after {timeout}s:\n{log_tail(log)}")


def stop_group(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM to a started process's group, SIGKILL after 20 s."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
