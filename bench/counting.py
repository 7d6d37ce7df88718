"""Long prompts: what counting them costs, and whether a stream relayed next to them stalls.

    python -m bench.counting                 # about 5 minutes; bench/results/counting.json
    python -m bench.counting --quick         # a smoke run: fewer lengths, shorter streams
    python -m bench.counting --no-baseline   # this checkout only (no "before" sidecar)

Two parts, both run on the generated tiny model's tokenizer (byte-level BPE, 512 tokens, about
6 characters a token on the generated words; a 128k-vocabulary tokenizer costs more per token):

1. **Cost per count** (in this process, :class:`~sidecar.counting.PromptCounter` with a local
   tokenizer and 16-token blocks hashed, as the sidecar counts): prompts of 1k, 8k, 32k and
   128k tokens, 1, 4 and 16 at once. Per cell: process CPU per count and per token, the wall
   time of the batch, and the event loop's own latency meanwhile (a 1 ms ticker's gaps). Two
   variants: ``gil-held`` is the counting of before (``encode``, which holds the GIL, two
   worker threads, no cap), ``gil-free`` the current one (``encode_batch`` for long texts, the
   GIL released while Rust tokenizes; ``--max-concurrent-counts``'s default of slots).
2. **The relay next to 128k-token counts** (real processes): the fast fake vLLM
   (``harness.fake_vllm_fast``, ``--max-model-len 200000``, SSE events paced at
   ``--interval-ms``), a ``kv-sidecar serve`` in front of it counting with the local tokenizer
   (discovered from ``/v1/models`` ``root``), one streamed completion read by its own light
   process that stamps every event, and meanwhile 0, 1, 4 or 16 clients sending 128k-token
   completions one after another (honouring Retry-After on a 429, as the openai client does). A
   second stream reader goes straight to the upstream in the same window: the machine's own
   noise floor. Reported: the inter-event gap (p50, p99, max) and the *stall*, the gap less the
   upstream's pace. The "before" sidecar is a git worktree of ``--baseline`` (default ``HEAD``),
   run alike.

Target (issue 14): a stall p99 under 5 ms while 128k-token prompts are being counted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from bench.common import LONG_CONTEXT_LEN, BaselineSidecar, make_texts, worktree
from harness.bench_util import (
    RESULTS,
    ROOT,
    ProcStat,
    fmt,
    load_average,
    machine,
    machine_line,
    progress,
    table,
    update_section,
    write_json,
)
from harness.fake_vllm_fast import FakeVllmProcess
from harness.stats import percentile
from harness.vllm_cpu import ensure_tokenizer_model
from harness.workload import SidecarProcess

LENGTHS = (1_000, 8_000, 32_000, 128_000)
CONCURRENCY = (1, 4, 16)
FLOODS = (0, 1, 4, 16)
FLOOD_TOKENS = 128_000
TARGET_STALL_P99_S = 0.005


# --- part 1: the cost of a count, in this process -----------------------------------------------


@contextlib.contextmanager
def variant(name: str) -> Iterator[dict[str, Any]]:
    """The counter's settings for ``name``; ``gil-held`` also tokenizes with ``encode``."""
    from sidecar.counting import tokenizer

    saved = tokenizer.GIL_FREE_CHARS
    if name == "gil-held":
        tokenizer.GIL_FREE_CHARS = sys.maxsize  # encode() for every text, as before
        # before: two worker threads, every other count queued behind them, no bound
        kwargs: dict[str, Any] = {"max_concurrent_counts": 2, "max_count_wait_s": 1e9}
    else:
        kwargs = {"max_count_wait_s": 1e9}  # the default slots; nothing shed while measuring
    try:
        yield kwargs
    finally:
        tokenizer.GIL_FREE_CHARS = saved


async def _ticker(gaps: list[float], stop: asyncio.Event) -> None:
    last = time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


