"""vLLM's render endpoints against ``/tokenize`` as the prompt counter's upstream: what a count
costs, side by side, on the real vLLM CPU build.

    python -m bench.render                # about 2 minutes; bench/results/render.json
    python -m bench.render --quick        # a smoke run: 20 rounds
    python -m bench.render --rounds 300

One vLLM (the CPU build, the generated tiny model, ``--enable-scale-out``) and two
:class:`~sidecar.counting.PromptCounter` without a tokenizer, as a sidecar counts when none is
mounted: one with ``render="always"`` (vLLM's render endpoint for the request's endpoint, one
call per body), one with ``render="off"`` (``POST /tokenize``, one call per prompt). Per request
shape, each round counts the same body with both, in alternating order, one request at a time;
the figure is the wall time of :meth:`PromptCounter.count` (``TokenCount.seconds``: planning, the
loopback round trip(s), vLLM's rendering and tokenizing). Reported per shape: the median and the
90th percentile (nearest rank) over the rounds, and whether the two counts were equal in every
round. vLLM's CPU build shares the machine's cores with this process.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import httpx

from harness.bench_util import (
    ROOT,
    fmt,
    load_average,
    machine,
    machine_line,
    progress,
    table,
    update_section,
    write_json,
)
from harness.stats import percentile
from harness.vllm_cpu import VllmServer
from sidecar.counting import PromptCounter

WORDS = "the quick brown fox jumps over the lazy dog while a cat watches from the window".split()


def _text(words: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(words))


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}

#: (name, endpoint, body): what a counter without a tokenizer is asked to count.
SHAPES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("chat, 1 short message", "chat", {"messages": [{"role": "user", "content": "hi there"}]}),
    (
        "chat, 6 turns of 90 words",
        "chat",
        {
            "messages": [
                {"role": "user" if i % 2 == 0 else "assistant", "content": _text(90)}
                for i in range(6)
            ]
        },
    ),
    (
        "chat of 20 words, a tool",
        "chat",
        {"messages": [{"role": "user", "content": _text(20)}], "tools": [WEATHER_TOOL]},
    ),
    ("completions, 1 prompt of 40 words", "completions", {"prompt": _text(40)}),
    (
        "completions, 4 prompts of 40-43 words",
        "completions",
        {"prompt": [_text(40 + i) for i in range(4)]},
    ),
    ("responses, a 40-word string input", "responses", {"input": _text(40)}),
)


async def _measure(
    url: str, served: str, max_model_len: int, rounds: int, warmup: int
) -> list[dict[str, Any]]:
    out = []
    async with httpx.AsyncClient(timeout=60) as client:
        counters = {
            method: PromptCounter(
                client=client,
                upstream=url,
                served_model=served,
                tokenizer_path=None,
                max_model_len=max_model_len,
                render="always" if method == "render" else "off",
            )
            for method in ("render", "tokenize")
        }
        for name, endpoint, body in SHAPES:
            seconds: dict[str, list[float]] = {"render": [], "tokenize": []}
            equal = True
            for i in range(warmup + rounds):
                order = ("render", "tokenize") if i % 2 == 0 else ("tokenize", "render")
                counts = {}
                for method in order:
                    count = await counters[method].count(endpoint, body)  # type: ignore[arg-type]
                    if count.method.value != "exact_upstream":
                        raise RuntimeError(f"{name}: {method} counted by {count.method}")
                    counts[method] = count.prompts
                    if i >= warmup:
                        seconds[method].append(count.seconds)
                equal = equal and counts["render"] == counts["tokenize"]
            render_off = counters["render"].upstream.render_off
            if render_off:
                raise RuntimeError(f"render was not used: {render_off}")
            row = {
                "shape": name,
                "endpoint": endpoint,
                "prompts": list(counts["render"]),
                "equal_counts": equal,
                "rounds": rounds,
            }
            for method, values in seconds.items():
                row[f"{method}_p50_ms"] = percentile(values, 0.5) * 1e3
                row[f"{method}_p90_ms"] = percentile(values, 0.9) * 1e3
            out.append(row)
            progress(
                f"{name}: render {row['render_p50_ms']:.2f} ms, "
                f"/tokenize {row['tokenize_p50_ms']:.2f} ms (medians)"
            )
    return out


def report(results: dict[str, Any], command: str) -> str:
    rows = [
        (
            r["shape"],
            "+".join(str(p) for p in r["prompts"]),
            fmt(r["render_p50_ms"]),
            fmt(r["tokenize_p50_ms"]),
            f"{r['render_p50_ms'] / r['tokenize_p50_ms']:.2f}x",
            fmt(r["render_p90_ms"]),
            fmt(r["tokenize_p90_ms"]),
            "yes" if r["equal_counts"] else "**no**",
        )
        for r in results["rows"]
    ]
    header = (
        "shape",
        "prompt tokens",
        "render p50 ms",
        "/tokenize p50 ms",
        "render / tokenize",
        "render p90 ms",
        "/tokenize p90 ms",
        "same counts",
    )
    return "\n".join(
        [
            f"`{command}`: {machine_line(results['machine'], results['load_after'])}.",
            "",
            f"Wall time of one `PromptCounter.count` without a tokenizer, {results['rounds']} "
            "rounds per shape after a warm-up, both methods in each round in alternating order, "
            "one request at a time, against the vLLM CPU build (tiny model, "
            "`--enable-scale-out`) on the same cores. Medians (p50) and 90th percentiles "
            "(nearest rank):",
            "",
            table(header, rows),
        ]
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.render",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="smoke run (20 rounds)")
    parser.add_argument("--rounds", type=int, default=200, help="measured rounds per shape")
    parser.add_argument("--warmup", type=int, default=20, help="rounds not measured")
    parser.add_argument("--no-report", action="store_true", help="do not touch BENCHMARKS.md")
    args = parser.parse_args(argv)
    rounds = 20 if args.quick else args.rounds
    info = machine()
    server = VllmServer(num_gpu_blocks=64, extra_args=["--enable-scale-out"])
    server.start()
    try:
        rows = asyncio.run(
            _measure(server.url, server.served_name, server.max_model_len, rounds, args.warmup)
        )
    finally:
        server.stop()
    results = {"machine": info, "load_after": load_average(), "rounds": rounds, "rows": rows}
    name = "render-quick" if args.quick else "render"
    progress(f"results in {write_json(name, results)}")
    if not (args.quick or args.no_report):
        command = "python -m bench.render" + (f" --rounds {rounds}" if rounds != 200 else "")
        update_section(ROOT / "BENCHMARKS.md", "render", report(results, command))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
