"""docs/metrics.md's tables of the sidecar's series, read as the tests that check them need."""

from __future__ import annotations

import re
from collections.abc import Iterator


def metric_rows(text: str) -> Iterator[tuple[dict[str, str], list[str]]]:
    """Each row of the tables whose first column is ``name``: its cells by column, and the
    series names it documents (the first, and each ``_suffix`` alternative after it)."""
    columns: list[str] | None = None
    for line in text.splitlines():
        if not line.startswith("|"):
            columns = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[0] == "name":
            columns = cells
            continue
        if columns is None or set(cells[0]) <= set("-: "):
            continue
        row = dict(zip(columns, cells, strict=False))
        first, *alternatives = re.findall(r"`([^`]+)`", row["name"])
        yield row, [first] + [re.sub(r"_[a-z]+$", alt, first) for alt in alternatives]
