"""The overhead benchmark's figures (medians over rounds, ratios within each round) and its
section of BENCHMARKS.md."""

from __future__ import annotations

import itertools
from typing import Any

from bench.overhead.run import IDS
from harness.bench_util import fmt, machine_line, table
from harness.stats import median


def figures(results: dict[str, Any]) -> dict[str, Any]:
    """Medians over rounds, and ratios taken within each round."""
    lat = results["latency"]
    thr = results["throughput"]
    names = list(lat)
    out: dict[str, Any] = {"latency": {}, "throughput": {}, "sse": {}}
    for name in names:
        runs = lat[name]
        out["latency"][name] = {
            "p50_us": median(r["p50_us"] for r in runs),
            "p99_us": median(r["p99_us"] for r in runs),
            "added_p50_us": None
            if name == "direct"
            else median(
                r["p50_us"] - d["p50_us"] for r, d in zip(runs, lat["direct"], strict=True)
            ),
            "added_p99_us": None
            if name == "direct"
            else median(
                r["p99_us"] - d["p99_us"] for r, d in zip(runs, lat["direct"], strict=True)
            ),
            "p50_ratio_to_direct": median(
                r["p50_us"] / d["p50_us"] for r, d in zip(runs, lat["direct"], strict=True)
            ),
            "cpu_s_per_1000": None
            if name == "direct"
            else median(r["cpu_s"] / r["requests"] * 1000 for r in runs),
        }
        truns = thr[name]
        out["throughput"][name] = {
            "rps": median(r["rps"] for r in truns),
            "p50_us": median(r["p50_us"] for r in truns),
            "p99_us": median(r["p99_us"] for r in truns),
            "ratio_to_nginx": median(
                r["rps"] / n["rps"] for r, n in zip(truns, thr["nginx"], strict=True)
            ),
            "ratio_to_direct": median(
                r["rps"] / n["rps"] for r, n in zip(truns, thr["direct"], strict=True)
            ),
            "cpu_s_per_1000": None
            if name == "direct"
            else median(r["cpu_s"] / r["requests"] * 1000 for r in truns),
            "errors": sum(r["status_errors"] + r["other_errors"] for r in truns),
        }
    for mode, per in results["sse"].items():
        out["sse"][mode] = {}
        for name, runs in per.items():
            out["sse"][mode][name] = {
                "events_per_s": median(r["events_per_second"] for r in runs),
                "events_per_chunk": median(r["events"] / r["chunks"] for r in runs if r["chunks"]),
                "cpu_s_per_1000_events": None
                if name == "direct"
                else median(r["cpu_s"] / r["events"] * 1000 for r in runs if r["events"]),
                "events_per_cpu_s": None
                if name == "direct"
                else median(r["events"] / r["cpu_s"] for r in runs if r["cpu_s"]),
                "ratio_to_nginx": median(
                    r["events_per_second"] / n["events_per_second"]
                    for r, n in zip(runs, per["nginx"], strict=True)
                ),
                "errors": sum(r["errors"] for r in runs),
            }
    if results.get("baseline"):
        out["vs_baseline"] = vs_baseline(results)
    return out


