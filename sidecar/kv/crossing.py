"""Recurrent-state blocks at the steps where decoding sequences cross a block boundary.

Under prefix caching (``mamba_cache_mode`` ``align``) vLLM's ``MambaManager`` keeps a second
block in each recurrent-state group of a sequence for the one step at which the sequence's
tokens cross a block boundary (the block it copies the state from, freed the next step); at
its other decode steps the group holds one (``sidecar.kv.geometry.KVGeometry.build``). Decoding
sequences gain a token a step each, so two of them cross at the same steps exactly when their
token counts agree modulo the block size: at any future step the started sequences hold at most
``crossing_blocks`` (per sequence) times the most sequences of one such residue class beyond
their decode counts. Counting that instead of every sequence's second blocks is what lets a
hybrid model run as many sequences as its pool holds, where the sum of peaks counts each
sequence's crossing as if all came at once.

What the sidecar sees of a stream lags vLLM, by different amounts on different streams
(``sidecar.kv.lag``): sequences whose seen residues lie within ``tolerance`` tokens of one
another (circularly) are taken as crossing together, and one whose progress is estimated
rather than seen (an answer not streamed) as crossing with every class.

>>> import numpy as np
>>> tokens = np.array([600, 600, 856, 700, 1000])  # 600 and 856 agree modulo 256
>>> crossing_sequences(tokens, np.ones(5, dtype=np.int64), 0, block_size=256, tolerance=1)
3
>>> crossing_sequences(tokens, np.ones(5, dtype=np.int64), 2, block_size=256, tolerance=1)
5
>>> crossing_sequences(np.array([255, 1]), np.array([1, 1]), 0, block_size=256, tolerance=3)
2
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]

#: tokens of residue, beyond the streams' measured lag, within which sequences are taken as
#: crossing at one step (a report's last token, the step in flight, rounding of a shared count)
CROSSING_SLACK_TOKENS = 4


def crossing_sequences(
    tokens: IntArray, weight: IntArray, unknown: int, *, block_size: int, tolerance: int
) -> int:
    """The most sequences that may cross a block boundary at one step: those of ``tokens``
    (each row ``weight`` sequences) within one circular window of ``tolerance`` residues, plus
    the ``unknown`` ones whose progress is not seen."""
    if len(tokens) == 0:
        return unknown
    width = max(1, min(tolerance, block_size))
    counts = np.bincount(tokens % block_size, weights=weight, minlength=block_size)
    cum = np.concatenate(([0.0], np.cumsum(np.concatenate((counts, counts[: width - 1])))))
    windows = cum[width : width + block_size] - cum[:block_size]
    return unknown + round(float(windows.max()))


def tolerance_tokens(lag_tokens: float) -> int:
    """The residue window: the streams' measured lag and :data:`CROSSING_SLACK_TOKENS`."""
    return int(np.ceil(max(0.0, lag_tokens))) + 1 + CROSSING_SLACK_TOKENS
