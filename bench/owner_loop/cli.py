"""``python -m bench.owner_loop``: the command line (and the client processes' own entry)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import bench.owner_loop
from bench.owner_loop.client import client_main
from bench.owner_loop.settings import Settings
from harness.bench_util import RESULTS, ROOT, progress, update_section, write_json

SECTION = "owner_loop"
#: the smoke run's settings (each still overridden by its flag)
QUICK = {"rate": 100.0, "in_flight": 200, "seconds": 10.0, "ramp_s": 3.0, "rest_s": 2.0}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.owner_loop",
        description=bench.owner_loop.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = Settings()
    p.add_argument("--rate", type=float, help=f"arrivals per second (default {d.rate:g})")
    p.add_argument(
        "--in-flight",
        type=int,
        help=f"requests in flight to aim at, by Little's law (default {d.in_flight}): sets the "
        "streams' duration",
    )
    p.add_argument(
        "--duration-s", type=float, help="a streamed request's seconds (instead of --in-flight)"
    )
    p.add_argument("--seconds", type=float, help=f"measured window (default {d.seconds:g})")
    p.add_argument("--ramp-s", type=float, help=f"linear ramp before it (default {d.ramp_s:g})")
    p.add_argument("--workers", type=int, help=f"relay workers (default {d.workers})")
    p.add_argument("--clients", type=int, help=f"client processes (default {d.clients})")
    p.add_argument(
        "--stream-share", type=float, help=f"share of streamed requests (default {d.stream_share})"
    )
    p.add_argument(
        "--events", type=int, help=f"events (tokens) per stream (default {d.stream_events})"
    )
    p.add_argument("--quick", action="store_true", help="smoke run: 100/s, 200 in flight, 10 s")
    p.add_argument(
        "--no-report",
        action="store_true",
        help="leave BENCHMARKS.md alone; the JSON goes to owner-loop-<rate>rps.json",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="redo the verdict and the section from bench/results/owner-loop.json (or "
        "owner-loop-quick.json with --quick) without measuring",
    )
    p.add_argument("--client", metavar="PLAN", help=argparse.SUPPRESS)
    return p


def settings_from(args: argparse.Namespace) -> tuple[Settings, str]:
    """The settings, and the command that gives them (the flags that differ from the default)."""
    given = {
        "rate": args.rate,
        "in_flight": args.in_flight,
        "duration_s": args.duration_s,
        "seconds": args.seconds,
        "ramp_s": args.ramp_s,
        "workers": args.workers,
        "clients": args.clients,
        "stream_share": args.stream_share,
        "stream_events": args.events,
    }
    given = {k: v for k, v in given.items() if v is not None}
    base = {**(QUICK if args.quick else {}), **given}
    settings = Settings(**base, quick=args.quick)
    command = "python -m bench.owner_loop" + (" --quick" if args.quick else "")
    flag = {"ramp_s": "--ramp-s", "stream_events": "--events"}
    for key, value in given.items():
        command += f" {flag.get(key, '--' + key.replace('_', '-'))} {value:g}"
    if args.no_report:
        command += " --no-report"
    return settings, command


def other_runs(name: str) -> list[dict[str, Any]]:
    """The other runs kept in bench/results/owner-loop-*.json, one line each (so that the
    section shows every run kept, not only the one it was written from)."""
    out = []
    for path in sorted(RESULTS.glob("owner-loop-*.json")):
        if path.stem in (name, "owner-loop-quick"):
            continue
        r = json.loads(path.read_text())
        w, v = r["lag"]["window"], r.get("verdict", {})
        out.append(
            {
                "file": f"bench/results/{path.name}",
                "date": r["machine"]["date"],
                "commit": r["machine"]["commit"],
                "command": r.get("command", ""),
                "probes": w["probes"],
                "within_5ms": w["within_5ms"],
                "share_within_5ms": w["share_within_5ms"],
                "load_reached": v.get("load_reached"),
                "issue_load": v.get("issue_load"),
                "target_met": v.get("target_met"),
                "others_cores": v.get("cores", {}).get("others"),
            }
        )
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    if args.client:
        client_main(args.client)
        return {}
    from bench.owner_loop.report import report, verdict
    from bench.owner_loop.run import run

    settings, command = settings_from(args)
    if args.quick:
        name = "owner-loop-quick"
    elif args.no_report:
        name = f"owner-loop-{settings.rate:g}rps"
    else:
        name = "owner-loop"
    if args.report_only:
        results = dict(json.loads((RESULTS / f"{name}.json").read_text()))
        command = results["command"]
    else:
        results = run(settings)
        results["command"] = command
    results["verdict"] = verdict(results)
    if not args.quick:
        results["other_runs"] = other_runs(name)
    text = report(results, command)
    results["report"] = text
    path = write_json(name, results)
    print(text)
    if not args.no_report and not args.quick:
        update_section(ROOT / "BENCHMARKS.md", SECTION, text)
    progress(f"owner_loop: done ({path.relative_to(ROOT)})")
    return results
