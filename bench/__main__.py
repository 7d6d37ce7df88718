"""Every benchmark, one after the other: ``python -m bench`` (``make bench``).

    python -m bench                      # micro, overhead, admission (about 70 minutes)
    python -m bench micro overhead       # only these
    python -m bench --quick              # smoke run: smaller workloads, BENCHMARKS.md untouched

Each also runs alone (``python -m bench.micro``, ``python -m bench.overhead``,
``python -m bench.admission``). Progress goes to stderr; each rewrites its own section of
BENCHMARKS.md (between ``<!-- bench:NAME -->`` markers) and its JSON in ``bench/results/``.
"""

from __future__ import annotations

import argparse
import time

from harness.bench_util import progress

ALL = ("micro", "overhead", "admission")


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("names", nargs="*", help=f"benchmarks to run: {', '.join(ALL)}")
    parser.add_argument("--quick", action="store_true", help="smoke run; BENCHMARKS.md untouched")
    args = parser.parse_args()
    names = args.names or list(ALL)
    for name in names:
        if name not in ALL:
            parser.error(f"unknown benchmark {name!r}; one of {', '.join(ALL)}")
    started = time.monotonic()
    for i, name in enumerate(names, 1):
        progress(f"bench {i}/{len(names)}: {name}")
        if name == "micro":
            from bench import micro

            micro.main(["--no-report"] if args.quick else [])
        elif name == "overhead":
            from bench import overhead

            overhead.main(["--quick"] if args.quick else [])
        elif name == "admission":
            from bench import admission

            admission.main(["--quick"] if args.quick else [])
    progress(f"all done in {(time.monotonic() - started) / 60:.1f} minutes")


if __name__ == "__main__":
    main()
