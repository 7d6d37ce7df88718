"""What ``--stream-usage`` costs the relay: streams whose client asked for no usage, through a
sidecar that asks vLLM for the usage on every event (``every-event``) and one that asks for the
final count (``final``), each reading and stripping what it asked for, against one that asks for
nothing (``off``), on the same fake vLLM in the same rounds.

    python -m bench.stream_usage                 # 5 rounds of 4 s a path; a minute or two
    python -m bench.stream_usage --rounds 2 --seconds 2   # a smoke run

Set-up, each part its own process: the fast fake vLLM (``harness.fake_vllm_fast``, on the tiny
model's tokenizer), which writes
vLLM 0.32's continuous usage stats into every event when asked, as vLLM does; two sidecars in
front of it (``--log-level warning``), one per ``--stream-usage`` mode; load from
``bench.sse_client --no-usage`` (completions streamed with no ``stream_options``, ``--events``
tokens each, ``--concurrency`` connections, unpaced). The rounds rotate which sidecar goes
first. Per round and path: events relayed per second, and the sidecar's CPU per 1,000 events
(from /proc); the ratios are taken within each round, and the figures are their medians.
Writes ``bench/results/stream-usage.json``.

    python -m bench.stream_usage --vllm          # the real vLLM CPU build: a few minutes

With ``--vllm``, what asking costs vLLM itself: streams sent to it directly, unasked and asked
for the usage on every event, in turns (:func:`run_vllm`); ``bench/results/stream-usage-vllm.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness.bench_util import ProcStat
from harness.fake_vllm_fast import FakeVllmProcess
from harness.local import ROOT
from harness.vllm_cpu import ensure_tokenizer_model
from harness.workload import SidecarProcess

RESULTS = ROOT / "bench" / "results" / "stream-usage.json"
#: the sidecars compared, ``--stream-usage`` of each; the ratios are to the last
MODES = ["every-event", "final", "off"]


def _stream(url: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "bench.sse_client", url,
        "--concurrency", str(args.concurrency),
        "--events", str(args.events),
        "--duration", str(args.seconds),
        "--no-usage",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def _measure(sidecar: SidecarProcess, args: argparse.Namespace) -> dict[str, float]:
    assert sidecar.proc is not None
    stat = ProcStat(sidecar.proc.pid)
    cpu0 = stat.cpu_seconds()
    result = _stream(sidecar.url, args)
    cpu = stat.cpu_seconds() - cpu0
    events = float(result["events"])
    if result["errors"]:
        raise RuntimeError(f"stream errors through {sidecar.url}: {result['last_error']}")
    return {
        "events_per_second": float(result["events_per_second"]),
        "events": events,
        "cpu_seconds": cpu,
        "cpu_ms_per_1000_events": 1e6 * cpu / events if events else float("nan"),
    }


def run(args: argparse.Namespace, model_root: Path) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        upstream = FakeVllmProcess(model_root).start()
        stack.callback(upstream.stop)
        paths = {
            mode: SidecarProcess(upstream.url, "--log-level", "warning", "--stream-usage", mode)
            for mode in MODES
        }
        for sidecar in paths.values():
            stack.enter_context(sidecar)
        for sidecar in paths.values():  # warm: connections, the tokenizer, the JIT of the path
            _stream(sidecar.url, argparse.Namespace(**{**vars(args), "seconds": 1.0}))
        rounds: list[dict[str, dict[str, float]]] = []
        names = list(paths)
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            rounds.append({name: _measure(paths[name], args) for name in order})
            print(json.dumps({"round": r, **rounds[-1]}), flush=True)
    speed = {m: [r[m]["events_per_second"] / r["off"]["events_per_second"] for r in rounds]
             for m in MODES[:-1]}  # fmt: skip
    cost = {
        m: [r[m]["cpu_ms_per_1000_events"] / r["off"]["cpu_ms_per_1000_events"] for r in rounds]
        for m in MODES[:-1]
    }
    return {
        "command": "python -m bench.stream_usage " + " ".join(args.argv),
        "settings": {
            k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "argv"
        },
        "rounds": rounds,
        "events_per_second_ratio_to_off_by_round": speed,
        "cpu_per_event_ratio_to_off_by_round": cost,
        "median_events_per_second_ratio_to_off": {
            m: statistics.median(v) for m, v in speed.items()
        },
        "median_cpu_per_event_ratio_to_off": {m: statistics.median(v) for m, v in cost.items()},
        "median_events_per_second": {
            n: statistics.median(r[n]["events_per_second"] for r in rounds) for n in names
        },
        "median_cpu_ms_per_1000_events": {
            n: statistics.median(r[n]["cpu_ms_per_1000_events"] for r in rounds) for n in names
        },
        "finished_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }


#: ``--vllm``: what the usage on every event costs vLLM's own API server
VLLM_RESULTS = ROOT / "bench" / "results" / "stream-usage-vllm.json"
ASKED = {"include_usage": True, "continuous_usage_stats": True}


def run_vllm(args: argparse.Namespace) -> dict[str, Any]:
    """The real vLLM CPU build, streams sent to it directly: bursts of ``--vllm-streams``
    completions of ``--vllm-tokens`` tokens (``ignore_eos``), unasked and asked for the usage
    on every event in turns; per burst, the API server's CPU (the process group's leader, which
    writes the events) per 1,000 events, and the burst's wall time."""
    import asyncio

    from harness.vllm_cpu import VllmServer
    from harness.workload import burst, make_prompts

    server = VllmServer().start()
    try:
        assert server.proc is not None and server.model_dir is not None
        api = ProcStat(server.proc.pid)
        prompts = make_prompts(server.model_dir, args.vllm_streams, 64, seed=5)
        names = ["unasked", "asked"]
        rounds: list[dict[str, dict[str, float]]] = []
        for extra in (None, {"stream_options": ASKED}):  # warm both ways
            asyncio.run(burst(server.url, prompts, max_tokens=64, extra=extra))
        for r in range(args.rounds):
            row = {}
            for name in names if r % 2 == 0 else names[::-1]:
                extra = {"stream_options": ASKED} if name == "asked" else None
                cpu0, t0 = api.cpu_seconds(), time.perf_counter()
                results = asyncio.run(
                    burst(server.url, prompts, max_tokens=args.vllm_tokens, extra=extra)
                )
                wall, cpu = time.perf_counter() - t0, api.cpu_seconds() - cpu0
                tokens = sum(res.completion_tokens for res in results)
                assert tokens == args.vllm_streams * args.vllm_tokens, tokens
                row[name] = {"api_cpu_ms_per_1000_events": 1e6 * cpu / tokens, "wall_s": wall}
            rounds.append(row)
            print(json.dumps({"round": r, **row}), flush=True)
    finally:
        server.stop()
    cpu_ratio = [
        r["asked"]["api_cpu_ms_per_1000_events"] / r["unasked"]["api_cpu_ms_per_1000_events"]
        for r in rounds
    ]
    wall_ratio = [r["asked"]["wall_s"] / r["unasked"]["wall_s"] for r in rounds]
    return {
        "command": "python -m bench.stream_usage " + " ".join(args.argv),
        "rounds": rounds,
        "api_cpu_per_event_ratio_by_round": cpu_ratio,
        "wall_ratio_by_round": wall_ratio,
        "median_api_cpu_per_event_ratio": statistics.median(cpu_ratio),
        "median_wall_ratio": statistics.median(wall_ratio),
        "finished_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.stream_usage", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--events", type=int, default=200, help="tokens (events) a stream")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--vllm",
        action="store_true",
        help="instead: what the usage on every event costs the real vLLM's API server",
    )
    parser.add_argument("--vllm-streams", type=int, default=16)
    parser.add_argument("--vllm-tokens", type=int, default=800)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.vllm:
        results = run_vllm(args)
    else:
        results = run(args, ensure_tokenizer_model())
    out = args.out or (VLLM_RESULTS if args.vllm else RESULTS)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k.startswith("median")}))


if __name__ == "__main__":
    main()
