"""The ``model_name`` label of the sidecar's per-model series: the served model name discovery
found, as vLLM labels its own series, added at scrape time (docs/metrics.md, The model_name
label). A family is exported either without the label (before the first discovery) or with it,
never both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from sidecar.engine.discovery import EngineConfig

#: The label of every per-model series: the served model name, as vLLM labels its own series.
MODEL_NAME = "model_name"


class ModelName:
    """The value of ``model_name``: the served model name of the last discovery (what vLLM's
    ``/v1/models`` lists, ``--served-model-name`` choosing among several), None before the first.
    The name found is kept while vLLM is rediscovered (its block size changed), so the series do
    not lose the label and find it again; a rediscovery that finds another name relabels them.

    >>> from types import SimpleNamespace
    >>> engine = [None]
    >>> name = ModelName(lambda: engine[0])
    >>> name() is None
    True
    >>> engine[0] = SimpleNamespace(model="m")
    >>> name()
    'm'
    >>> engine[0] = None  # rediscovering
    >>> name()
    'm'
    """

    def __init__(self, engine: Callable[[], EngineConfig | None]) -> None:
        self._engine = engine
        self._name: str | None = None

    def __call__(self) -> str | None:
        info = self._engine()
        if info is not None:
            self._name = info.model
        return self._name


def with_model_name(family: Metric, model: str | None) -> Metric:
    """``family`` with ``model_name="<model>"`` on every sample (None: as it is). The family is
    edited in place: collectors build a new one at every collect (prometheus_client's own
    metrics too).

    >>> from prometheus_client.core import GaugeMetricFamily
    >>> family = GaugeMetricFamily("g", "G.", labels=["le"])
    >>> family.add_metric(["1"], 2.0)
    >>> [s.labels for s in with_model_name(family, "m").samples]
    [{'le': '1', 'model_name': 'm'}]
    """
    if model is not None:
        family.samples = [
            s._replace(labels={**s.labels, MODEL_NAME: model}) for s in family.samples
        ]
    return family


class ModelLabelled(Collector):
    """The families of ``inner`` (the per-model counters and histograms), with ``model_name``."""

    def __init__(self, inner: CollectorRegistry, model: Callable[[], str | None]) -> None:
        self.inner = inner
        self.model = model

    def describe(self) -> Iterable[Metric]:
        return []  # the inner registry checks its own names

    def collect(self) -> Iterable[Metric]:
        model = self.model()
        return [with_model_name(family, model) for family in self.inner.collect()]
