"""The relay worker processes: how many, the listening socket they share, and keeping them up.

:func:`worker_count` resolves ``--workers`` (``auto``: the CPUs the container may use).
:func:`listen_socket` binds the proxy port once, in the owner, so that every worker accepts on
the same socket (inherited as a file descriptor) and a replaced worker finds it already bound.
:class:`Supervisor` starts ``python -m sidecar.http.workers.worker`` once per slot and starts a
new one when one exits, until it is stopped. :class:`RelayWorkers` is what the owner holds for
them: the listening socket, the private directory of its own Unix socket, and the supervisor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable

from sidecar.cgroup import available_cpus, cgroup_quota_cores

log = logging.getLogger("sidecar.owner")

#: a worker that exits sooner than this after its start is restarted after a growing pause
_QUICK_EXIT_SECONDS = 5.0
_MAX_RESTART_PAUSE = 5.0
#: prometheus_client's switch for its `_created` series, set for every relay worker
CREATED_SERIES_ENV = "PROMETHEUS_DISABLE_CREATED_SERIES"


def worker_count(
    setting: int | str,
    *,
    quota: Callable[[], float | None] = cgroup_quota_cores,
    cpus: Callable[[], int] = available_cpus,
) -> int:
    """``--workers``: a number, or ``auto``: the container's CPU quota rounded up (capped by
    the CPUs its affinity allows), and 1 where no quota is set. A container without a CPU limit
    gives no bound to size by (its node's CPUs are not the sidecar's), so it stays one process.

    >>> worker_count(3)
    3
    >>> worker_count("auto", quota=lambda: 3.5, cpus=lambda: 16)
    4
    >>> worker_count("auto", quota=lambda: 8.0, cpus=lambda: 2)
    2
    >>> worker_count("auto", quota=lambda: 0.5, cpus=lambda: 16)
    1
    >>> worker_count("auto", quota=lambda: None, cpus=lambda: 64)
    1
    """
    if setting == "auto":
        limit = quota()
        if limit is None:
            return 1
        return max(1, math.ceil(min(limit, float(cpus()))))
    return max(1, int(setting))


def listen_socket(host: str, port: int, backlog: int = 4096) -> socket.socket:
    """The proxy port's listening socket (inheritable, for the workers)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=backlog)
    sock.set_inheritable(True)
    return sock


class Supervisor:
    """Starts the relay workers and replaces any that exits, until :meth:`stop`."""

    def __init__(self, count: int, *, socket_path: str, listen_fd: int) -> None:
        self.count = count
        self.socket_path = socket_path
        self.listen_fd = listen_fd
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.restarts = 0
        self._stopping = False
        self._keepers: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._keepers = [asyncio.ensure_future(self._keep(index)) for index in range(self.count)]

    def pids(self) -> list[int]:
        """The workers' process ids (for the process metrics of the whole tree)."""
        return [proc.pid for proc in list(self.procs.values()) if proc.returncode is None]

    def kill(self, pid: int) -> None:
        """Make sure a worker whose connection closed is gone (its slot then starts anew)."""
        for proc in list(self.procs.values()):
            if proc.pid == pid and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()

    async def _keep(self, index: int) -> None:
        pause = 0.25
        while not self._stopping:
            started = time.monotonic()
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "sidecar.http.workers.worker",
                "--socket",
                self.socket_path,
                "--listen-fd",
                str(self.listen_fd),
                "--index",
                str(index),
                pass_fds=(self.listen_fd,),
                # no `_created` series from prometheus_client there either (as in the owner)
                env={**os.environ, CREATED_SERIES_ENV: "True"},
                # signals to the owner's process group (a terminal's Ctrl-C, a supervisor that
                # signals the group) must not stop the workers before the owner has drained
                start_new_session=True,
            )
            self.procs[index] = proc
            log.info("relay worker %d started (pid %d)", index, proc.pid)
            code = await proc.wait()
            if self._stopping:
                return
            self.restarts += 1
            log.warning(
                "relay worker %d (pid %d) exited with %s; starting a new one", index, proc.pid, code
            )
            if time.monotonic() - started < _QUICK_EXIT_SECONDS:
                await asyncio.sleep(pause)
                pause = min(2 * pause, _MAX_RESTART_PAUSE)
            else:
                pause = 0.25

    async def stop(self, grace_seconds: float = 10.0) -> None:
        """SIGTERM to every worker (each finishes what it relays, briefly), SIGKILL after
        ``grace_seconds``."""
        self._stopping = True
        procs = [proc for proc in self.procs.values() if proc.returncode is None]
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        waits = [asyncio.ensure_future(proc.wait()) for proc in procs]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=grace_seconds)
            for proc in procs:
                if proc.returncode is None:
                    log.warning("relay worker (pid %d) did not stop: killing it", proc.pid)
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
            if pending:
                await asyncio.wait(pending, timeout=2.0)
        for keeper in self._keepers:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper

    def kill_all(self) -> None:
        """A second signal: no waiting."""
        self._stopping = True
        for proc in self.procs.values():
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)


class RelayWorkers:
    """The owner's side of its relay workers: the proxy port bound once (raises OSError when it
    cannot be), a private directory (mode 0700: this user only) for the owner's Unix socket,
    and the :class:`Supervisor` of ``count`` worker processes. :meth:`close` frees the port
    and the directory."""

    def __init__(self, count: int, *, host: str, port: int) -> None:
        self.listener = listen_socket(host, port)
        self.directory = tempfile.mkdtemp(prefix="kv-sidecar-")
        #: the Unix socket the owner serves and the workers connect to
        self.socket_path = os.path.join(self.directory, "owner.sock")
        self.supervisor = Supervisor(
            count, socket_path=self.socket_path, listen_fd=self.listener.fileno()
        )

    @property
    def count(self) -> int:
        return self.supervisor.count

    def close(self) -> None:
        self.listener.close()
        shutil.rmtree(self.directory, ignore_errors=True)
