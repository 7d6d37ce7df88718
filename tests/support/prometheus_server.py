"""A real Prometheus server (Debian's ``prometheus`` package) on loopback, for the live tests.

Writes a ``prometheus.yml`` with static scrape jobs (and optional rule files) into a directory,
starts the server on a free loopback port with its TSDB in that directory, and wraps the parts of
the HTTP API the tests use: instant and range queries, targets, rules and alerts. The binary is
required: without it the tests fail rather than skip, like ``promtool`` (tests/support/promtool.py).

>>> job = ScrapeJob("kv-sidecar", "127.0.0.1:9091", {"pod": "llm-0"})
>>> job.config()["static_configs"][0]["labels"]
{'pod': 'llm-0'}
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from harness.vllm_cpu import free_port


class PrometheusError(RuntimeError):
    """Prometheus did not start, or its API answered with an error."""


@dataclass(frozen=True)
class ScrapeJob:
    """One scrape job with one static target; ``labels`` are attached to every series it scrapes."""

    name: str
    target: str  # host:port
    labels: dict[str, str] = field(default_factory=dict)
    metrics_path: str = "/metrics"

    def config(self) -> dict[str, Any]:
        return {
            "job_name": self.name,
            "metrics_path": self.metrics_path,
            "static_configs": [{"targets": [self.target], "labels": dict(self.labels)}],
        }


@dataclass(frozen=True)
class Sample:
    """One value of one series: its labels, when, and the value (NaN and +-Inf kept)."""

    labels: dict[str, str]
    at: float
    value: float


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        raise PrometheusError(
            "prometheus not found: run scripts/system-deps.sh (Debian package prometheus)"
        )
    return path


def _samples(data: dict[str, Any]) -> list[Sample]:
    """Flatten a query answer (vector, matrix or scalar) into samples."""
    kind, result = data["resultType"], data["result"]
    if kind == "scalar":
        return [Sample({}, float(result[0]), float(result[1]))]
    if kind == "vector":
        return [
            Sample(item["metric"], float(item["value"][0]), float(item["value"][1]))
            for item in result
        ]
    if kind == "matrix":
        return [
            Sample(item["metric"], float(at), float(value))
            for item in result
            for at, value in item["values"]
        ]
    raise PrometheusError(f"unexpected result type {kind!r}")


def has_data(samples: Sequence[Sample]) -> bool:
    """At least one value a panel can draw: NaN (0/0, a quantile of no observations) is not."""
    return any(not math.isnan(s.value) for s in samples)


class PrometheusServer:
    """``prometheus`` as a subprocess scraping ``jobs`` every ``scrape_interval``.

    Usage::

        with PrometheusServer(tmp_path, [ScrapeJob("app", "127.0.0.1:9091")]) as prom:
            prom.wait_for_targets_up()
            prom.query("up")
    """

    def __init__(
        self,
        directory: Path,
        jobs: Sequence[ScrapeJob],
        *,
        rule_files: Sequence[Path] = (),
        scrape_interval: str = "1s",
        evaluation_interval: str = "1s",
    ) -> None:
        self.directory = directory
        self.jobs = list(jobs)
        self.rule_files = list(rule_files)
        self.scrape_interval = scrape_interval
        self.evaluation_interval = evaluation_interval
        self.port = free_port()
        self.config_path = directory / "prometheus.yml"
        self.log_path = directory / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.client = httpx.Client(base_url=self.url, timeout=30.0)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> dict[str, Any]:
        return {
            "global": {
                "scrape_interval": self.scrape_interval,
                "scrape_timeout": self.scrape_interval,
                "evaluation_interval": self.evaluation_interval,
            },
            "rule_files": [str(path) for path in self.rule_files],
            "scrape_configs": [job.config() for job in self.jobs],
        }

    def start(self, *, timeout: float = 60.0) -> PrometheusServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        # JSON is YAML: no YAML writer needed
        self.config_path.write_text(json.dumps(self.config(), indent=2))
        cmd = [
            prometheus_binary(),
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.directory / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=info",
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.directory
            )
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise PrometheusError(f"prometheus exited {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if self.client.get("/-/ready", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise PrometheusError(f"prometheus not ready after {timeout}s:\n{self.log()}")

    def log(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 20.0) -> None:
        self.client.close()
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=timeout)

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- the HTTP API ------------------------------------------------------------------------

    def api(self, path: str, **params: str | float) -> Any:
        """``data`` of a successful API answer; PrometheusError with the error otherwise."""
        resp = self.client.get(f"/api/v1/{path}", params=params)
        try:
            body = resp.json()
        except ValueError:
            raise PrometheusError(f"{path}: HTTP {resp.status_code}: {resp.text[:500]}") from None
        if resp.status_code != 200 or body.get("status") != "success":
            raise PrometheusError(
                f"{path} {params}: HTTP {resp.status_code} {body.get('errorType')}: "
                f"{body.get('error')}"
            )
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[Sample]:
        """Instant query at ``at`` (Unix seconds; default: now)."""
        params: dict[str, str | float] = {"query": expr}
        if at is not None:
            params["time"] = at
        return _samples(self.api("query", **params))

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[Sample]:
        return _samples(self.api("query_range", query=expr, start=start, end=end, step=step))

    def targets(self) -> list[dict[str, Any]]:
        return list(self.api("targets", state="active")["activeTargets"])

    def rule_groups(self) -> list[dict[str, Any]]:
        return list(self.api("rules")["groups"])

    def wait_for(
        self,
        what: str,
        check: Callable[[], bool],
        *,
        timeout: float = 60.0,
        interval: float = 0.5,
    ) -> None:
        """Poll ``check`` until it holds; PrometheusError naming ``what`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise PrometheusError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(interval)

    def wait_for_targets_up(self, *, timeout: float = 60.0) -> None:
        """Every job's target scraped successfully at least once."""

        def all_up() -> bool:
            targets = self.targets()
            return len(targets) == len(self.jobs) and all(t["health"] == "up" for t in targets)

        try:
            self.wait_for("every target up", all_up, timeout=timeout)
        except PrometheusError as exc:
            states = [(t["scrapeUrl"], t["health"], t["lastError"]) for t in self.targets()]
            raise PrometheusError(f"{exc}: {states}\n{self.log()}") from None

    def wait_for_rules_evaluated(self, *, timeout: float = 60.0) -> None:
        """Every rule evaluated at least once (health no longer ``unknown``)."""

        def evaluated() -> bool:
            rules = [rule for group in self.rule_groups() for rule in group["rules"]]
            return bool(rules) and all(rule["health"] != "unknown" for rule in rules)

        self.wait_for("every rule evaluated", evaluated, timeout=timeout)
