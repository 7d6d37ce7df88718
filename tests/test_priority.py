"""Priority classes and tenant fair share in the pure core: who is admitted first when KV is
short, who is refused to make room, and how a request's priority and tenant are read.

The pool is 64 blocks of 128 tokens (a budget of 63, no headroom); each request of 271 prompt
and 700 output tokens reaches 8 blocks, so 7 run at once and the rest queue."""

from __future__ import annotations

import asyncio
import json

import pytest

from harness.fake_vllm import FakeServer, FakeVllm
from sidecar.admission.ask import Ask
from sidecar.admission.classes import classify, key_digest
from sidecar.admission.controller import AdmissionController
from sidecar.admission.decisions import Decision, Outcome
from sidecar.admission.tuning import apply, oldest_wait
from sidecar.config import Settings, parse_priority_rules, parse_tenant_shares
from sidecar.errors import BadRequest
from sidecar.kv.geometry import UniformBlocks
from sidecar.kv.ledger import Ledger, Reservation
from sidecar.kv.projection import Projection, project_counts
from tests.support.openai_errors import openai_error
from tests.support.snapshots import Clock, snapshot
from tests.support.stack import run_sidecar

BLOCKS = UniformBlocks(128)


def proj(prompt: int = 271, max_tokens: int = 700) -> Projection:
    return project_counts(
        (prompt,), requested_max_tokens=max_tokens, n=1, max_model_len=1024, blocks=BLOCKS
    )


def controller(clock: Clock, **kw: object) -> AdmissionController:
    ac = AdmissionController(Ledger(BLOCKS, clock=clock), clock=clock, headroom=0.0, **kw)  # type: ignore[arg-type]
    ac.on_snapshot(snapshot(clock))
    return ac


def fill(ac: AdmissionController, n: int = 7, tenant: str = "") -> list[Reservation]:
    """Admit ``n`` requests at once (7 fill the budget)."""
    out = []
    for _ in range(n):
        d = ac.try_admit(Ask(proj(), streamed=True, tenant=tenant))
        assert d is not None and d.reservation is not None, d
        out.append(d.reservation)
    return out


class Waiting:
    """Queued requests, each a task, named so that the order they are admitted in is known."""

    def __init__(self, ac: AdmissionController) -> None:
        self.ac = ac
        self.order: list[str] = []
        self.tasks: dict[str, asyncio.Task[Decision]] = {}
        self.reservations: dict[str, Reservation] = {}

    async def queue(self, name: str, *, priority: int = 0, tenant: str = "") -> None:
        ask = Ask(proj(), streamed=True, priority=priority, tenant=tenant)
        assert self.ac.try_admit(ask) is None, f"{name} should queue"

        async def wait() -> Decision:
            d = await self.ac.wait(ask)
            if d.admitted:
                self.order.append(name)
                assert d.reservation is not None
                self.reservations[name] = d.reservation
            return d

        self.tasks[name] = asyncio.create_task(wait())
        await asyncio.sleep(0)

    async def free_one(self, res: Reservation) -> None:
        self.ac.release(res)
        for _ in range(3):
            await asyncio.sleep(0)


@pytest.mark.parametrize(
    ("queued", "admitted"),
    [
        # (name, priority) in arrival order -> the order they are admitted in
        ([("a", 0), ("b", 0), ("c", 0)], ["a", "b", "c"]),  # one priority: first come first
        ([("low", 10), ("high", 0), ("mid", 5)], ["high", "mid", "low"]),
        ([("x", 5), ("urgent", -1), ("y", 5), ("z", 0)], ["urgent", "z", "x", "y"]),
    ],
)
async def test_the_best_priority_is_admitted_first_then_arrival(
    queued: list[tuple[str, int]], admitted: list[str]
) -> None:
    clock = Clock()
    ac = controller(clock)
    running = fill(ac)
    w = Waiting(ac)
    for name, priority in queued:
        await w.queue(name, priority=priority)
    for res in running[: len(queued)]:
        await w.free_one(res)  # each release frees one request's room: one is admitted
    assert w.order == admitted
    assert len(ac.queue) == 0


