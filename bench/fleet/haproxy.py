"""HAProxy in the fleet benchmark (``sidecar-queue-haproxy``): the shipped
``deploy/gateway/haproxy.cfg``, rewritten only where a bench run must differ, run by the
machine's HAProxy; its log read into the lines the figures read from nginx's, and its runtime
API sampled for the weights the sidecars' agents set.

What :func:`haproxy_conf` changes in the shipped file, and nothing else (each change is checked
to match exactly once, so a change to the shipped file that moves one fails the run loudly; all
but the id capture are :func:`harness.haproxy.local_config`'s, the rewrite the test of the
shipped file runs too):

- ``bind :8080`` -> ``bind 127.0.0.1:<free port>``;
- ``stats socket /run/haproxy/admin.sock`` -> a socket in the run's temporary directory;
- the frontend captures the ``x-bench-id`` request header (``capture request header``), so the
  shipped ``option httplog`` line names the request it logs (the log target, ``log stdout``, is
  kept: stdout goes to a file);
- the two ``server`` lines (``pod1``, ``pod2``) become the replicas' servers, in one of two
  layouts (``LAYOUTS``, ``bench.fleet --haproxy-layout``):

  - ``entries`` (the default): one server per unit of nginx's weight: ``A1``, ``A2``, ``A3`` for
    replica A's sidecar and ``B1`` for B's, each with the shipped ``default-server`` (``weight
    100``, the agent on, ``agent-inter 1s``). HAProxy's weights stop at 256 and the agent's
    ``N%`` scales the configured weight (its floor, 1%, of a weight under 100 is 0, which takes a
    server out of the farm), so 3:1 is three servers of weight 100 against one: the same arrivals
    as nginx's ``weight=3`` / ``weight=1`` while the agents say 100%, and only the agents'
    weights can undo the skew. A request that one of A's servers refuses with a 503 is retried
    once on another server (``option redispatch``), which is often another of A's.
  - ``weights``: one server per replica, as a deployment has one per pod (``A`` and ``B``), the
    3:1 in their own ``weight`` (255 and 85: ``WEIGHT_UNIT`` per unit of nginx's). The retry of a
    503 from A goes to the other server there is, B; the price is that B's weight at the agent's
    1% floor is 0 (85 x 1%), so a nearly full B is out of the farm.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import terminate
from harness.haproxy import SHIPPED, haproxy_binary, local_config, replace_once, show_stat
from harness.local import free_port

#: the servers' layouts (``bench.fleet --haproxy-layout``; the module's docstring)
LAYOUTS = ("entries", "weights")
#: ``weights`` layout: a server's configured weight per unit of nginx's (3:1 -> 255 and 85, under
#: HAProxy's cap of 256)
WEIGHT_UNIT = 85


def server_names(weights: dict[str, int], layout: str = "entries") -> dict[str, str]:
    """HAProxy server name -> replica: ``weights[r]`` servers per replica (``A1``, ``A2``...), or
    one per replica, named as it is, in the ``weights`` layout."""
    if layout == "weights":
        return {name: name for name in weights}
    return {f"{name}{i}": name for name, w in weights.items() for i in range(1, w + 1)}


def configured_weights(weights: dict[str, int], layout: str = "entries") -> dict[str, int]:
    """Each replica's configured weight, summed over its servers (the agents' 100%)."""
    unit = WEIGHT_UNIT if layout == "weights" else 100
    return {name: unit * w for name, w in weights.items()}


def haproxy_conf(
    shipped: str,
    port: int,
    socket_path: Path,
    backends: dict[str, tuple[int, int, int]],
    weights: dict[str, int],
    layout: str = "entries",
) -> str:
    """The shipped file with the bench's address, socket, id capture and servers.

    ``backends``: replica -> (sidecar port, its metrics port (health check), its agent port)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown HAProxy layout {layout!r}; one of {', '.join(LAYOUTS)}")
    text = replace_once(
        shipped,
        "    default_backend kv_sidecars",
        "    capture request header x-bench-id len 16\n    default_backend kv_sidecars",
    )
    names = server_names(weights, layout)
    servers = {server: backends[replica] for server, replica in names.items()}
    own = configured_weights(weights, layout) if layout == "weights" else {}
    return local_config(text, port, socket_path, servers, own)


# --- the log ------------------------------------------------------------------------------------

# ``option httplog`` in 2.6: %ci:%cp [%tr] %ft %b/%s %TR/%Tw/%Tc/%Tr/%Ta %ST %B %CC %CS %tsc
# %ac/%fc/%bc/%sc/%rc %sq/%bq %hr %hs %{+Q}r (%hr: the captured request headers, in braces)
HTTPLOG = re.compile(
    r"^(?P<client>\S+) \[(?P<accepted>[^\]]+)\] (?P<frontend>\S+) "
    r"(?P<backend>[^/\s]+)/(?P<server>\S+) "
    r"(?P<TR>-?\d+)/(?P<Tw>-?\d+)/(?P<Tc>-?\d+)/(?P<Tr>-?\d+)/(?P<Ta>\+?-?\d+) "
    r"(?P<status>-?\d+) (?P<bytes>\+?\d+) \S+ \S+ (?P<term>\S{4}) "
    r"(?P<ac>\d+)/(?P<fc>\d+)/(?P<bc>\d+)/(?P<sc>\d+)/(?P<retries>\+?\d+) "
    r"(?P<sq>\d+)/(?P<bq>\d+) (?:\{(?P<id>[^}]*)\} )?(?:\{[^}]*\} )?\"(?P<request>[^\"]*)\""
)