async def count_batch(counter: Any, texts: Sequence[str]) -> dict[str, Any]:
    """Count ``texts`` at once while a 1 ms ticker runs on the loop."""
    gaps: list[float] = []
    stop = asyncio.Event()
    ticking = asyncio.ensure_future(_ticker(gaps, stop))
    await asyncio.sleep(0.02)
    gaps.clear()
    done: list[float] = []

    async def one(text: str) -> int:
        count = await counter.count("completions", {"model": "tiny", "prompt": text})
        done.append(time.perf_counter())
        return int(count.total)

    cpu0, t0 = time.process_time(), time.perf_counter()
    totals = await asyncio.gather(*(one(t) for t in texts))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    stop.set()
    await ticking
    tokens = sum(totals)
    return {
        "counts": len(texts),
        "tokens": tokens,
        "wall_s": wall,
        "cpu_s": cpu,
        "cpu_per_count_ms": cpu / len(texts) * 1e3,
        "cpu_per_token_us": cpu / tokens * 1e6,
        "latency_p50_s": percentile([d - t0 for d in done], 0.5),
        "latency_max_s": max(d - t0 for d in done),
        "loop_gap_p50_ms": percentile(gaps, 0.5) * 1e3,
        "loop_gap_p99_ms": percentile(gaps, 0.99) * 1e3,
        "loop_gap_max_ms": max(gaps, default=float("nan")) * 1e3,
    }


def cost_part(model_dir: Path, lengths: Sequence[int], rounds: int) -> dict[str, Any]:
    from sidecar.counting import ModelTokenizer, PromptCounter

    tok = ModelTokenizer.load(model_dir)
    texts = {n: make_texts(model_dir, n, max(CONCURRENCY), seed=n) for n in lengths}
    out: dict[str, Any] = {}

    async def run(name: str) -> None:
        with variant(name) as kwargs:
            counter = PromptCounter(
                client=None,
                upstream=None,
                served_model="tiny",
                tokenizer_path=None,
                tokenizer=tok,
                block_size=16,
                **kwargs,
            )
            try:
                await counter.count("completions", {"prompt": texts[lengths[0]][0]})  # warm
                cells: dict[str, Any] = {}
                for n in lengths:
                    for c in CONCURRENCY:
                        runs = [await count_batch(counter, texts[n][:c]) for _ in range(rounds)]
                        best = min(runs, key=lambda r: r["cpu_s"])
                        cell = {k: v for k, v in best.items()}
                        cell["loop_gap_max_ms"] = max(r["loop_gap_max_ms"] for r in runs)
                        cell["loop_gap_p99_ms"] = max(r["loop_gap_p99_ms"] for r in runs)
                        cells[f"{n}x{c}"] = cell
                        progress(
                            f"counting cost {name} {n} tokens x{c}: "
                            f"{cell['cpu_per_token_us']:.2f} us/token, "
                            f"loop gap max {cell['loop_gap_max_ms']:.1f} ms"
                        )
                out[name] = {"slots": counter.slots.slots, "cells": cells}
            finally:
                counter.close()

    for name in ("gil-held", "gil-free"):
        asyncio.run(run(name))
    return out


# --- part 2: the relay next to a flood of long prompts, real processes --------------------------