async def test_a_higher_priority_arrival_goes_ahead_of_the_queue_but_not_of_its_own_band() -> None:
    clock = Clock()
    ac = controller(clock)
    running = fill(ac)  # 56 of 63 blocks: room for 7
    queued = Ask(proj(), streamed=True)  # 8 blocks: does not fit
    assert ac.try_admit(queued) is None
    task = asyncio.create_task(ac.wait(queued))
    await asyncio.sleep(0)
    small = proj(prompt=100, max_tokens=100)  # 2 blocks: fits
    # a same-priority request that fits must not pass the queued one (it would starve it)
    assert ac.try_admit(Ask(small, streamed=True)) is None
    # a better priority that fits is admitted at once
    urgent = ac.try_admit(Ask(small, streamed=True, priority=-5))
    assert urgent is not None and urgent.admitted
    ac.release(running[0])
    assert (await asyncio.wait_for(task, 1)).admitted


async def test_inside_a_priority_the_tenant_with_less_use_of_the_kv_cache_goes_first() -> None:
    """Tenant "batch" holds the whole pool and has queued first; "chat" queues after it. Each
    release admits chat's request before batch's older ones, by block-seconds, not count."""
    clock = Clock()
    ac = controller(clock)
    running = fill(ac, tenant="batch")
    clock.now += 5  # batch has held 56 blocks for 5 s
    w = Waiting(ac)
    await w.queue("batch-1", tenant="batch")
    await w.queue("batch-2", tenant="batch")
    await w.queue("chat-1", tenant="chat")
    await w.queue("chat-2", tenant="chat")
    await w.free_one(running[0])
    await w.free_one(running[1])
    assert w.order == ["chat-1", "chat-2"]
    await w.free_one(running[2])
    assert w.order == ["chat-1", "chat-2", "batch-1"]


async def test_shares_weigh_the_tenants_use() -> None:
    """Both tenants hold the same blocks for the same time; "gold" has three times the share,
    so its queued request is admitted first although "free"'s came first."""
    clock = Clock()
    ac = controller(clock, tenant_shares=parse_tenant_shares("gold=3"))
    held = fill(ac, 3, tenant="free") + fill(ac, 3, tenant="gold") + fill(ac, 1, tenant="other")
    clock.now += 10
    w = Waiting(ac)
    await w.queue("free", tenant="free")
    await w.queue("gold", tenant="gold")
    await w.free_one(held[-1])
    assert w.order == ["gold"]


BATCH = 10  # a positive priority: below vLLM's default, kept out of --priority-reserve


def admit_all(ac: AdmissionController, priority: int, n: int) -> list[Reservation | None]:
    """Try ``n`` requests of ``priority`` at once; each one's reservation, None where it waits."""
    out = []
    for _ in range(n):
        d = ac.try_admit(Ask(proj(), streamed=True, priority=priority))
        out.append(None if d is None else d.reservation)
    return out


@pytest.mark.parametrize(
    ("reserve", "batch_admitted", "chat_admitted"),
    [
        (0.0, 7, False),  # no reserve: the batch burst takes every block, the chat waits
        (0.1, 7, False),  # 6 blocks kept: 7 x 8 = 56 still leaves them free, the chat needs 8
        (0.25, 6, True),  # 15 kept: the seventh batch request waits, the chat goes at once
        (0.5, 4, True),  # 31 kept: 4 x 8 = 32 <= 63 - 31, a fifth would pass it
    ],
)
async def test_the_priority_reserve_keeps_room_for_priority_zero_beside_a_batch_burst(
    reserve: float, batch_admitted: int, chat_admitted: bool
) -> None:
    clock = Clock()
    ac = controller(clock, priority_reserve=reserve)
    batch = admit_all(ac, BATCH, 8)
    assert sum(r is not None for r in batch) == batch_admitted
    assert ac.reserve_blocks(ac.pools[0], BATCH) == int(63 * reserve)
    chat = ac.try_admit(Ask(proj(), streamed=True, priority=0))
    assert (chat is not None and chat.admitted) is chat_admitted


async def test_what_priority_zero_holds_counts_against_the_reserve_until_it_ends() -> None:
    clock = Clock()
    ac = controller(clock, priority_reserve=0.25)  # 15 of the 63 blocks kept
    chats = admit_all(ac, 0, 2)  # 16 blocks: the reserve is used up by those it is for
    assert all(chats) and ac.reserve_blocks(ac.pools[0], BATCH) == 0
    assert ac.reserve_blocks(ac.pools[0], 0) == 0  # never held from priority 0 itself
    batch = admit_all(ac, BATCH, 6)
    assert sum(r is not None for r in batch) == 5  # 16 + 5 x 8 = 56; a sixth would be 64
    first = chats[0]
    assert first is not None
    ac.release(first)
    assert ac.reserve_blocks(ac.pools[0], BATCH) == 15 - 8  # the other chat still holds 8
    # 48 held, 7 kept: one batch request takes 8 of the 15 free, a second would eat the reserve
    again = ac.try_admit(Ask(proj(), streamed=True, priority=BATCH))
    assert again is not None and again.admitted
    assert ac.try_admit(Ask(proj(), streamed=True, priority=BATCH)) is None


