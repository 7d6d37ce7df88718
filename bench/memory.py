"""The sidecar's memory with a real-sized vocabulary: RSS and PSS of the owner and each relay
worker, read from /proc, at rest, after a warm-up, at the peak of long-prompt traffic, and after.

Each configuration starts the fast fake vLLM and a real ``kv-sidecar serve --tokenizer DIR
--workers N`` (DIR: ``harness.big_vocab``'s generated 151,665-token model unless ``--tokenizer``
names another), waits for it to be ready and for its processes' memory to settle (the tokenizer
loads in the background), sends short chats and completions, then long prompts (completions
and chats of ``--long-words`` corpus words, some 4 characters a token) at a concurrency above
the counting slots, so that every counting thread holds a tokenizer copy at once, sampling every
process every 0.1 s. VmHWM, each process's high-water mark, is read at the end too.

PSS (``/proc/PID/smaps_rollup``) shares each page among the processes that map it: the sum of
the processes' PSS is what the container's memory holds of them (its cgroup counts a shared page
once), where the sum of their RSS counts the interpreter and libraries once per process.

``--python`` runs the sidecar with another interpreter (a venv made from ``requirements.lock``,
what the image holds); ``--worktree`` runs another checkout's ``sidecar`` package (an older
commit, from ``git worktree add``), labelled with its commit::

    flock /tmp/bench.lock python -m bench.memory --workers 1 4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from harness.bench_util import ROOT, ProcStat, children_pids, machine, progress, write_json
from harness.big_vocab import ensure_big_vocab_model, sample
from harness.fake_vllm_fast import FakeVllmProcess
from harness.local import free_port, stop_group

MIB = 2**20
SAMPLE_EVERY_S = 0.1


def pss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as fh:
        for line in fh:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def reading(pids: list[int]) -> dict[str, dict[str, int]]:
    out = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            out[str(pid)] = {"rss": ProcStat(pid).rss_bytes(), "pss": pss_bytes(pid)}
    return out


class Sampler(threading.Thread):
    """Each process's largest RSS and PSS, and the largest sums, while the traffic runs."""

    def __init__(self, pids: list[int]) -> None:
        super().__init__(daemon=True)
        self.pids = pids
        self.peak: dict[str, dict[str, int]] = {}
        self.peak_sum = {"rss": 0, "pss": 0}
        self._done = threading.Event()

    def sample(self) -> None:
        now = reading(self.pids)
        for pid, values in now.items():
            mine = self.peak.setdefault(pid, {"rss": 0, "pss": 0})
            for key, value in values.items():
                mine[key] = max(mine[key], value)
        for key in ("rss", "pss"):
            self.peak_sum[key] = max(self.peak_sum[key], sum(v[key] for v in now.values()))

    def run(self) -> None:
        while not self._done.wait(SAMPLE_EVERY_S):
            self.sample()

    def __enter__(self) -> Sampler:
        self.sample()
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self.join()
        self.sample()


def settle(pids: list[int], timeout: float = 180.0) -> None:
    """Wait until no process's RSS has moved by more than 1 MiB for 5 s."""
    last, still_since, deadline = reading(pids), time.monotonic(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = reading(pids)
        if any(abs(now[p]["rss"] - last[p]["rss"]) > MIB for p in now if p in last):
            still_since = time.monotonic()
        last = now
        if time.monotonic() - still_since >= 5.0:
            return
    raise TimeoutError("the sidecar's memory did not settle")


def traffic(url: str, bodies: list[tuple[str, dict[str, Any]]], concurrency: int) -> list[int]:
    def one(item: tuple[str, dict[str, Any]]) -> int:
        path, body = item
        with httpx.Client(timeout=300) as client:
            return client.post(url + path, json=body).status_code

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, bodies))


