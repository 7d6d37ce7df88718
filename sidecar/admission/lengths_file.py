"""Learned answer lengths kept across restarts (``--lengths-file``), for expected mode's cold
start.

A sidecar that restarts into a burst has seen no answers: every class reserves its prior
(``--expected-prior`` of ``max_tokens``) until it has enough samples again. With a lengths file on
a volume that outlives the container (an ``emptyDir`` outlives container restarts within the
pod), it starts from what it had learned. The file is JSON, written whole to a temporary file
and renamed over the old one (never half-written), and is tied to the served model: another
model's lengths are ignored.

>>> import tempfile, pathlib
>>> from sidecar.admission.learner import LengthLearner
>>> path = pathlib.Path(tempfile.mkdtemp()) / "lengths.json"
>>> learner = LengthLearner()
>>> learner.observe("chat:none", 120)
>>> save(path, learner, model="tiny")
>>> fresh = LengthLearner()
>>> load(path, fresh, model="tiny"), load(path, fresh, model="other")
(1, 0)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from pathlib import Path

from sidecar.admission.learner import LengthLearner

log = logging.getLogger(__name__)

FORMAT = 1


def save(path: Path, learner: LengthLearner, *, model: str) -> None:
    """Write the learner's lengths to ``path`` atomically (temporary file, then rename)."""
    data = {"format": FORMAT, "model": model, "classes": learner.export()}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, separators=(",", ":"))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def load(path: Path, learner: LengthLearner, *, model: str) -> int:
    """Restore lengths saved for ``model``; returns how many. A missing, unreadable or foreign
    file restores nothing (logged): the learner starts from its prior, as without a file."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return 0
    except (OSError, ValueError) as exc:
        log.warning("lengths file %s unreadable, starting without it: %s", path, exc)
        return 0
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        log.warning("lengths file %s has an unknown format, starting without it", path)
        return 0
    if data.get("model") != model:
        log.info("lengths file %s is for model %r, not %r: ignored", path, data.get("model"), model)
        return 0
    classes = data.get("classes")
    if not isinstance(classes, dict):
        return 0
    clean = {
        str(klass): [int(n) for n in lengths if isinstance(n, int) and not isinstance(n, bool)]
        for klass, lengths in classes.items()
        if isinstance(lengths, list)
    }
    return learner.restore(clean)
