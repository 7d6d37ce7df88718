"""The shipped HAProxy configuration (``deploy/gateway/haproxy.cfg``) run locally: this machine's
HAProxy binary, the file's addresses and ports rewritten for loopback, and its runtime API.

Shared by the test that runs a real HAProxy on the shipped file (``tests/test_haproxy_agent.py``)
and the fleet benchmark's HAProxy gateway (``bench/fleet/haproxy.py``), so that both run the file
as shipped with the same, few changes, made in one place:

- ``bind :8080`` -> ``bind 127.0.0.1:<port>``;
- ``stats socket /run/haproxy/admin.sock`` -> a socket of the caller's (a temporary directory);
- the two shipped ``server`` lines (``pod1``, ``pod2``) -> one line per server the caller names,
  on loopback, each with its sidecar's port, its health check's port (``port``: the sidecar's
  metrics port, for ``/readyz``) and its agent's (``agent-port``), and a ``weight`` of its own
  where the caller gives one (the fleet benchmark's one-server-per-replica layout).

Everything else (the balancing, the health check, the agent and its interval, the retries, the
timeouts) is the shipped file's: the weights and checks are on the shipped ``default-server``
line, which is kept. Each change is checked to match exactly once, and the shipped server lines
to hold nothing but an address and those two ports, so a change to the shipped file that moves
one, or that adds an option to a server line that a rewrite would drop, fails loudly instead of
running something else than what is shipped.

    text = local_config(SHIPPED.read_text(), port, tmp / "admin.sock", {"pod1": (p, m, a)})
    rows = show_stat(tmp / "admin.sock")  # server name -> its ``show stat`` row
"""

from __future__ import annotations

import csv
import io
import re
import shutil
import socket
from collections.abc import Mapping
from pathlib import Path

from harness.local import ROOT

#: the HAProxy configuration the project ships
SHIPPED = ROOT / "deploy" / "gateway" / "haproxy.cfg"
#: the shipped file's backend: its servers are the sidecars
BACKEND = "kv_sidecars"
#: The shipped server lines, each replaced by the caller's: only a name, an address and the two
#: ports (an option added to either would be dropped by the rewrite, so it does not match).
_SHIPPED_SERVERS = re.compile(
    r"(?m)^[ \t]*server pod1 \S+ port \d+ agent-port \d+[ \t]*\n"
    r"[ \t]*server pod2 \S+ port \d+ agent-port \d+[ \t]*$"
)


def haproxy_binary() -> str:
    """The machine's ``haproxy`` (Debian installs it in /usr/sbin, not always on PATH)."""
    found = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        raise RuntimeError("haproxy is not installed (scripts/system-deps.sh)")
    return found


def replace_once(text: str, old: str, new: str) -> str:
    """``text`` with ``old``, which must stand in it exactly once, replaced by ``new``."""
    if text.count(old) != 1:
        raise RuntimeError(f"{SHIPPED}: expected {old!r} exactly once")
    return text.replace(old, new)


def local_config(
    shipped: str,
    port: int,
    socket_path: Path,
    servers: Mapping[str, tuple[int, int, int]],
    weights: Mapping[str, int] | None = None,
) -> str:
    """The shipped file (its text, ``shipped``) listening on ``127.0.0.1:port``, its runtime API
    on ``socket_path``, and its backend's servers ``servers``: name -> (the sidecar's port, its
    metrics port (the health check), its agent port), in that order, all on loopback.
    ``weights``: a server's own ``weight``, where it is not the shipped ``default-server``'s."""
    weights = weights or {}
    text = replace_once(shipped, "bind :8080", f"bind 127.0.0.1:{port}")
    text = replace_once(text, "stats socket /run/haproxy/admin.sock", f"stats socket {socket_path}")
    lines = [
        f"    server {name} 127.0.0.1:{sc_port} port {check_port} agent-port {agent_port}"
        + (f" weight {weights[name]}" if name in weights else "")
        for name, (sc_port, check_port, agent_port) in servers.items()
    ]
    if len(_SHIPPED_SERVERS.findall(text)) != 1:
        raise RuntimeError(
            f"{SHIPPED}: expected the two server lines pod1 and pod2, each with an address, "
            "port and agent-port only"
        )
    return _SHIPPED_SERVERS.sub(lambda _: "\n".join(lines), text)


# --- the runtime API ----------------------------------------------------------------------------


def command(socket_path: Path, line: str) -> str:
    """One command on HAProxy's runtime API (its ``stats socket``), and the whole answer (HAProxy
    closes the connection after it)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(str(socket_path))
        s.sendall(line.encode() + b"\n")
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode()


def show_stat(socket_path: Path, backend: str = BACKEND) -> dict[str, dict[str, str]]:
    """``show stat`` for ``backend``'s servers, by server name: each row as HAProxy's CSV names
    its fields (``status``, ``weight``, ``check_status``, ``agent_status``, ``last_agt``...)."""
    text = command(socket_path, "show stat").lstrip("# ")
    return {
        row["svname"]: row
        for row in csv.DictReader(io.StringIO(text))
        if row["pxname"] == backend and row["svname"] not in ("BACKEND", "FRONTEND")
    }