async def read_stream(url: str, events: int, interval_ms: float) -> list[float]:
    """One streamed completion of ``events`` events; the arrival time of each (perf_counter)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    body = json.dumps(
        {"model": "tiny", "prompt": "stream", "max_tokens": events, "stream": True}
    ).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}:{port}\r\n"
        f"content-type: application/json\r\nx-bench-interval-ms: {interval_ms}\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
    stamps: list[float] = []
    try:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        if head.split(b" ", 2)[1] != b"200":
            raise RuntimeError(head[:300].decode(errors="replace"))
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
            if size == 0:
                break
            data = await reader.readexactly(size + 2)
            now = time.perf_counter()
            stamps += [now] * data.count(b'"text"')  # token events; not usage or [DONE]
    finally:
        writer.close()
    return stamps


def gap_figures(stamps: Sequence[float], interval_s: float) -> dict[str, float]:
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    stalls = [max(0.0, g - interval_s) for g in gaps]
    return {
        "events": len(stamps),
        "gap_p50_ms": percentile(gaps, 0.5) * 1e3,
        "gap_p99_ms": percentile(gaps, 0.99) * 1e3,
        "gap_max_ms": max(gaps, default=float("nan")) * 1e3,
        "stall_p99_ms": percentile(stalls, 0.99) * 1e3,
        "stall_max_ms": max(stalls, default=float("nan")) * 1e3,
    }


def stream_reader(url: str, events: int, interval_ms: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.counting",
            "--read-stream",
            url,
            "--events",
            str(events),
            "--interval-ms",
            str(interval_ms),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def reader_result(proc: subprocess.Popen[str], timeout: float) -> list[float]:
    out, err = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"stream reader failed: {err[-2000:]}")
    return list(json.loads(out.strip().splitlines()[-1]))


async def flood(
    url: str, bodies: Sequence[bytes], senders: int, stop: asyncio.Event
) -> dict[str, Any]:
    """``senders`` clients sending long completions one after another until ``stop``."""
    outcomes: dict[str, int] = {}
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=senders + 2)
    headers = {"content-type": "application/json"}

    async def sender(k: int, client: httpx.AsyncClient) -> None:
        i = k
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                resp = await client.post("/v1/completions", content=bodies[i % len(bodies)])
            except httpx.HTTPError as exc:
                outcomes[type(exc).__name__] = outcomes.get(type(exc).__name__, 0) + 1
                continue
            i += senders
            code = str(resp.status_code)
            if resp.status_code != 200:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    code += " " + str(resp.json()["error"]["code"])
            outcomes[code] = outcomes.get(code, 0) + 1
            if resp.status_code == 200:
                latencies.append(time.perf_counter() - t0)
            elif resp.status_code in (429, 503):
                wait_ms = float(resp.headers.get("retry-after-ms", "1000"))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), wait_ms / 1000)

    async with httpx.AsyncClient(
        base_url=url, timeout=120, limits=limits, headers=headers
    ) as client:
        await asyncio.gather(*(sender(k, client) for k in range(senders)))
    return {
        "outcomes": outcomes,
        "completed": outcomes.get("200", 0),
        "latency_p50_s": percentile(latencies, 0.5),
        "latency_max_s": max(latencies, default=float("nan")),
    }


def relay_case(
    sidecar: SidecarProcess,
    upstream: FakeVllmProcess,
    bodies: Sequence[bytes],
    senders: int,
    events: int,
    interval_ms: float,
) -> dict[str, Any]:
    """One stream through the sidecar and one straight to the upstream, while ``senders``
    clients send long prompts to the sidecar."""
    assert sidecar.proc is not None
    stat = ProcStat(sidecar.proc.pid)

    async def run() -> dict[str, Any]:
        stop = asyncio.Event()
        flooding = asyncio.ensure_future(flood(sidecar.url, bodies, senders, stop))
        await asyncio.sleep(1.5 if senders else 0.1)  # the flood in its stride
        cpu0 = stat.cpu_seconds()
        readers = [
            stream_reader(sidecar.url, events, interval_ms),
            stream_reader(upstream.url, events, interval_ms),
        ]
        loop = asyncio.get_running_loop()
        timeout = events * interval_ms / 1000 * 4 + 60
        via, direct = await asyncio.gather(
            *(loop.run_in_executor(None, reader_result, r, timeout) for r in readers)
        )
        cpu = stat.cpu_seconds() - cpu0
        stop.set()
        flooded = await flooding
        interval = interval_ms / 1000
        return {
            "senders": senders,
            "sidecar": gap_figures(via, interval),
            "direct": gap_figures(direct, interval),
            "sidecar_cpu_s": cpu,
            "window_s": via[-1] - via[0] if len(via) > 1 else float("nan"),
            "flood": flooded,
        }

    return asyncio.run(run())


def warm(url: str) -> None:
    with httpx.Client(base_url=url, timeout=60) as client:
        for body in (
            {"model": "tiny", "prompt": "warm up", "max_tokens": 2},
            {"model": "tiny", "prompt": "warm up", "max_tokens": 2, "stream": True},
        ):
            client.post("/v1/completions", json=body).raise_for_status()


def relay_part(
    model_dir: Path, floods: Sequence[int], events: int, interval_ms: float, baseline: str | None
) -> dict[str, Any]:
    texts = make_texts(model_dir, FLOOD_TOKENS, 8, seed=128)
    bodies = [json.dumps({"model": "tiny", "prompt": t, "max_tokens": 1}).encode() for t in texts]
    upstream = FakeVllmProcess(model_dir, max_model_len=LONG_CONTEXT_LEN).start()
    out: dict[str, Any] = {"interval_ms": interval_ms, "events": events, "variants": {}}
    try:
        variants: list[tuple[str, Any]] = [("after", None)]
        tree_cm: Any = contextlib.nullcontext(None)
        if baseline:
            tree_cm = worktree(baseline)
        with tree_cm as tree:
            if tree is not None:
                variants.insert(0, ("before", tree))
                out["baseline"] = {"ref": baseline, "commit": tree[1]}
            for name, tree_info in variants:
                cases = []
                for senders in floods:
                    if tree_info is not None:
                        sidecar: SidecarProcess = BaselineSidecar(
                            tree_info[0], upstream.url, "--log-level", "warning"
                        )
                    else:
                        sidecar = SidecarProcess(upstream.url, "--log-level", "warning")
                    # a fresh sidecar per case: its first count of a shape, the one checked
                    # against the upstream's /tokenize, is the warm-up's short prompt
                    sidecar.start(timeout=120)
                    try:
                        warm(sidecar.url)
                        case = relay_case(sidecar, upstream, bodies, senders, events, interval_ms)
                    finally:
                        sidecar.stop()
                    progress(
                        f"relay {name}, {senders} senders of {FLOOD_TOKENS} tokens: stall p99 "
                        f"{case['sidecar']['stall_p99_ms']:.1f} ms, max "
                        f"{case['sidecar']['stall_max_ms']:.1f} ms (direct p99 "
                        f"{case['direct']['stall_p99_ms']:.1f} ms); {case['flood']['outcomes']}"
                    )
                    cases.append(case)
                out["variants"][name] = cases
    finally:
        upstream.stop()
    return out


# --- figures, chart and report ------------------------------------------------------------------


def chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cpu_ax, left, right) = plt.subplots(1, 3, figsize=(18, 4.8), layout="constrained")
    cost = results.get("cost", {})
    styles = {"gil-held": "--", "gil-free": "-"}
    for ax, key, label in (
        (cpu_ax, "cpu_per_token_us", "CPU per token (us)"),
        (left, "loop_gap_max_ms", "event loop's longest gap while counting (ms)"),
    ):
        for name, data in cost.items():
            for c in CONCURRENCY:
                cells = [data["cells"].get(f"{n}x{c}") for n in results["lengths"]]
                xs = [n for n, cell in zip(results["lengths"], cells, strict=True) if cell]
                ys = [cell[key] for cell in cells if cell]
                ax.plot(xs, ys, styles.get(name, "-"), marker="o", label=f"{name}, {c} at once")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    cpu_ax.set_title("The cost of a count (tiny tokenizer)")
    left.set_title("Counting in the sidecar's process: the loop's latency")
    left.axhline(TARGET_STALL_P99_S * 1e3, color="grey", linewidth=0.8, linestyle=":")

    relay = results.get("relay", {}).get("variants", {})
    width = 0.2
    for i, (name, cases) in enumerate(relay.items()):
        xs = [k + (i - 0.5) * width * 2 for k in range(len(cases))]
        right.bar(
            xs,
            [c["sidecar"]["stall_p99_ms"] for c in cases],
            width,
            label=f"{name}: stall p99",
        )
        right.bar(
            [x + width for x in xs],
            [c["sidecar"]["stall_max_ms"] for c in cases],
            width,
            alpha=0.5,
            label=f"{name}: stall max",
        )
    cases = next(iter(relay.values()), [])
    right.plot(
        range(len(cases)),
        [c["direct"]["stall_p99_ms"] for c in cases],
        "k.",
        label="direct to upstream: stall p99 (noise floor)",
    )
    right.set_xticks(range(len(cases)), [f"{c['senders']} senders" for c in cases])
    right.set_yscale("symlog", linthresh=1)
    right.set_ylabel("SSE inter-event gap less the pace (ms)")
    right.set_title(f"A stream relayed next to {FLOOD_TOKENS // 1000}k-token prompts")
    right.axhline(TARGET_STALL_P99_S * 1e3, color="red", linewidth=0.8, linestyle=":")
    right.legend(fontsize=7)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _cost_section(results: dict[str, Any]) -> list[str]:
    cost = results.get("cost")
    if not cost:
        return []
    names = ("gil-held", "gil-free")
    cost_rows, loop_rows = [], []
    for n in results["lengths"]:
        for c in CONCURRENCY:
            cells = [cost.get(name, {}).get("cells", {}).get(f"{n}x{c}") for name in names]
            cost_row: list[Any] = [f"{n:,}", c]
            loop_row: list[Any] = [f"{n:,}", c]
            for cell in cells:
                if cell is None:
                    cost_row += ["-"] * 3
                    loop_row += ["-"] * 2
                    continue
                cost_row += [
                    fmt(cell["cpu_per_count_ms"], 1),
                    fmt(cell["cpu_per_token_us"], 2),
                    fmt(cell["wall_s"] * 1e3, 0),
                ]
                loop_row += [fmt(cell["loop_gap_p99_ms"], 1), fmt(cell["loop_gap_max_ms"], 1)]
            cost_rows.append(cost_row)
            loop_rows.append(loop_row)
    slots = {name: data.get("slots") for name, data in cost.items()}
    cost_header = ["tokens", "at once"]
    loop_header = ["tokens", "at once"]
    for label in ("before", "after"):
        cost_header += [f"{label}: CPU ms/count", "us/token", "batch wall ms"]
        loop_header += [f"{label}: loop gap p99 ms", "max ms"]
    return [
        "",
        "**Cost of a count** (the tiny model's tokenizer, 16-token blocks hashed; process CPU "
        "of all threads; the batch's wall time from the first count's start to the last "
        "one's end; the best of the rounds):",
        "",
        table(cost_header, cost_rows),
        "",
        "**The event loop meanwhile** (a 1 ms ticker on the counter's own event loop: its "
        "gaps, worst of the rounds):",
        "",
        table(loop_header, loop_rows),
        "",
        f"Before: `encode` (holds the GIL), {slots.get('gil-held')} threads; after: "
        f"`encode_batch` for long texts (releases it), {slots.get('gil-free')} counting "
        "slot(s) (the CPUs less one).",
    ]


def report(results: dict[str, Any], command: str) -> str:
    lines = [
        f"`{command}`; {machine_line(results['machine'], results.get('load_average_after'))}.",
        *_cost_section(results),
    ]
    relay = results.get("relay")
    if relay:
        lines += [
            "",
            f"**A stream relayed next to {FLOOD_TOKENS:,}-token prompts** (one SSE stream of "
            f"{relay['events']} events paced at {relay['interval_ms']:g} ms; stall = gap less "
            "the pace; *direct* is a second stream straight to the upstream in the same window):",
            "",
        ]
        rows = []
        for name, cases in relay["variants"].items():
            for case in cases:
                s, d, f = case["sidecar"], case["direct"], case["flood"]
                rows.append(
                    [
                        name,
                        case["senders"],
                        fmt(s["gap_p50_ms"], 1),
                        fmt(s["gap_p99_ms"], 1),
                        fmt(s["gap_max_ms"], 1),
                        fmt(s["stall_p99_ms"], 1),
                        fmt(d["stall_p99_ms"], 1),
                        f["completed"],
                        ", ".join(f"{k}: {v}" for k, v in sorted(f["outcomes"].items())),
                        fmt(case["sidecar_cpu_s"], 1),
                    ]
                )
        lines.append(
            table(
                [
                    "sidecar",
                    "senders",
                    "gap p50 ms",
                    "gap p99 ms",
                    "gap max ms",
                    "stall p99 ms",
                    "direct stall p99 ms",
                    "long prompts done",
                    "outcomes",
                    "sidecar CPU s",
                ],
                rows,
            )
        )
        after = relay["variants"].get("after", [])
        worst = max((c["sidecar"]["stall_p99_ms"] for c in after if c["senders"]), default=None)
        if worst is not None:
            ok = "met" if worst < TARGET_STALL_P99_S * 1e3 else "**not met**"
            lines += [
                "",
                f"Target stall p99 < {TARGET_STALL_P99_S * 1e3:g} ms with long prompts being "
                f"counted: worst {worst:.1f} ms, {ok}.",
            ]
        if "baseline" in relay:
            lines += ["", f"Before: `{relay['baseline']['commit'][:10]}` (`--baseline`)."]
    lines += ["", "![counting](bench/results/counting.png)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.counting",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="smoke run")
    parser.add_argument("--rounds", type=int, default=3, help="per cost cell (the best is kept)")
    parser.add_argument("--events", type=int, default=1000, help="events in the measured stream")
    parser.add_argument("--interval-ms", type=float, default=10.0, help="the upstream's pace")
    parser.add_argument("--baseline", default="HEAD", help="git revision of the before sidecar")
    parser.add_argument("--no-baseline", action="store_true", help="measure this checkout only")
    parser.add_argument("--no-cost", action="store_true", help="skip part 1")
    parser.add_argument("--no-relay", action="store_true", help="skip part 2")
    parser.add_argument("--no-report", action="store_true", help="do not touch BENCHMARKS.md")
    parser.add_argument("--lengths", type=int, nargs="+", help=f"prompt tokens ({LENGTHS})")
    parser.add_argument("--floods", type=int, nargs="+", help=f"long-prompt senders ({FLOODS})")
    parser.add_argument("--read-stream", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.read_stream:  # the stream reader's own process
        stamps = asyncio.run(read_stream(args.read_stream, args.events, args.interval_ms))
        print(json.dumps(stamps), flush=True)
        return {}
    model_dir = ensure_tokenizer_model()
    lengths = args.lengths or ((1_000, 32_000, 128_000) if args.quick else LENGTHS)
    results: dict[str, Any] = {"machine": machine(), "lengths": list(lengths)}
    if not args.no_cost:
        progress("counting: cost per count")
        results["cost"] = cost_part(model_dir, lengths, 1 if args.quick else args.rounds)
    if not args.no_relay:
        progress("counting: the relay next to long prompts")
        results["relay"] = relay_part(
            model_dir,
            args.floods or ((0, 4) if args.quick else FLOODS),
            300 if args.quick else args.events,
            args.interval_ms,
            None if args.no_baseline else args.baseline,
        )
    results["load_average_after"] = [round(x, 2) for x in load_average()]
    name = "counting-quick" if args.quick else "counting"
    RESULTS.mkdir(parents=True, exist_ok=True)
    chart(results, RESULTS / f"{name}.png")
    command = "python -m bench.counting" + (" --quick" if args.quick else "")
    text = report(results, command)
    results["report"] = text
    write_json(name, results)
    print(text)
    if not args.no_report and not args.quick:
        update_section(ROOT / "BENCHMARKS.md", "counting", text)
    progress("counting: done")
    return results


if __name__ == "__main__":
    main()