async def test_a_better_priority_than_zero_uses_the_reserve_and_an_empty_pool_takes_anyone() -> (
    None
):
    clock = Clock()
    ac = controller(clock, priority_reserve=0.9)  # 56 of 63 kept: one batch request is 8
    alone = ac.try_admit(Ask(proj(), streamed=True, priority=BATCH))
    assert alone is not None and alone.admitted  # nothing else runs: the reserve holds nothing
    assert ac.try_admit(Ask(proj(), streamed=True, priority=BATCH)) is None
    urgent = ac.try_admit(Ask(proj(), streamed=True, priority=-3))
    assert urgent is not None and urgent.admitted


async def test_a_batch_requests_wait_counts_the_reserve() -> None:
    clock = Clock()
    plain = controller(clock)
    kept = controller(clock, priority_reserve=0.25)  # 15 kept: 63 - 15 = 48 for the batch
    for ac in (plain, kept):
        for res in admit_all(ac, BATCH, 6):  # 48 blocks: both let the batch burst run this far
            assert res is not None
            ac.started(res)
    ask = Ask(proj(), streamed=True, priority=BATCH)
    # room for one more without the reserve; under it, the steps until one of the six ends
    (now,) = plain.expected_waits(ask)
    (later,) = kept.expected_waits(ask)
    assert now.steps == 0
    assert later.steps is not None and later.steps > 0
    # a chat is not held by the reserve: it would start now in either
    (chat,) = kept.expected_waits(Ask(proj(), streamed=True, priority=0))
    assert chat.steps == 0


async def test_a_tenant_at_its_cap_waits_while_another_is_admitted_past_it() -> None:
    clock = Clock()
    ac = controller(clock, tenant_max_share=0.5)  # 31 of the 63 blocks
    fill(ac, 4, tenant="batch")  # 32 blocks: at its cap
    w = Waiting(ac)
    await w.queue("batch", tenant="batch")  # room for 3 more, but batch is capped
    chat = ac.try_admit(Ask(proj(), streamed=True, tenant="chat"))
    assert chat is not None and chat.admitted  # not queued behind batch's
    assert w.order == [] and len(ac.queue) == 1
    # under reject, a capped tenant's request is refused with its own reason
    ac.policy = ac.policy.reject
    refused = ac.try_admit(Ask(proj(), streamed=True, tenant="batch"))
    assert refused is not None and refused.reason == "tenant_share"
    assert refused.retry_after is not None
    w.tasks["batch"].cancel()


async def test_a_full_queue_displaces_its_worst_priority_for_a_better_one() -> None:
    clock = Clock()
    ac = controller(clock, max_queue_depth=2)
    fill(ac)
    w = Waiting(ac)
    await w.queue("batch-old", priority=10)
    await w.queue("batch-new", priority=10)
    # same priority: nothing to displace, refused as before
    same = ac.try_admit(Ask(proj(), streamed=True, priority=10))
    assert same is not None and same.reason == "queue_full"
    # a better one takes the newest batch request's place, which leaves with 429 displaced
    await w.queue("chat", priority=0)
    displaced = await asyncio.wait_for(w.tasks["batch-new"], 1)
    assert (displaced.outcome, displaced.reason) == (Outcome.REJECT, "displaced")
    assert displaced.retry_after is not None and displaced.retry_after > 0
    assert "priority 0" in displaced.message
    assert len(ac.queue) == 2
    for task in w.tasks.values():
        task.cancel()


async def test_a_tenants_queue_limit_refuses_only_that_tenant() -> None:
    clock = Clock()
    ac = controller(clock, tenant_max_queue=1)
    fill(ac)
    w = Waiting(ac)
    await w.queue("a-1", tenant="a")
    refused = ac.try_admit(Ask(proj(), streamed=True, tenant="a"))
    assert refused is not None and refused.reason == "tenant_queue_full"
    await w.queue("b-1", tenant="b")  # another tenant still queues
    for task in w.tasks.values():
        task.cancel()