def vs_baseline(results: dict[str, Any]) -> dict[str, Any]:
    """The sidecar's CPU per request (per 1,000 SSE events) against the baseline revision's, test
    by test: both medians over rounds, ``ratio`` the median of the ratios taken within each round
    (the two ran back to back in it), and ``ratio_of_medians`` for reference."""
    base = results["baseline"]
    c = results.get("concurrency", "")
    # (label, runs now, runs at the baseline, what one unit of work is, per how many of them)
    tests: list[tuple[str, list[dict[str, Any]], list[dict[str, Any]], str, float]] = []
    for test, label in (("latency", "latency, c=1"), ("throughput", f"requests/s, c={c}")):
        runs = results[test]
        tests.append((label, runs["sidecar"], runs[base["name"]], "requests", 1.0))
        if base["ids_name"] in runs:
            tests.append(
                (
                    f"{label}, prompt as token ids",
                    runs[IDS],
                    runs[base["ids_name"]],
                    "requests",
                    1.0,
                )
            )
    for mode, per in results["sse"].items():
        if base["name"] in per:
            tests.append((f"SSE {mode}", per["sidecar"], per[base["name"]], "events", 1000.0))
    out: dict[str, Any] = {}
    for label, new, old, count, per_n in tests:
        pairs = [(n, o) for n, o in zip(new, old, strict=True) if n[count] and o[count]]
        if not pairs:
            continue
        # CPU µs per request, or CPU s per 1,000 events
        scale = 1e6 if count == "requests" else per_n
        now = [n["cpu_s"] / n[count] * scale for n, _ in pairs]
        then = [o["cpu_s"] / o[count] * scale for _, o in pairs]
        out[label] = {
            "unit": "CPU µs per request" if count == "requests" else "CPU s per 1,000 events",
            "sidecar": median(now),
            "baseline": median(then),
            "ratio": median(a / b for a, b in zip(now, then, strict=True) if b),
            "ratio_of_medians": median(now) / median(then) if median(then) else None,
            "rounds": len(pairs),
        }
    return out


def _summary(results: dict[str, Any], fig: dict[str, Any], command: str) -> list[str]:
    """The run, the command, the prompt counts, and the targets with their verdicts."""
    lat, thr, sse_f = fig["latency"], fig["throughput"], fig["sse"]
    side = "sidecar"
    mib = 2**20
    rss = results["rss"]
    added = lat[side]["added_p50_us"]
    rps_ratio = thr[side]["ratio_to_nginx"]
    best_sse = max(sse_f["unpaced"][side]["events_per_s"], sse_f["paced"][side]["events_per_s"])
    peak_rss = max(rss["under_load_peak_sampled_bytes"], rss["high_water_mark_bytes"])

    def ok(cond: bool) -> str:
        return "met" if cond else "**missed**"

    return [
        f"Run: {machine_line(results['machine'], results.get('load_average_after'))}.",
        "",
        f"Command: `{command}` ({results['rounds']} interleaved rounds of "
        f"{results['seconds_per_run']:g} s per path and test; medians over rounds, ratios "
        "taken within each round).",
        "",
        "Prompt counting during the run (requests by method, after warm-up): local tokenizer "
        f"sidecar {fmt(results['counted_by']['local'], 0)} `exact_local`, /tokenize sidecar "
        f"{fmt(results['counted_by']['upstream'], 0)} `exact_upstream`.",
        "",
        "**Targets**",
        "",
        table(
            ["target", "measured", "verdict"],
            [
                [
                    "median latency added to a small non-streamed request < 1 ms",
                    f"{fmt(added / 1000, 3)} ms (p50 {fmt(lat[side]['p50_us'] / 1000, 3)} ms vs "
                    f"direct {fmt(lat['direct']['p50_us'] / 1000, 3)} ms, ratio "
                    f"{fmt(lat[side]['p50_ratio_to_direct'])}x)",
                    ok(added < 1000),
                ],
                [
                    f"requests/s at c={results.get('concurrency', '')} >= 0.5 x nginx",
                    f"{fmt(rps_ratio)} x nginx ({fmt(thr[side]['rps'], 0)} vs "
                    f"{fmt(thr['nginx']['rps'], 0)} req/s)",
                    ok(rps_ratio >= 0.5),
                ],
                [
                    ">= 20,000 SSE events/s relayed by one sidecar process",
                    f"{fmt(best_sse, 0)} events/s",
                    ok(best_sse >= 20000),
                ],
                [
                    "sidecar RSS < 200 MB",
                    f"{fmt(rss['rest_bytes'] / mib, 1)} MiB at rest, "
                    f"{fmt(peak_rss / mib, 1)} MiB peak under load",
                    ok(peak_rss < 200e6),
                ],
            ],
        ),
        "",
    ]