def parse_log(text: str) -> list[dict[str, str]]:
    """HAProxy's httplog lines, as the fields the figures read from nginx's log: ``id``,
    ``status``, ``upstream`` (the server that answered, the last tried), ``upstream_status``
    (its status: HAProxy logs one per request), and HAProxy's own: ``retries`` (``%rc``; ``+``
    first when redispatched to another server), ``term`` (its termination state), ``Tw``
    (ms in its queue), ``Ta`` (ms in all), ``line`` (the line as logged). Lines that are not
    request logs (start-up notices, agent state changes) are left out.

    >>> line = ('127.0.0.1:51214 [04/Dec/2026:19:11:16.396] llm kv_sidecars/B1 '
    ...         '0/0/1/170/24113 200 100986 - - ---- 10/10/9/1/0 0/0 {4} '
    ...         '"POST /v1/completions HTTP/1.1"')
    >>> [(x["id"], x["status"], x["upstream"], x["retries"]) for x in parse_log(line)]
    [('4', '200', 'B1', '0')]
    >>> retried = line.replace("B1", "A2").replace(" 200 ", " 429 ").replace("/0 0/0", "/+1 0/0")
    >>> [(x["id"], x["status"], x["upstream"], x["retries"]) for x in parse_log(retried)]
    [('4', '429', 'A2', '+1')]
    >>> parse_log("[WARNING]  (1) : Server kv_sidecars/A1 is UP, reason: Layer7 check passed")
    []
    """
    out = []
    for line in text.splitlines():
        m = HTTPLOG.match(line.strip())
        if m is None:
            continue
        out.append(
            {
                "id": m["id"] or "",
                "status": m["status"],
                "upstream": m["server"],
                "upstream_status": m["status"],
                "retries": m["retries"],
                "term": m["term"],
                "Tw": m["Tw"],
                "Ta": m["Ta"],
                "line": line.strip(),
            }
        )
    return out


# --- the process --------------------------------------------------------------------------------


class HAProxy:
    """HAProxy in the foreground (``-db``) on the bench's rewrite of the shipped file."""

    def __init__(
        self,
        backends: dict[str, tuple[int, int, int]],
        weights: dict[str, int],
        layout: str = "entries",
    ) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="bench-haproxy-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.socket_path = self.dir / "admin.sock"
        self.servers = server_names(weights, layout)
        self.conf = self.dir / "haproxy.cfg"
        self.conf.write_text(
            haproxy_conf(
                SHIPPED.read_text(), self.port, self.socket_path, backends, weights, layout
            )
        )
        self.log_path = self.dir / "haproxy.log"
        self.err_path = self.dir / "haproxy.err"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> HAProxy:
        binary = haproxy_binary()
        check = subprocess.run(
            [binary, "-c", "-f", str(self.conf)], capture_output=True, text=True, timeout=30
        )
        if check.returncode != 0:
            raise RuntimeError(f"haproxy -c failed:\n{check.stdout}{check.stderr}")
        with open(self.log_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                [binary, "-db", "-f", str(self.conf)], stdout=out, stderr=err
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"haproxy exited {self.proc.returncode}: {self.errors()}")
            with contextlib.suppress(OSError, KeyError, ValueError):
                if self.checked():
                    return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"haproxy's servers not checked in {timeout}s: {self.errors()}")

    def checked(self) -> bool:
        """Every server UP, its health check passed and its agent heard (until then HAProxy
        shows the configured weight, not the agent's)."""
        rows = self.stat()
        return set(rows) == set(self.servers) and all(
            r["status"] == "UP" and r["check_status"] == "L7OK" and r["agent_status"] == "L7OK"
            for r in rows.values()
        )

    def stat(self) -> dict[str, dict[str, str]]:
        """``show stat`` for the backend's servers, by server name."""
        return show_stat(self.socket_path)

    def sample(self) -> dict[str, Any]:
        """What the sampler keeps of ``show stat``: per server its weight (the agent's), state,
        agent status and last answer, and the streams it holds (``scur``)."""
        out: dict[str, Any] = {}
        for name, row in self.stat().items():
            out[name] = {
                "weight": int(row["weight"]) if row["weight"].isdigit() else None,
                "status": row["status"],
                "agent": row.get("last_agt", ""),
                "scur": int(row["scur"]) if row["scur"].isdigit() else None,
            }
        return out

    def errors(self) -> str:
        return self.err_path.read_text(errors="replace") if self.err_path.exists() else ""

    def access_log(self) -> list[dict[str, str]]:
        return (
            parse_log(self.log_path.read_text(errors="replace")) if self.log_path.exists() else []
        )

    def stop(self) -> None:
        terminate(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)
