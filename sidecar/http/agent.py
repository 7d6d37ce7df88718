"""HAProxy's agent-check, served by the sidecar on ``--agent-port`` (deploy/gateway/haproxy.cfg).

HAProxy connects to the agent every ``agent-inter``, reads one ASCII line and closes; the line's
words set the server's weight (``75%``: a share of the weight configured on its ``server`` line),
its administrative state (``ready``, ``drain``, ``maint``) and its operational state (``up``,
``down``). Only the agent can undo what the agent set, so every answer says all of it:

- serving: ``up ready N%``, where N is the share of the admission budget that the projected KV
  leaves free: 100 x (budget - committed - queued) / budget, rounded down, at least 1, at most
  100. ``committed`` is the future peak of the requests in flight (plus what vLLM holds for
  traffic around the sidecar, at least what vLLM holds), the figure admission keeps under the
  budget; ``queued`` the projected peaks of the requests waiting in the sidecar's queue. So N is
  100 x (1 - ``kv_sidecar_kv_demand_ratio``), and with an empty queue
  ``kv_sidecar_kv_headroom_blocks`` over the budget: the figures the autoscalers and the llm-d
  endpoint picker (``kv_sidecar_kv_projected_usage_ratio``, the same committed blocks over the
  capacity) read.
  The floor is 1, not 0: HAProxy takes a server of weight 0 out of the farm, and when every pod
  is full it would answer 503 itself, with no Retry-After; at weight 1 a full pod still gets a
  sliver of the traffic, which its sidecar queues or refuses with 429 and Retry-After, while
  every pod with room gets many times more.
- draining (SIGTERM): ``drain``: HAProxy sends it nothing new, and what runs goes on.
- not ready (vLLM down or unhealthy, its metrics stale, the engine not found yet): ``down #why``,
  so HAProxy stops sending it work at once rather than after its health check's ``fall``
  failures; the next ``up`` brings it back. The space before ``#`` matters: HAProxy 2.6 takes
  ``down#why`` for one unknown word and changes nothing (its stats then say "agent reports an
  error"); ``down #why`` marks the server "DOWN (agent)" and shows "via agent : down (why)".

With relay workers the agent is served by the owner, the process that holds admission. The agent
reads nothing HAProxy sends: leave ``agent-send`` out (unread bytes make the close a reset).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("sidecar")

#: The weight of a pod whose KV budget is spoken for: in the farm, barely.
FLOOR_PERCENT = 1
#: Seconds one check may take (HAProxy's own timeout is ``timeout check``, else ``agent-inter``).
ANSWER_TIMEOUT_SECONDS = 5.0


@dataclass(frozen=True, slots=True)
class Room:
    """What the agent's answer is made of, read from admission and readiness at each check."""

    budget_blocks: int | None  # the blocks admission may promise (None: capacity not known)
    committed_blocks: int  # spoken for by the requests in flight (and vLLM's own)
    queued_blocks: int  # the projected peaks of the requests waiting in the queue
    ready: bool
    draining: bool
    why_not: str = ""  # why not ready (the agent's ``down #`` description)


def weight_percent(budget_blocks: int | None, committed_blocks: int, queued_blocks: int) -> int:
    """The share of the budget left free, in whole percent, from ``FLOOR_PERCENT`` to 100.

    >>> weight_percent(100, 25, 0), weight_percent(100, 25, 50), weight_percent(100, 100, 0)
    (75, 25, 1)
    >>> weight_percent(60, 59, 0), weight_percent(60, 80, 10), weight_percent(None, 5, 0)
    (1, 1, 100)
    """
    if not budget_blocks:  # capacity unknown (or none): admission admits on vLLM's word alone
        return 100
    free = budget_blocks - committed_blocks - queued_blocks
    return max(FLOOR_PERCENT, min(100, 100 * free // budget_blocks))


def _description(why: str) -> str:
    """A ``down #`` description HAProxy reads to the end of the line: printable ASCII only."""
    return re.sub(r"[^\x20-\x7e]+", " ", why).strip()[:120] or "not ready"


def agent_reply(room: Room) -> bytes:
    """The line HAProxy reads.

    >>> agent_reply(Room(100, 25, 0, ready=True, draining=False))
    b'up ready 75%\\n'
    >>> agent_reply(Room(100, 25, 0, ready=False, draining=True))
    b'drain\\n'
    >>> agent_reply(Room(None, 0, 0, ready=False, draining=False, why_not="vLLM\\nunhealthy"))
    b'down #vLLM unhealthy\\n'
    """
    if room.draining:
        return b"drain\n"
    if not room.ready:
        return f"down #{_description(room.why_not)}\n".encode("ascii")
    weight = weight_percent(room.budget_blocks, room.committed_blocks, room.queued_blocks)
    return f"up ready {weight}%\n".encode("ascii")


class AgentServer:
    """The agent's TCP port: one line per connection, then close. Stops when ``should_exit`` is
    set, as the uvicorn servers it runs beside (``sidecar.http.lifecycle.serve_until_stopped``)."""

    def __init__(self, host: str, port: int, room: Callable[[], Room]) -> None:
        self.host = host
        self.port = port
        self.room = room
        self.should_exit = False
        self.force_exit = False
        self.started = False

    async def serve(self) -> None:
        try:
            server = await asyncio.start_server(self._answer, self.host, self.port, backlog=128)
        except OSError as exc:
            log.error("could not bind the agent port %d (--agent-port): %s", self.port, exc)
            return
        self.started = True
        log.info("HAProxy agent-check served on %s:%d", self.host, self.port)
        async with server:
            while not self.should_exit:  # noqa: ASYNC110 - polled, as uvicorn's servers are
                await asyncio.sleep(0.1)
            server.close()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(ANSWER_TIMEOUT_SECONDS):
                writer.write(agent_reply(self.room()))
                await writer.drain()
                writer.close()
                await writer.wait_closed()
        except (OSError, TimeoutError):  # the checker went away: it asks again next time
            writer.transport.abort()
        except Exception:  # never let one check's failure pass unseen, nor take the port down
            log.exception("the agent-check answer failed")
            writer.transport.abort()