async def test_retry_after_counts_only_the_requests_ahead() -> None:
    """Seven requests run, 100 tokens apart, the pool is full, and a batch request (priority
    10) is queued; a chat (priority 0) refused under reject is told to come back when the
    running ones have made room for it alone, a batch one only when they have made room for
    the batch request queued before it too."""
    clock = Clock()
    ac = controller(clock)
    ac.on_snapshot(snapshot(clock, generated=0, running=1))
    for k, res in enumerate(fill(ac)):
        ac.started(res)
        # they end 100 steps apart, seen a token a report (no stream behind: tests/test_lag.py)
        ac.ledger.advance(res, 100 * k)
    clock.now += 1.0
    ac.on_snapshot(snapshot(clock, generated=350, running=7))  # 50 decode steps a second
    while (d := ac.try_admit(Ask(proj(), streamed=True))) is not None:
        assert d.admitted  # what the staggered ends leave room for
    w = Waiting(ac)
    await w.queue("batch-0", priority=10)
    assert ac.queue.ahead_of(Ask(proj(), streamed=True, priority=0)) == []
    assert len(ac.queue.ahead_of(Ask(proj(), streamed=True, priority=10))) == 1
    ac.policy = ac.policy.reject
    chat = ac.try_admit(Ask(proj(), streamed=True, priority=0, key=1))
    batch = ac.try_admit(Ask(proj(), streamed=True, priority=10, key=2))
    assert chat is not None and batch is not None
    assert chat.retry_after is not None and batch.retry_after is not None
    assert chat.retry_after < batch.retry_after
    for task in w.tasks.values():
        task.cancel()


async def test_shortening_the_queue_at_runtime_sheds_the_worst_priority_first() -> None:
    clock = Clock()
    ac = controller(clock)
    fill(ac)
    w = Waiting(ac)
    await w.queue("chat-old", priority=0)
    await w.queue("batch", priority=10)
    await w.queue("chat-new", priority=0)
    clock.now += 3
    assert oldest_wait(ac) == 3
    apply(ac, {"max_queue_depth": 1})
    shed = [await asyncio.wait_for(w.tasks[n], 1) for n in ("batch", "chat-new")]
    assert [d.reason for d in shed] == ["queue_full", "queue_full"]
    assert [x.ask.priority for x in ac.queue.waiting()] == [0]
    w.tasks["chat-old"].cancel()


# --- reading a request's priority and tenant ----------------------------------------------

RULES = parse_priority_rules(
    "model:batch-*=10,tenant:etl=20,key:" + key_digest("sk-x")[4:12] + "=-3"
)


@pytest.mark.parametrize(
    ("body", "header", "tenant", "key", "want"),
    [
        ({}, None, None, None, (0, "")),
        ({"priority": 3}, None, None, None, (3, "")),
        ({"priority": "3"}, None, None, None, (3, "")),  # vLLM's pydantic reads "3" as 3
        ({"priority": 2.0}, "9", None, None, (2, "")),  # the body wins over the header
        ({}, " -4 ", None, None, (-4, "")),
        ({"model": "batch-7b"}, None, None, None, (10, "")),  # a rule on the model
        ({"model": "batch-7b"}, "1", None, None, (1, "")),  # the header wins over the rules
        ({"model": "chat"}, None, "etl", None, (20, "etl")),  # a rule on the tenant
        ({"model": "chat"}, None, None, "sk-x", (-3, key_digest("sk-x"))),  # on the key
        ({"model": "chat"}, None, "team-a", "sk-x", (-3, "team-a")),  # header tenant, key rule
        ({"model": "chat"}, None, None, "sk-other", (0, key_digest("sk-other"))),
    ],
)
def test_priority_and_tenant_are_read_in_order(
    body: dict[str, object],
    header: str | None,
    tenant: str | None,
    key: str | None,
    want: tuple[int, str],
) -> None:
    got = classify(body, priority_header=header, tenant_header=tenant, api_key=key, rules=RULES)
    assert got == want


@pytest.mark.parametrize(
    ("body", "header", "tenant", "code"),
    [
        ({"priority": 1.5}, None, None, "invalid_priority"),
        ({"priority": True}, None, None, "invalid_priority"),
        ({"priority": None}, None, None, "invalid_priority"),
        ({"priority": "high"}, None, None, "invalid_priority"),
        ({"priority": 2**70}, None, None, "invalid_priority"),
        ({}, "high", None, "invalid_priority"),
        ({}, "1.0", None, "invalid_priority"),
        ({}, "", None, "invalid_priority"),
        ({}, None, "", "invalid_tenant"),
        ({}, None, "-lead", "invalid_tenant"),
        ({}, None, "a b", "invalid_tenant"),
        ({}, None, "x" * 65, "invalid_tenant"),
    ],
)
def test_a_malformed_priority_or_tenant_is_a_400_naming_it(
    body: dict[str, object], header: str | None, tenant: str | None, code: str
) -> None:
    with pytest.raises(BadRequest) as err:
        classify(body, priority_header=header, tenant_header=tenant, api_key=None)
    assert (err.value.status, err.value.code) == (400, code)


