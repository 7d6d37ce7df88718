"""Learned answer lengths across restarts (``--lengths-file``): the learner's export and
restore, the file's failure modes, the saver a running sidecar keeps (restored once, written
periodically and at shutdown), and a real sidecar process that restarts knowing them."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from pathlib import Path

import httpx
import pytest

from harness.fake_vllm import FakeServer, write_model_dir
from harness.workload import SidecarProcess, metric_value
from sidecar.admission import lengths_file
from sidecar.admission.learner import LengthLearner
from tests.support.faultkit import ToughFake


def test_export_and_restore_keep_every_class_and_its_order() -> None:
    learner = LengthLearner(quantile=0.9, confidence=0.8)  # 16 answers make a bound
    for n in range(20):
        learner.observe("chat:none", 100 + n)
    learner.observe("completions:64", 40)
    fresh = LengthLearner(quantile=0.9, confidence=0.8)
    fresh.observe("chat:none", 999)  # seen since the restart: stays, newest
    assert fresh.restore(learner.export()) == 21
    assert fresh.export()["chat:none"] == [100 + n for n in range(20)] + [999]
    assert learner.learned("chat:none") == 119
    assert fresh.learned("chat:none") == 999  # the bound of the 21, the newest included
    assert fresh.learned("completions:64") is None  # one answer: still on the prior


def test_a_missing_corrupt_or_foreign_file_restores_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    learner = LengthLearner()
    assert lengths_file.load(tmp_path / "absent.json", learner, model="tiny") == 0
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert lengths_file.load(bad, learner, model="tiny") == 0
    assert "unreadable" in caplog.text
    source = LengthLearner()
    source.observe("chat:none", 7)
    path = tmp_path / "lengths.json"
    lengths_file.save(path, source, model="other-model")
    assert lengths_file.load(path, learner, model="tiny") == 0
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({"format": 1, "model": "tiny", "classes": {"a": [1, "x", True]}}))
    assert lengths_file.load(odd, learner, model="tiny") == 1  # only the integer is taken
    assert learner.export() == {"a": [1]}
    assert list(tmp_path.glob(".*")) == []  # no temporary file left behind


async def test_the_saver_restores_once_and_writes_until_it_stops(tmp_path: Path) -> None:
    path = tmp_path / "lengths.json"
    source = LengthLearner()
    source.observe("chat:none", 30)
    lengths_file.save(path, source, model="tiny")
    learner = LengthLearner()
    saver = lengths_file.LengthsSaver(path, learner, interval_seconds=0.05)
    saver.start()
    saver.save()  # the model is not known yet: nothing written
    assert json.loads(path.read_text())["classes"] == {"chat:none": [30]}
    assert saver.restore("tiny") == 1
    assert saver.restore("tiny") == 0  # a rediscovery: not read again
    learner.observe("chat:none", 31)
    for _ in range(100):  # the periodic write
        await asyncio.sleep(0.02)
        if json.loads(path.read_text())["classes"]["chat:none"] == [30, 31]:
            break
    else:
        raise AssertionError("not written within 2 s")
    learner.observe("chat:none", 32)
    await saver.stop()  # the last write
    assert json.loads(path.read_text())["classes"]["chat:none"] == [30, 31, 32]
    learner.observe("chat:none", 33)
    await asyncio.sleep(0.15)
    assert json.loads(path.read_text())["classes"]["chat:none"] == [30, 31, 32]  # stopped


async def test_a_saver_that_cannot_write_logs_and_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    saver = lengths_file.LengthsSaver(tmp_path / "absent" / "lengths.json", LengthLearner())
    assert saver.restore("tiny") == 0  # no file yet: a fresh start
    with caplog.at_level(logging.WARNING):
        await saver.stop()
    assert "could not write the lengths file" in caplog.text


def learned(sc: SidecarProcess, klass: str) -> float | None:
    return metric_value(sc.metrics(), "kv_sidecar_expected_output_tokens", **{"class": klass})


def test_a_restarted_sidecar_starts_from_the_lengths_it_had_learned(tmp_path: Path) -> None:
    model_dir = write_model_dir(tmp_path / "tiny")
    path = tmp_path / "state" / "lengths.json"
    path.parent.mkdir()
    args = ("--reservation", "expected", "--lengths-file", str(path), "--scrape-interval", "0.1")
    with FakeServer(ToughFake(model_root=model_dir)) as fake:
        with SidecarProcess(fake.url, *args) as sc:
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 40}
            with httpx.Client(base_url=sc.url, timeout=30) as client:
                for _ in range(32):  # the defaults (0.95, 0.8) need 32 answers
                    assert client.post("/v1/completions", json=body).status_code == 200
            assert learned(sc, "completions:64") == 40
            assert sc.stop(signal.SIGTERM) == 0
        saved = json.loads(path.read_text())
        assert saved["model"] == "tiny"
        assert saved["classes"]["completions:64"] == [40] * 32
        with SidecarProcess(fake.url, *args) as again:
            # no answer seen since the restart, and the class is learned already
            assert learned(again, "completions:64") == 40
        with SidecarProcess(fake.url, "--reservation", "expected") as cold:
            assert learned(cold, "completions:64") is None  # without the file: the prior