def _latency(fig: dict[str, Any]) -> list[str]:
    lat = fig["latency"]
    return [
        "**Added latency, one connection, small non-streamed completion** (`wrk -t1 -c1`; "
        "prompt of ~20 tokens, `max_tokens` 16)",
        "",
        table(
            [
                "path",
                "p50",
                "p99",
                "added p50",
                "added p99",
                "p50 / direct",
                "proxy CPU s per 1,000 req",
            ],
            [
                [
                    name,
                    fmt(v["p50_us"] / 1000, 3) + " ms",
                    fmt(v["p99_us"] / 1000, 3) + " ms",
                    fmt(None if v["added_p50_us"] is None else v["added_p50_us"] / 1000, 3, " ms"),
                    fmt(None if v["added_p99_us"] is None else v["added_p99_us"] / 1000, 3, " ms"),
                    fmt(v["p50_ratio_to_direct"]) + "x",
                    fmt(v["cpu_s_per_1000"], 3),
                ]
                for name, v in lat.items()
            ],
        ),
        "",
    ]


def _throughput(results: dict[str, Any], fig: dict[str, Any]) -> list[str]:
    thr = fig["throughput"]
    return [
        f"**Requests per second at fixed concurrency** (`wrk -t1 -c{results.get('concurrency')}`)",
        "",
        table(
            [
                "path",
                "req/s",
                "/ nginx",
                "/ direct",
                "p50",
                "p99",
                "proxy CPU s per 1,000 req",
                "errors",
            ],
            [
                [
                    name,
                    fmt(v["rps"], 0),
                    fmt(v["ratio_to_nginx"]),
                    fmt(v["ratio_to_direct"]),
                    fmt(v["p50_us"] / 1000, 2) + " ms",
                    fmt(v["p99_us"] / 1000, 2) + " ms",
                    fmt(v["cpu_s_per_1000"], 3),
                    v["errors"],
                ]
                for name, v in thr.items()
            ],
        ),
        "",
    ]


def _sse(results: dict[str, Any], fig: dict[str, Any]) -> list[str]:
    settings, sse_f = results["sse_settings"], fig["sse"]
    return [
        f"**SSE relay** (`bench.sse_client`, {settings['events_per_stream']} events per stream; "
        f"unpaced: {settings['unpaced_streams']} streams, the upstream writes each event as soon "
        f"as it can; paced: {settings['paced_streams']} streams, one event per stream every "
        f"{settings['paced_interval_ms']:g} ms, like a decoder)",
        "",
        table(
            [
                "mode",
                "path",
                "events/s",
                "/ nginx",
                "events per relayed chunk",
                "proxy CPU s per 1,000 events",
                "events per proxy CPU-second",
                "errors",
            ],
            [
                [
                    mode,
                    name,
                    fmt(v["events_per_s"], 0),
                    fmt(v["ratio_to_nginx"]),
                    fmt(v["events_per_chunk"]),
                    fmt(v["cpu_s_per_1000_events"], 3),
                    fmt(v["events_per_cpu_s"], 0),
                    v["errors"],
                ]
                for mode, per in sse_f.items()
                for name, v in per.items()
            ],
        ),
        "",
    ]


def _memory(results: dict[str, Any]) -> list[str]:
    rss, mib = results["rss"], 2**20
    return [
        "**Sidecar memory and in-situ timings**",
        "",
        table(
            ["figure", "value"],
            [
                [
                    "RSS at rest (after start-up, tokenizer loaded, warm)",
                    f"{fmt(rss['rest_bytes'] / mib, 1)} MiB",
                ],
                [
                    "RSS peak under load (sampled every 0.2 s)",
                    f"{fmt(rss['under_load_peak_sampled_bytes'] / mib, 1)} MiB",
                ],
                [
                    "RSS high-water mark (VmHWM)",
                    f"{fmt(rss['high_water_mark_bytes'] / mib, 1)} MiB",
                ],
                ["RSS after the load", f"{fmt(rss['after_load_bytes'] / mib, 1)} MiB"],
                [
                    "mean local prompt count (`kv_sidecar_tokenize_seconds`)",
                    fmt(results["in_situ"]["tokenize_local_mean_us"], 1, " µs"),
                ],
                [
                    "mean projection + decision (`kv_sidecar_decision_seconds`)",
                    fmt(results["in_situ"]["decision_mean_us"], 1, " µs"),
                ],
            ],
        ),
    ]


