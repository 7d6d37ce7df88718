"""Learned answer lengths kept across restarts (``--lengths-file``), for expected mode's cold
start.

A sidecar that restarts into a burst has seen no answers: every class reserves its prior
(``--expected-prior`` of ``max_tokens``) until it has enough samples again. With a lengths file on
a volume that outlives the container (an ``emptyDir`` outlives container restarts within the
pod), it starts from what it had learned. The file is JSON, written whole to a temporary file
and renamed over the old one (never half-written), and is tied to the served model: another
model's lengths are ignored. :class:`LengthsSaver` keeps one file for a running sidecar: restored
once the served model is known, written every 30 s and once more at shutdown.

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

import asyncio
import contextlib
import json
import logging
import os
import tempfile
from pathlib import Path

from sidecar.admission.learner import LengthLearner

log = logging.getLogger(__name__)

FORMAT = 1
#: seconds between writes of a running sidecar's lengths file (and one at shutdown)
SAVE_INTERVAL_SECONDS = 30.0


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


class LengthsSaver:
    """``--lengths-file`` for a running sidecar: :meth:`restore` reads it once, when discovery
    names the served model; from then on it is written every ``interval_seconds`` and at
    :meth:`stop`. A file that cannot be written is logged, never raised: serving goes on.

        saver = LengthsSaver(path, controller.learner)
        saver.start()
        saver.restore("tiny")  # at discovery
        await saver.stop()  # at shutdown: the last write
    """

    def __init__(
        self,
        path: Path,
        learner: LengthLearner,
        *,
        interval_seconds: float = SAVE_INTERVAL_SECONDS,
    ) -> None:
        self.path = path
        self.learner = learner
        self.interval_seconds = interval_seconds
        #: the served model the lengths are for; None until discovery (nothing is written)
        self.model: str | None = None
        self._task: asyncio.Task[None] | None = None

    def restore(self, model: str) -> int:
        """Read the file the first time the model is known (later calls, from a rediscovery,
        only follow the model); returns how many lengths were restored."""
        first, self.model = self.model is None, model
        if not first:
            return 0
        restored = load(self.path, self.learner, model=model)
        if restored:
            log.info("restored %d answer lengths from %s", restored, self.path)
        return restored

    def save(self) -> None:
        if self.model is None:
            return
        try:
            save(self.path, self.learner, model=self.model)
        except OSError as exc:
            log.warning("could not write the lengths file %s: %s", self.path, exc)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._save_forever())

    async def stop(self) -> None:
        """Stop the periodic writes, then write once more."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.save()

    async def _save_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_seconds)
            self.save()
