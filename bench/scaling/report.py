"""The scaling benchmark's chart (one panel per curve) and its section of BENCHMARKS.md, with
the CPU request worked out from the figures."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.scaling.run import SMALL_CONNECTIONS
from harness.bench_util import fmt, machine_line, table


def _err(points: Sequence[dict[str, float]], scale: float = 1.0) -> list[list[float]]:
    return [
        [(p["median"] - p["min"]) * scale for p in points],
        [(p["max"] - p["median"]) * scale for p in points],
    ]


def _twin_legend(ax: Any, twin: Any) -> None:
    """One legend under the panel for the lines of both y axes."""
    lines, labels = ax.get_legend_handles_labels()
    more, more_labels = twin.get_legend_handles_labels()
    ax.legend(
        lines + more,
        labels + more_labels,
        fontsize=7,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.14),
        ncol=2,
    )


def chart(results: dict[str, Any], fig: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(18, 5), layout="constrained")
    _panel_connections(ax1, results, fig)
    _panel_prompts(ax2, results, fig)
    _panel_in_flight(ax3, results, fig)
    figure.suptitle(
        "kv-sidecar (one process) in front of a fast fake vLLM; medians over "
        f"{results['rounds']} rounds, bars min-max; shared 2-core VM (load generator, fake and "
        "sidecar on the same cores)",
        fontsize=9,
    )
    figure.savefig(path, dpi=90)
    plt.close(figure)


def _panel_connections(ax1: Any, results: dict[str, Any], fig: dict[str, Any]) -> None:
    # 1. connections
    rps_ax = ax1.twinx()
    for i, (name, per) in enumerate(fig["connections"].items()):
        cs = [int(c) for c in per]
        pts = list(per.values())
        if name != "direct":
            cpu = [p["cpu_us_per_request"] for p in pts]
            ax1.errorbar(
                cs,
                [p["median"] for p in cpu],
                yerr=_err(cpu),
                marker="o",
                capsize=3,
                color=f"C{i}",
                label=f"{name}: CPU per request",
            )
        rps = [p["rps"] for p in pts]
        rps_ax.errorbar(
            cs,
            [p["median"] for p in rps],
            yerr=_err(rps),
            marker="s",
            linestyle="--",
            capsize=3,
            color=f"C{i}",
            alpha=0.6,
            label=f"{name}: requests/s",
        )
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(results["settings"]["connections"], map(str, results["settings"]["connections"]))
    ax1.set_xlabel("wrk connections (small non-streamed completions)")
    ax1.set_ylabel("sidecar CPU per request (µs)")
    ax1.set_ylim(bottom=0)
    rps_ax.set_yscale("log")
    rps_ax.set_ylabel("requests/s (dashed)")
    _twin_legend(ax1, rps_ax)
    ax1.set_title("CPU per request against connections")


def _panel_prompts(ax2: Any, results: dict[str, Any], fig: dict[str, Any]) -> None:
    # 2. prompt length
    per = fig["prompts"]["sidecar"]
    dper = fig["prompts"]["direct"]
    lengths = results["settings"]["lengths"]
    for i, c in enumerate(results["settings"]["prompt_connections"]):
        pts = [per[f"{n}x{c}"]["cpu_ms_per_request"] for n in lengths]
        ax2.errorbar(
            lengths,
            [p["median"] for p in pts],
            yerr=_err(pts),
            marker="o",
            capsize=3,
            color=f"C{i}",
            label=f"sidecar, {c} connection{'s' if c > 1 else ''}",
        )
        ups = [dper[f"{n}x{c}"]["upstream_cpu_ms_per_request"]["median"] for n in lengths]
        ax2.plot(
            lengths,
            ups,
            ":",
            marker=".",
            color=f"C{i}",
            label=f"fake vLLM's own CPU, direct, {c} conn.",
        )
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("prompt tokens (completions, max_tokens 1)")
    ax2.set_ylabel("CPU per request (ms)")
    ax2.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    ax2.set_title("CPU per request against prompt length")


def _panel_in_flight(ax3: Any, results: dict[str, Any], fig: dict[str, Any]) -> None:
    # 3. in flight
    inf = fig["in_flight"]
    ns = [int(n) for n in inf]
    pts = [inf[str(n)]["cpu_us_per_small_request"] for n in ns]
    ax3.errorbar(
        ns,
        [p["median"] for p in pts],
        yerr=_err(pts),
        marker="o",
        capsize=3,
        color="C0",
        label=f"CPU per small request (c={SMALL_CONNECTIONS}), streams' cost subtracted",
    )
    raw = [inf[str(n)]["cpu_us_per_small_request_unsubtracted"]["median"] for n in ns]
    ax3.plot(
        ns,
        raw,
        "--",
        marker=".",
        color="C0",
        alpha=0.5,
        label="CPU per small request, streams' cost not subtracted",
    )
    dec = [inf[str(n)]["decision_mean_us"] for n in ns]
    ax3.errorbar(
        ns,
        [p["median"] for p in dec],
        yerr=_err(dec),
        marker="s",
        capsize=3,
        color="C3",
        label="mean admission decision (µs, the sidecar's wall-clock timer)",
    )
    pace = results["settings"]["stream_interval_ms"]
    ax3.set_xlabel(f"SSE streams held in flight (one event per {pace:g} ms)")
    ax3.set_xticks(ns)
    ax3.set_ylabel("µs")
    ax3.set_ylim(bottom=0)
    cost_ax = ax3.twinx()
    alone = [inf[str(n)]["alone_cpu_ms_per_s"] for n in ns]
    cost_ax.errorbar(
        ns,
        [p["median"] for p in alone],
        yerr=_err(alone),
        marker="^",
        linestyle=":",
        capsize=3,
        color="C2",
        label="streams alone: sidecar CPU (ms per s)",
    )
    cost_ax.set_ylabel("sidecar CPU with the streams alone (ms per second)")
    cost_ax.set_ylim(bottom=0)
    _twin_legend(ax3, cost_ax)
    ax3.set_title("CPU per request against requests in flight")


def _m(p: dict[str, float], digits: int = 0, unit: str = "") -> str:
    """A median with its min-max range."""
    return f"{fmt(p['median'], digits, unit)} ({fmt(p['min'], digits)}-{fmt(p['max'], digits)})"


def _intro(results: dict[str, Any], command: str) -> list[str]:
    rounds = results["rounds"]
    la = results["load_average"]
    run_line = machine_line(results["machine"], results.get("load_average_after"))
    lines = [
        f"Command: `{command}`; {run_line}. The machine is a shared 2-core VM: the load "
        "generator (wrk or the bench's client), the fake vLLM and the sidecar run on the same "
        "two cores, so a sidecar that could use a whole core rarely gets one, and the requests/s "
        "below are the machine's, not the sidecar's alone. "
        f"Load average (1, 5, 15 min): start {' '.join(map(str, la['start']))}, after curve 1 "
        f"{' '.join(map(str, la['after_connections']))}, after curve 2 "
        f"{' '.join(map(str, la['after_prompts']))}, after curve 3 "
        f"{' '.join(map(str, la['after_in_flight']))}.",
        "",
        "Sidecar code: "
        + (
            "as committed (`git status` shows no change under `sidecar/`)"
            if not results.get("sidecar_code_changes", ["?"])
            else f"changed from the commit: {results.get('sidecar_code_changes', 'not recorded')}"
        )
        + ".",
        "",
        f"One sidecar process, default flags (`{' '.join(results['sidecar_flags'])}`; "
        "`--workers auto`, which is one process where no CPU quota is set, as here), counting "
        f"with the local tokenizer ({fmt(results['counted_by']['local_counts'], 0)} of "
        f"{fmt(results['counted_by']['prompt_counts'], 0)} warm-up counts `exact_local`). CPU: the "
        "sidecar process's user + system time (all threads) over the run, divided by the "
        f"requests it served. Every figure is the **median over {rounds} interleaved rounds**, "
        "with the min-max of the rounds in brackets.",
        "",
        f"**1. Against connections** (`wrk -t1 -cN`, {results['seconds_per_run']:g} s per run; "
        "small non-streamed completion, ~20-token prompt, `max_tokens` 16)",
        "",
    ]
    return lines


def _connections_table(fig: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    rows = []
    for name, per in fig["connections"].items():
        for c, v in per.items():
            sidecar_row = name != "direct"
            rows.append(
                [
                    name,
                    c,
                    _m(v["rps"]),
                    fmt(v["rps_ratio_to_direct"]["median"], 3) if sidecar_row else "1",
                    _m(v["cpu_us_per_request"]) if sidecar_row else "-",
                    fmt(v["cores"]["median"], 2) if sidecar_row else "-",
                    fmt(v["upstream_cpu_us_per_request"]["median"], 0),
                    fmt(v["p50_us"]["median"] / 1e3, 2),
                    fmt(v["p99_us"]["median"] / 1e3, 2),
                    v["errors"],
                ]
            )
    lines.append(
        table(
            [
                "path",
                "connections",
                "req/s",
                "/ direct",
                "sidecar CPU µs per request",
                "sidecar cores busy",
                "fake vLLM CPU µs per request",
                "p50 ms",
                "p99 ms",
                "errors",
            ],
            rows,
        )
    )
    return lines


def _prompts_table(results: dict[str, Any], fig: dict[str, Any]) -> list[str]:
    s = results["settings"]
    secs = results["seconds_per_run"]
    lines: list[str] = []
    lines += [
        "",
        "**2. Against prompt length** (completions of about "
        f"{', '.join(f'{n:,}' for n in s['lengths'])} tokens, {s['texts_per_length']} distinct "
        "texts each, `max_tokens` 1; a closed-loop client that finishes every request it "
        f"starts; {secs:g} s per run, twice "
        "that through the sidecar for 32k tokens and more; tokens per request: the sidecar's own "
        "count)",
        "",
    ]
    rows = []
    sc, dr = fig["prompts"]["sidecar"], fig["prompts"]["direct"]
    for cell, v in sc.items():
        n, c = cell.split("x")
        d = dr[cell]
        rows.append(
            [
                f"{int(n):,}",
                fmt(v["prompt_tokens_per_request"]["median"], 0),
                c,
                _m(v["rps"], 1),
                _m(v["cpu_ms_per_request"], 2),
                fmt(v["cpu_us_per_prompt_token"]["median"], 2),
                fmt(v["cores"]["median"], 2),
                fmt(v["p50_ms"]["median"], 1),
                fmt(d["rps"]["median"], 1),
                fmt(d["upstream_cpu_ms_per_request"]["median"], 2),
                f"{v['errors']} / {d['errors']}",
            ]
        )
    lines.append(
        table(
            [
                "prompt tokens",
                "counted per request",
                "connections",
                "sidecar req/s",
                "sidecar CPU ms per request",
                "sidecar CPU µs per prompt token",
                "sidecar cores busy",
                "sidecar p50 ms",
                "direct req/s",
                "fake vLLM CPU ms per request (direct)",
                "errors sidecar / direct",
            ],
            rows,
        )
    )
    return lines


def _in_flight_table(results: dict[str, Any], fig: dict[str, Any]) -> list[str]:
    s = results["settings"]
    secs = results["seconds_per_run"]
    lines: list[str] = []
    lines += [
        "",
        f"**3. Against requests in flight** (N streamed completions held open through the "
        f"sidecar, `max_tokens` {s['stream_max_tokens']:,}, one event per "
        f"{s['stream_interval_ms']:g} ms each, read by a light client process; every one "
        "admitted: `/state` `in_flight` = N before each window. First "
        f"{secs:g} s with the streams alone, then {secs:g} s of "
        f"`wrk -t1 -c{s['small_connections']}` small requests beside them. CPU per small "
        "request: the sidecar's CPU over the wrk window less the streams-alone rate times the "
        "window, divided by the requests; decision: `kv_sidecar_decision_seconds` sum / count "
        "over the wrk window)",
        "",
    ]
    rows = []
    for n, v in fig["in_flight"].items():
        rows.append(
            [
                n,
                f"{v['in_flight_seen_min']} / {v['in_flight_after_min']}",
                _m(v["alone_cpu_ms_per_s"], 1),
                fmt(v["events_per_s"]["median"], 0),
                fmt(v["holder_cpu_ms_per_s"]["median"], 0),
                _m(v["rps"]),
                fmt(v["load_cpu_ms_per_s"]["median"], 0),
                _m(v["cpu_us_per_small_request"]),
                fmt(v["cpu_us_per_small_request_unsubtracted"]["median"], 0),
                _m(v["decision_mean_us"], 1),
                fmt(v["p50_us"]["median"] / 1e3, 2),
                fmt(v["p99_us"]["median"] / 1e3, 2),
                f"{v['errors']} / {v['streams_refused']} / {v['streams_ended_early']}",
            ]
        )
    lines.append(
        table(
            [
                "streams N",
                "in_flight before / after (min)",
                "streams alone: sidecar CPU ms per s",
                "events/s relayed",
                "stream client CPU ms per s",
                "small req/s",
                "sidecar CPU ms per s (with wrk)",
                "CPU µs per small request (streams subtracted)",
                "not subtracted",
                "decision mean µs",
                "p50 ms",
                "p99 ms",
                "errors / streams refused / ended early",
            ],
            rows,
        )
    )
    return lines


def _closing(results: dict[str, Any], fig: dict[str, Any], png: str) -> list[str]:
    secs = results["seconds_per_run"]
    lines: list[str] = []
    lines += [
        "",
        f"CPU times come from `/proc` in 10 ms ticks: over a {secs:g} s window a figure in ms "
        f"per second moves in steps of {10 / secs:.1f} ms/s. Where the sidecar is at one core "
        "with wrk beside the streams (the loop's ceiling; the 'with wrk' column), the streams "
        "likely relay more events per turn of the loop than alone and so cost less than their "
        "alone rate: the subtracted figure then leans low and the unsubtracted one is the upper "
        "bound.",
        "",
        f"![scaling: CPU per request]({png})",
        "",
        *deploy_text(fig),
    ]
    return lines


def report(results: dict[str, Any], fig: dict[str, Any], command: str, png: str) -> str:
    lines = [
        *_intro(results, command),
        *_connections_table(fig),
        *_prompts_table(results, fig),
        *_in_flight_table(results, fig),
        *_closing(results, fig, png),
    ]
    return "\n".join(lines)


def deploy_text(fig: dict[str, Any]) -> list[str]:
    d = fig["deploy"]
    idle, per_stream = d["idle_millicores"], d["per_stream_millicores"]
    per_req = d["cpu_us_per_small_request"]
    budget = d["shipped_request_millicores"] - idle
    cs = list(per_req)
    lines = [
        "**The CPU request, from these figures** (all medians above; millicores = ms of CPU per "
        "second):",
        "",
        "    CPU request = idle + R x (CPU per request at the expected concurrency and prompt "
        "length) + S x (CPU per held stream)",
        "",
        f"- idle (the scrape loop, nothing in flight): {fmt(idle, 1)} m (curve 3, N = 0);",
        f"- one held stream at {d['stream_events_per_s']:g} events/s: "
        f"({fmt(d['streams_alone_at_n_millicores'], 1)} - {fmt(idle, 1)}) / "
        f"{d['per_stream_from_n']} = {fmt(per_stream, 3)} m (curve 3, N = "
        f"{d['per_stream_from_n']}), {fmt(d['per_event_us'], 1)} µs per relayed event; the "
        "same slope from the smaller N: "
        + ", ".join(f"{fmt(v, 3)} m at N = {n}" for n, v in d["per_stream_millicores_by_n"].items())
        + " (the more streams, the more events share a turn of the loop);",
        "- a small non-streamed request: "
        + ", ".join(
            f"{fmt(per_req[c], 0)} µs at {c} connection{'s' if c != '1' else ''}" for c in cs
        )
        + " (curve 1);",
        f"- one process served at most {fmt(d['peak_rps_one_process'], 0)} small requests/s here "
        "(curve 1's best median; the loop is one core, shared with wrk and the fake).",
        "",
        "Curve 1's figures include the idle cost spread over the requests (at 1 connection "
        f"{fmt(idle, 1)} m / {fmt(d['rps_at_1'], 0)} req/s = {fmt(idle / d['rps_at_1'] * 1e3, 1)}"
        " µs per request), so adding the idle term counts it twice, on the safe side.",
        "",
        f"The shipped request of {d['shipped_request_millicores']}m leaves {fmt(budget, 1)} m "
        "after the idle cost, which covers "
        + ", ".join(
            f"{fmt(budget / (per_req[c] / 1e3), 0)} small requests/s at {c} connection"
            f"{'s' if c != '1' else ''}"
            for c in cs
        )
        + "; "
        + "; ".join(_with_streams(d, n, per_stream) for n in ("100", "200", "500"))
        + ". Long prompts: "
        + ", ".join(
            f"{fmt(v, 2)} req/s of {int(cell.split('x')[0]):,} tokens at {cell.split('x')[1]} "
            f"connection{'s' if cell.split('x')[1] != '1' else ''}"
            for cell, v in d["covers_prompt_rps"].items()
        )
        + ".",
    ]
    ex = d.get("example")
    if ex:
        n, c = ex["prompt_cell"].split("x")
        lines += [
            "",
            f"A worked example: {ex['streams']} streams decoding at {ex['tokens_per_s_each']} "
            f"tokens/s each ({fmt(ex['events_per_s'], 0)} events/s, near the "
            f"{fmt(fig['in_flight'][str(d['per_stream_from_n'])]['events_per_s']['median'], 0)} "
            f"relayed at N = {d['per_stream_from_n']}) cost {fmt(ex['events_per_s'], 0)} x "
            f"{fmt(d['per_event_us'], 1)} µs = {fmt(ex['streams_millicores'], 0)} m; "
            f"{ex['rps']} requests/s of {int(n):,}-token prompts (at {c} connections: "
            f"{fmt(ex['cpu_ms_per_request'], 2)} ms each) cost "
            f"{fmt(ex['requests_millicores'], 0)} m; with the idle "
            f"{fmt(idle, 1)} m, {fmt(ex['total_millicores'], 0)} m in all.",
        ]
    return lines


def _with_streams(d: dict[str, Any], n: str, per_stream: float) -> str:
    covers = d["covers_small_rps_with_streams"][n]
    streams = int(n) * per_stream
    head = f"with {n} streams held ({fmt(streams, 0)} m of their own)"
    if all(v <= 0 for v in covers.values()):
        return f"{head} it covers no small requests at all"
    return (
        f"{head} it covers "
        + ", ".join(f"{fmt(max(v, 0.0), 0)} at {c}" for c, v in covers.items())
        + " connections"
    )