def measure(args: argparse.Namespace, workers: int, tokenizer: Path) -> dict[str, Any]:
    cwd = Path(args.worktree) if args.worktree else ROOT
    commit = subprocess.run(
        ["git", "rev-parse", "--short=12", "HEAD"], cwd=cwd, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "sidecar"], cwd=cwd, capture_output=True, text=True
    ).stdout.splitlines()
    port, metrics_port = free_port(), free_port()
    flags = ["--workers", str(workers), "--tokenizer", str(tokenizer), "--log-level", "warning"]
    flags += ["--model-config", str(tokenizer / "config.json")]
    with FakeVllmProcess(tokenizer, max_model_len=131_072, served_name="big") as upstream:
        cmd = [args.python, "-m", "sidecar", "serve", "--upstream", upstream.url]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port)]
        log = open(f"/tmp/bench-memory-{port}.log", "wb")
        proc = subprocess.Popen(
            [*cmd, *flags], cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 180
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"sidecar did not start: /tmp/bench-memory-{port}.log")
                with contextlib.suppress(httpx.HTTPError):
                    ready = httpx.get(f"http://127.0.0.1:{metrics_port}/readyz", timeout=2)
                    if ready.status_code == 200:
                        break
                time.sleep(0.2)
            pids = [proc.pid, *children_pids(proc.pid)]
            if len(pids) != (workers + 1 if workers > 1 else 1):
                raise RuntimeError(f"processes {pids} for --workers {workers}")
            settle(pids)
            result: dict[str, Any] = {
                "workers": workers,
                "commit": commit + ("+dirty" if dirty else ""),
                "python": args.python,
                "flags": flags,
                "pids": {"owner": proc.pid, "workers": pids[1:]},
                "rest": reading(pids),
            }
            url = f"http://127.0.0.1:{port}"
            short = [
                (
                    "/v1/chat/completions",
                    {
                        "model": "big",
                        "max_tokens": 8,
                        "messages": [{"role": "user", "content": sample(40 + i)}],
                    },
                )
                for i in range(100)
            ] + [
                ("/v1/completions", {"model": "big", "max_tokens": 8, "prompt": sample(30 + i)})
                for i in range(100)
            ]
            statuses = traffic(url, short, 8)
            settle(pids)
            result["after_warm_up"] = reading(pids)
            long_text = sample(args.long_words)
            bodies: list[tuple[str, dict[str, Any]]] = []
            for i in range(args.long_requests):
                text = f"{i} {long_text}"
                if i % 2:
                    bodies.append(
                        ("/v1/completions", {"model": "big", "max_tokens": 8, "prompt": text})
                    )
                else:
                    bodies.append(
                        (
                            "/v1/chat/completions",
                            {
                                "model": "big",
                                "max_tokens": 8,
                                "messages": [{"role": "user", "content": text}],
                            },
                        )
                    )
            progress(f"memory: --workers {workers}: {len(bodies)} long prompts")
            with Sampler(pids) as sampler:
                long_statuses = traffic(url, bodies, args.concurrency)
            result["peak_sampled"] = sampler.peak
            result["peak_sampled_sum"] = sampler.peak_sum
            result["high_water_mark"] = {str(p): ProcStat(p).peak_rss_bytes() for p in pids}
            time.sleep(2.0)
            result["after_load"] = reading(pids)
            result["statuses"] = {
                "short": {str(s): statuses.count(s) for s in set(statuses)},
                "long": {str(s): long_statuses.count(s) for s in set(long_statuses)},
            }
            metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
            # how the prompts were counted: local (the tokenizer) is what the figures are about
            result["prompt_counts"] = [
                line for line in metrics.splitlines() if line.startswith("kv_sidecar_prompt_counts")
            ]
            return result
        finally:
            stop_group(proc)
            log.close()


def summary(result: dict[str, Any]) -> list[str]:
    owner = str(result["pids"]["owner"])
    rows = []
    for phase in ("rest", "after_warm_up", "peak_sampled", "after_load"):
        values = result[phase]
        workers = [values[str(p)]["rss"] / MIB for p in result["pids"]["workers"]]
        pss = sum(v["pss"] for v in values.values()) / MIB
        rss = sum(v["rss"] for v in values.values()) / MIB
        rows.append(
            f"{phase}: owner {values[owner]['rss'] / MIB:.1f} MiB"
            + (f", workers {', '.join(f'{w:.1f}' for w in workers)} MiB" if workers else "")
            + f"; RSS sum {rss:.1f} MiB, PSS sum {pss:.1f} MiB"
        )
    return rows


