"""The values that cross admission's seam: what a request asks (:class:`Ask`), and the state
admission reports (:class:`KVState`).

An :class:`Ask` is built once on the request path and passed whole: to the gate, over the wire to
the relay workers' owner, into the queue and the Retry-After planner. A new property of a request
(a priority, a tenant, a deadline) is one field here.

>>> from sidecar.kv.geometry import UniformBlocks
>>> from sidecar.kv.projection import project_counts
>>> p = project_counts((200,), requested_max_tokens=100, n=1, max_model_len=1024,
...                    blocks=UniformBlocks(128))
>>> Ask(p, streamed=True, klass="chat").pinnable
True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from sidecar.kv.prefix import BlockHashes
from sidecar.kv.projection import Projection


@dataclass(frozen=True, slots=True)
class Ask:
    """What a request asks of the KV cache, before it is placed in a pool."""

    projection: Projection
    streamed: bool
    klass: str = ""  # the request class its answer length is learned in
    prefix: tuple[BlockHashes, ...] | None = None  # full prompt blocks' chain hashes, per prompt
    pin: str | None = None  # the engine the client chose (its X-data-parallel-rank header)
    pinnable: bool = True  # its endpoint lets the sidecar choose the engine
    key: int | None = None  # the request's fingerprint (its body's digest): a retry is known
    priority: int = 0  # lower first, as vLLM orders its ``priority`` field
    tenant: str = ""  # whose fair share of the KV cache it draws on


@dataclass(frozen=True, slots=True)
class KVState:
    """A consistent view of the figures the exporter and /state report, in blocks."""

    capacity_blocks: int | None
    budget_blocks: int | None
    reserved_blocks: int  # the sum of the in-flight requests' reserved peaks
    future_peak_blocks: int  # the peak over the future of their sum (what admission checks)
    worst_case_peak_blocks: int  # the same with every request running to max_tokens
    predicted_blocks: int
    shared_blocks: int  # prompt blocks running requests share (held once by vLLM)
    actual_blocks: int | None
    external_blocks: int
    committed_blocks: int
    peak_blocks_in_flight: int
    peak_blocks_queued: int
    in_flight: int
    queue_depth: int
    snapshot_age: float | None  # seconds since the last good scrape (None: none yet)
    # the ledger at the instant of the last scrape, to compare with what vLLM reported then
    predicted_at_snapshot_blocks: int | None
    in_flight_at_snapshot: int
    preemptions_seen: float = 0.0  # vLLM's preemptions since the sidecar started
    #: placements adaptive mode's spread ends allowed where the laid-out peak did not
    spread_admitted: int = 0
    #: output tokens expected mode reserves per sequence, per request class that has learned a
    #: length (empty in worst-case mode)
    expected_output_tokens: Mapping[str, int] = field(default_factory=dict)
    # the engine's learned costs (the first pool's; ``sidecar.admission.costs``), None unmeasured
    decode_step_seconds: float | None = None
    step_seconds_per_token: float | None = None  # what a prompt token computed adds to a step
    step_seconds_per_sequence: float | None = None  # what a decode sequence adds to a step
    prefill_tokens_per_step: float | None = None
    step_fixed_share: float | None = None
    batch_gain_steps_per_token: float | None = None
    #: seconds of prefill forwarded and not yet presumed done, summed over the engines
    #: (``sidecar.admission.pacing``: what ``--priority-pace`` holds positive priorities to)
    prefill_backlog_seconds: float = 0.0
    #: the most tokens per sequence a stream's visible progress was behind vLLM's lately, the
    #: most over the engines (``sidecar.kv.lag``: worst-case mode lays that out as held)
    stream_lag_tokens: float = 0.0
    # per priority and tenant (``sidecar.admission.class_stats``: bounded labels)
    #: (priority, tenant, decision) -> requests decided since the sidecar started
    class_decisions: Mapping[tuple[str, str, str], int] = field(default_factory=dict)
    #: priority -> (seconds waited in the queue, requests that waited), since it started
    class_waited: Mapping[str, tuple[float, int]] = field(default_factory=dict)
    #: (priority, tenant) -> requests queued now
    class_queued: Mapping[tuple[str, str], int] = field(default_factory=dict)
    #: priority -> seconds its longest-waiting queued request has waited (queued ones only)
    class_oldest_wait: Mapping[str, float] = field(default_factory=dict)
