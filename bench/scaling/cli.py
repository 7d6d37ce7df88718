"""``python -m bench.scaling``: the command line (and the light clients' own entry)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import bench.scaling
from bench.scaling.clients import hold_streams, send_loop
from bench.scaling.figures import figures
from bench.scaling.report import chart, report
from bench.scaling.run import SECTION, STREAM_INTERVAL_MS, STREAM_MAX_TOKENS, run
from harness.bench_util import RESULTS, ROOT, progress, update_section, write_json


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.scaling",
        description=bench.scaling.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: fewer points, 1 round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--seconds", type=int, default=3, help="per run (load window; wrk takes whole seconds)"
    )
    parser.add_argument(
        "--interval-ms",
        type=float,
        default=STREAM_INTERVAL_MS,
        help="pace of the held streams' events (curve 3)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="also measure a sidecar with this many relay workers on curve 1 (CPU summed over "
        "its process tree)",
    )
    parser.add_argument("--no-report", action="store_true", help="do not touch BENCHMARKS.md")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="redo the figures, chart and section from bench/results/scaling.json (or "
        "scaling-quick.json with --quick) without measuring",
    )
    # the light clients' own processes
    parser.add_argument("--hold-streams", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--streams", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--max-tokens", type=int, default=STREAM_MAX_TOKENS, help=argparse.SUPPRESS)
    parser.add_argument("--send", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--connections", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--body-files", nargs="+", type=Path, help=argparse.SUPPRESS)
    return parser


def client(args: argparse.Namespace) -> dict[str, Any]:
    """``--hold-streams`` or ``--send``: one of the light clients, in this process."""
    import uvloop

    if args.hold_streams:
        out = uvloop.run(
            hold_streams(args.hold_streams, args.streams, args.max_tokens, args.interval_ms)
        )
    else:
        bodies = [p.read_bytes() for p in args.body_files]
        out = uvloop.run(send_loop(args.send, bodies, args.connections, args.seconds))
    print(json.dumps(out), flush=True)
    return dict(out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    if args.hold_streams or args.send:
        return client(args)
    name = "scaling-quick" if args.quick else "scaling"
    if args.report_only:
        results = dict(json.loads((RESULTS / f"{name}.json").read_text()))
        # a run without the field was made with the defaults
        command = results.setdefault(
            "command", "python -m bench.scaling" + (" --quick" if args.quick else "")
        )
    else:
        if shutil.which("wrk") is None:
            sys.exit("wrk is missing: run scripts/system-deps.sh --bench")
        RESULTS.mkdir(parents=True, exist_ok=True)
        results = run(args)
        command = "python -m bench.scaling" + (" --quick" if args.quick else "")
        for flag, value, default in (
            ("--rounds", args.rounds, 3),
            ("--seconds", args.seconds, 3),
            ("--interval-ms", args.interval_ms, STREAM_INTERVAL_MS),
        ):
            if value != default and not args.quick:
                command += f" {flag} {value:g}"
        if args.workers > 1:
            command += f" --workers {args.workers}"
        results["command"] = command
    fig = figures(results)
    results["figures"] = fig
    chart(results, fig, RESULTS / f"{name}.png")
    text = report(results, fig, command, f"bench/results/{name}.png")
    results["report"] = text
    write_json(name, results)
    print(text)
    if not args.no_report and not args.quick:
        update_section(ROOT / "BENCHMARKS.md", SECTION, text)
    progress("scaling: done")
    return results