def test_the_api_key_is_never_kept_only_its_digest() -> None:
    digest = key_digest("sk-secret-123")
    assert digest.startswith("key:") and len(digest) == 20 and "secret" not in digest


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("--priority-rules", "model=10", "is not KIND:PATTERN=PRIORITY"),
        ("--priority-rules", "user:bob=1", "is not KIND:PATTERN=PRIORITY"),
        ("--priority-rules", "model:x=high", "is not an integer"),
        ("--priority-rules", "key:sk-live-abc=1", "never the key itself"),
        ("--tenant-shares", "a=0", "positive SHARE"),
        ("--tenant-shares", "=2", "positive SHARE"),
        ("--tenant-max-share", "0", "greater than 0"),
        ("--priority-reserve", "1", "less than 1"),
        ("--priority-reserve", "-0.1", "greater than or equal to 0"),
    ],
)
def test_bad_class_settings_are_refused_at_start(flag: str, value: str, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        Settings(_cli_parse_args=[flag, value])


# --- through the proxy, in front of the fake vLLM ---------------------------------------------


def _completion(**extra: object) -> dict[str, object]:
    return {"model": "tiny", "prompt": "hello there", "max_tokens": 8, **extra}


def _forwarded(fake: FakeVllm) -> list[dict[str, object]]:
    return [json.loads(r.body) for r in fake.requests if r.path == "/v1/completions"]


async def test_the_priority_is_written_into_the_body_only_with_forward_priority(
    upstream: FakeServer,
) -> None:
    async with run_sidecar(upstream, forward_priority=True) as stack:
        headers = {"x-kv-sidecar-priority": "3"}
        assert (
            await stack.client.post("/v1/completions", json=_completion(), headers=headers)
        ).status_code == 200
        # a priority the body carries is forwarded as sent, whatever the header says
        sent = _completion(priority=-2)
        assert (
            await stack.client.post("/v1/completions", json=sent, headers=headers)
        ).status_code == 200
        # priority 0 is vLLM's default: nothing to write
        assert (await stack.client.post("/v1/completions", json=_completion())).status_code == 200
        bodies = _forwarded(stack.fake)
    assert [b.get("priority") for b in bodies] == [3, -2, None]
    assert bodies[0]["prompt"] == "hello there" and bodies[0]["max_tokens"] == 8


async def test_without_forward_priority_the_body_reaches_vllm_as_sent(
    upstream: FakeServer,
) -> None:
    async with run_sidecar(upstream) as stack:
        headers = {
            "x-kv-sidecar-priority": "3",
            "x-kv-sidecar-tenant": "etl",
            "content-type": "application/json",
        }
        raw = json.dumps(_completion()).encode()  # the bytes as the client sent them
        resp = await stack.client.post("/v1/completions", content=raw, headers=headers)
        assert resp.status_code == 200
        assert (
            stack.sample(
                "kv_sidecar_class_requests_total", priority="3", tenant="etl", decision="admit"
            )
            == 1
        )
        metrics = (await stack.ops.get("/metrics")).text
    sent = [r.body for r in stack.fake.requests if r.path == "/v1/completions"]
    assert sent == [raw]
    assert 'kv_sidecar_class_queue_depth{model_name="tiny",priority="0",tenant="none"} 0.0' in (
        metrics
    )


@pytest.mark.parametrize(
    ("headers", "extra", "code"),
    [
        ({"x-kv-sidecar-priority": "urgent"}, {}, "invalid_priority"),
        ({}, {"priority": 0.5}, "invalid_priority"),
        ({"x-kv-sidecar-tenant": "bad tenant"}, {}, "invalid_tenant"),
    ],
)
async def test_a_malformed_priority_or_tenant_is_an_openai_shaped_400_and_reaches_nothing(
    upstream: FakeServer, headers: dict[str, str], extra: dict[str, object], code: str
) -> None:
    async with run_sidecar(upstream) as stack:
        resp = await stack.client.post(
            "/v1/completions", json=_completion(**extra), headers=headers
        )
        error = openai_error(resp, 400, code)
        assert stack.decisions("reject", "bad_request") == 1
        assert _forwarded(stack.fake) == []
    assert "priority" in error["message"] or "tenant" in error["message"]
