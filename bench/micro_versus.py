"""The near-capacity decision rows of bench.micro on two checkouts, alternated in one run.

``python -m bench.micro_versus OLD_TREE [ROUNDS]`` runs the five decision rows of
:mod:`bench.micro` on this tree and on ``OLD_TREE`` (a ``git worktree`` of an earlier commit),
one process each, ``ROUNDS`` rounds alternated (default 2), and prints and writes to
``bench/results/micro-versus.json`` every round's medians (CPU time per call, µs). The machine is
shared: compare the two within one run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_ROWS = """
import json, statistics, sys
sys.path.insert(0, sys.argv[1])
from bench import micro
rows = {
    "plain": micro.bench_decision,
    "unchanged": micro.bench_decision_near_capacity,
    "refused on the bounds": micro.bench_decision_near_capacity_changed,
    "admitted on the bounds": micro.bench_decision_admitted_on_bounds,
    "sliding-window model, exact peak": micro.bench_exact_sliding,
}
print(json.dumps({k: statistics.median(f()) * 1e6 for k, f in rows.items()}))
"""


def _rows(tree: Path) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", _ROWS, str(tree)], check=True, capture_output=True, text=True
    ).stdout
    return dict(json.loads(out.splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m bench.micro_versus OLD_TREE [ROUNDS]", file=sys.stderr)
        return 2
    here, old = Path(__file__).resolve().parents[1], Path(args[0]).resolve()
    rounds = int(args[1]) if len(args) > 1 else 2
    commits = {
        str(tree): subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        for tree in (here, old)
    }
    runs: list[dict[str, object]] = []
    for _ in range(rounds):
        for tree in (here, old):
            row: dict[str, object] = {
                "tree": str(tree),
                "commit": commits[str(tree)],
                "us": _rows(tree),
            }
            print(json.dumps(row))
            runs.append(row)
    out = here / "bench" / "results" / "micro-versus.json"
    out.write_text(json.dumps(runs, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
