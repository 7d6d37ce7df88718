"""``python -m bench.overhead``: the command line; the run and the report are their modules'."""

from __future__ import annotations

import argparse
import shutil
import sys
from typing import Any

import bench.overhead
from bench.overhead.report import figures, report
from bench.overhead.run import run
from harness.bench_util import RESULTS, ROOT, progress, update_section, write_json


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.overhead",
        description=bench.overhead.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="2 rounds of 2 s (smoke run)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=4.0, help="per path, test and round")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--sse-events", type=int, default=200)
    parser.add_argument("--sse-concurrency", type=int, default=32)
    parser.add_argument("--sse-paced-concurrency", type=int, default=256)
    parser.add_argument("--sse-interval-ms", type=float, default=10.0)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="also measure a sidecar with this many relay worker processes (--workers N), its "
        "CPU summed over the main process and the workers",
    )
    parser.add_argument("--no-report", action="store_true", help="do not touch BENCHMARKS.md")
    parser.add_argument(
        "--baseline",
        metavar="REF",
        help="also measure the sidecar of git revision REF (a worktree of it, removed at the end) "
        "in the same rounds: rows 'sidecar @REF' and its token-ids row, and the CPU-per-request "
        "ratio of the sidecar to it",
    )
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    for tool in ("wrk", "nginx"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is missing: run scripts/system-deps.sh --bench")
    RESULTS.mkdir(parents=True, exist_ok=True)
    results = run(args)
    results["concurrency"] = args.concurrency
    fig = figures(results)
    results["figures"] = fig
    write_json("overhead-quick" if args.quick else "overhead", results)
    command = "python -m bench.overhead" + (" --quick" if args.quick else "")
    if args.baseline:
        command += f" --baseline {args.baseline}"
    text = report(results, fig, command)
    print(text)
    if not args.no_report and not args.quick:
        update_section(ROOT / "BENCHMARKS.md", "overhead", text)
    progress("overhead: done")
    return results
