"""The benchmarks, by name: ``python -m bench`` (``make bench``).

    python -m bench                      # the default set: micro, overhead, admission
    python -m bench --list               # every benchmark and tool, one line each
    python -m bench micro overhead       # these, one after the other
    python -m bench scaling --quick      # one benchmark, with its own arguments
    python -m bench --all                # every benchmark, one after the other (hours)
    python -m bench --quick [NAMES]      # smoke runs: smaller workloads, BENCHMARKS.md untouched

``python -m bench NAME [ARGS]`` is ``python -m bench.NAME [ARGS]`` (the commands BENCHMARKS.md
quotes). Progress goes to stderr; each benchmark rewrites its own section of BENCHMARKS.md
(between ``<!-- bench:NAME -->`` markers) and its JSON in ``bench/results/``. The registry is
``bench/registry.py``.
"""

from __future__ import annotations

import sys
import time

from bench.registry import BENCHMARKS, Benchmark, find, listing
from harness.bench_util import progress


def run_all(benchmarks: list[Benchmark], *, quick: bool) -> None:
    """Each benchmark in turn, with its smoke run's arguments when ``quick``."""
    started = time.monotonic()
    for i, b in enumerate(benchmarks, 1):
        progress(f"bench {i}/{len(benchmarks)}: {b.name}")
        b.main()(list(b.quick or ()) if quick else [])
    progress(f"all done in {(time.monotonic() - started) / 60:.1f} minutes")


def resolve(names: list[str]) -> list[Benchmark] | str:
    """The benchmarks named, or why not."""
    chosen = []
    for name in names:
        try:
            b = find(name)
        except KeyError:
            known = ", ".join(b.name for b in BENCHMARKS)
            return f"unknown benchmark {name!r}; one of {known} (python -m bench --list)"
        if b.tool or b.quick is None:
            return (
                f"{b.name} is a tool: run it alone, with its arguments (python -m bench {name} -h)"
            )
        chosen.append(b)
    return chosen


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args in (["-h"], ["--help"]):
        print((__doc__ or "").strip() + "\n\n" + listing())
        return 0
    if args == ["--list"]:
        print(listing())
        return 0
    if args and not args[0].startswith("-") and not all(_known(a) for a in args):
        # python -m bench NAME ARGS...: that one, with its own arguments
        try:
            b = find(args[0])
        except KeyError:
            print(resolve(args[:1]), file=sys.stderr)
            return 2
        b.main()(args[1:])
        return 0
    quick = "--quick" in args
    everything = "--all" in args
    names = [a for a in args if a not in ("--quick", "--all")]
    if any(a.startswith("-") for a in names):
        print(f"unknown option {names}; see python -m bench --help", file=sys.stderr)
        return 2
    if everything:
        names = names or [b.name for b in BENCHMARKS if not b.tool]
    chosen = resolve(names or [b.name for b in BENCHMARKS if b.default])
    if isinstance(chosen, str):
        print(chosen, file=sys.stderr)
        return 2
    run_all(chosen, quick=quick)
    return 0


def _known(name: str) -> bool:
    try:
        return not find(name).tool
    except KeyError:
        return False


if __name__ == "__main__":
    sys.exit(main())