def _vs_baseline(results: dict[str, Any], fig: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    vs = fig.get("vs_baseline")
    if vs:
        base = results["baseline"]
        lines += [
            "",
            f"**CPU per request against `{base['ref']}`** (commit {base['commit'][:12]}, its "
            "sidecar run from a git worktree with the same flags, in the same interleaved rounds; "
            "ratio: the median of the within-round ratios, below 1 is cheaper now)",
            "",
            table(
                ["test", "unit", "sidecar", base["name"], "sidecar / baseline"],
                [
                    [
                        label,
                        v["unit"],
                        fmt(v["sidecar"], 1 if v["unit"].endswith("request") else 3),
                        fmt(v["baseline"], 1 if v["unit"].endswith("request") else 3),
                        fmt(v["ratio"], 3),
                    ]
                    for label, v in vs.items()
                ],
            ),
        ]
    return lines


def _components(results: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    comp = results.get("components")
    if comp:
        lines += [
            "",
            "**What the pieces cost** (CPU per call, measured one at a time in the bench process "
            "against the same upstream; the sidecar pays the first and third on every request):",
            "",
            table(
                ["piece", "CPU per call"],
                [
                    [
                        "httpx `send(stream=True)` + `aiter_raw` + `aclose`, keep-alive",
                        fmt(comp["httpx_streamed_request_us"], 0, " µs"),
                    ],
                    [
                        "the same exchange on a raw asyncio stream (the HTTP work itself)",
                        fmt(comp["raw_asyncio_request_us"], 0, " µs"),
                    ],
                    [
                        "local prompt count of the ~20-token prompt (`ModelTokenizer.count_text`)",
                        fmt(comp["local_prompt_count_us"], 0, " µs"),
                    ],
                    ["`json.loads` of the request body", fmt(comp["json_parse_body_us"], 1, " µs")],
                ],
            ),
        ]
    return lines


def _profile(results: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    prof = results.get("profile")
    if prof and prof.get("samples"):
        lines += [
            "",
            f"**Where the sidecar's CPU goes** under the c={results.get('concurrency')} load "
            f"(py-spy record, {prof['samples']} samples at 200 Hz; raw collapsed stacks in "
            "[bench/results/overhead-sidecar-profile.txt]"
            "(bench/results/overhead-sidecar-profile.txt))",
            "",
            table(
                ["self time by package", "share", "the sidecar's functions (inclusive)", "share"],
                [
                    [
                        a[0] if a else "",
                        f"{a[1]:.0%}" if a else "",
                        b[0] if b else "",
                        f"{b[1]:.0%}" if b else "",
                    ]
                    for a, b in itertools.zip_longest(
                        prof["self_by_package"], prof["sidecar_inclusive"]
                    )
                ],
            ),
            "",
            "Hottest lines (self): "
            + "; ".join(f"`{k}` {v:.0%}" for k, v in prof["hottest_lines"][:6])
            + ".",
        ]
    elif prof:
        lines += ["", f"py-spy failed: `{prof.get('error')}`"]
    return lines


def report(results: dict[str, Any], fig: dict[str, Any], command: str) -> str:
    """The BENCHMARKS.md section: targets, then one table per test, then what explains them."""
    lines = [
        *_summary(results, fig, command),
        *_latency(fig),
        *_throughput(results, fig),
        *_sse(results, fig),
        *_memory(results),
        *_vs_baseline(results, fig),
        *_components(results),
        *_profile(results),
    ]
    return "\n".join(lines)