PHASES = (
    ("rest", "at rest"),
    ("after_warm_up", "after the warm-up"),
    ("peak_sampled", "peak (sampled)"),
    ("after_load", "after the load"),
)


def _mib(value: float) -> str:
    return f"{value / MIB:,.1f}"


def report(files: list[Path]) -> str:
    """The tables of BENCHMARKS.md's memory section, from results files (each its runs)."""
    per_process = [
        "| code | venv | `--workers` | process | "
        + " | ".join(title for _, title in PHASES)
        + " | VmHWM |",
        "|---|---|---|---|" + "---|" * (len(PHASES) + 1),
    ]
    sums = [
        "| code | venv | `--workers` | RSS sum at rest | PSS sum at rest | PSS sum, peak "
        "(sampled) | RSS sum, peak (sampled) | long prompts answered |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for path in files:
        data = json.loads(path.read_text())
        for run in data["runs"]:
            code = f"`{run['commit']}`"
            venv = Path(run["python"]).parent.parent.name
            owner = str(run["pids"]["owner"])
            workers = [str(p) for p in run["pids"]["workers"]]
            roles = [("owner" if workers else "the one process", [owner])]
            if workers:
                roles.append((f"each of {len(workers)} workers (min-max)", workers))
            for role, pids in roles:
                cells = []
                for phase, _ in PHASES:
                    values = [run[phase][p]["rss"] for p in pids]
                    low, high = min(values), max(values)
                    cells.append(_mib(low) if low == high else f"{_mib(low)}-{_mib(high)}")
                hwm = [run["high_water_mark"][p] for p in pids]
                low, high = min(hwm), max(hwm)
                cells.append(_mib(low) if low == high else f"{_mib(low)}-{_mib(high)}")
                per_process.append(
                    f"| {code} | {venv} | {run['workers']} | {role} | " + " | ".join(cells) + " |"
                )
            rest = run["rest"].values()
            answered = run["statuses"]["long"]
            sums.append(
                f"| {code} | {venv} | {run['workers']} | {_mib(sum(v['rss'] for v in rest))} | "
                f"{_mib(sum(v['pss'] for v in rest))} | {_mib(run['peak_sampled_sum']['pss'])} | "
                f"{_mib(run['peak_sampled_sum']['rss'])} | "
                + ", ".join(f"{n} x {code}" for code, n in sorted(answered.items()))
                + " |"
            )
    return "\n".join(
        [
            "RSS of each process, MiB (VmRSS from /proc/PID/status; peak: the largest of the "
            "samples every 0.1 s; VmHWM: the process's own high-water mark):",
            "",
            *per_process,
            "",
            "The processes together, MiB (PSS from /proc/PID/smaps_rollup: a page shared by k "
            "processes counts 1/k in each; the peaks are the largest sums of one sample):",
            "",
            *sums,
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--worktree", default=None)
    parser.add_argument("--long-words", type=int, default=30_000)
    parser.add_argument("--long-requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--out", default="memory")
    parser.add_argument("--quick", action="store_true", help="one small run (a smoke test)")
    parser.add_argument(
        "--report", type=Path, nargs="+", default=None, help="print the tables of these results"
    )
    args = parser.parse_args(argv)
    if args.report:
        print(report(args.report))
        return 0
    if args.quick:
        args.workers, args.long_words, args.long_requests = [1], 2_000, 4
    tokenizer = args.tokenizer or ensure_big_vocab_model()
    runs = []
    for workers in args.workers:
        progress(f"memory: --workers {workers}")
        result = measure(args, workers, tokenizer)
        for line in summary(result):
            progress(f"memory: --workers {workers}: {line}")
        runs.append(result)
    results = {"machine": machine(), "tokenizer": str(tokenizer), "runs": runs}
    if not args.quick:
        path = write_json(args.out, results)
        progress(f"memory: written {path}")
    else:
        print(json.dumps(results)[:2000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
