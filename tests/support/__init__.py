"""Helpers shared by the test modules, which import them from here instead of from each other
(tests/test_layout.py fails on any import of a test module; shared fixtures are in conftest.py
and in ``fake_upstream``, which conftest registers).

- ``faultkit``: the in-process sidecar (``ThreadedSidecar``), ``ToughFake``, ``/proc`` readings.
- ``fake_process``: the fake vLLM in a process of its own.
- ``prometheus_server``: a real Prometheus on loopback.
- ``promtool``: ``run_promtool``, Prometheus's checker (fails, never skips, when it is missing).
- ``otlp``: ``OtlpReceiver``, a real OTLP/HTTP trace receiver, and the spans it decodes.
- ``dashboard``: the committed Grafana dashboard, its panels and their queries.
- ``snapshots``: ``Clock``, a clock set by hand, and ``snapshot``, an engine snapshot to admit on.
- ``stack``: ``run_sidecar``, the real sidecar in front of a fake vLLM in the test's event loop.
- ``openai_errors``: ``openai_error`` and ``retry_after``, the shape of the sidecar's refusals.
- ``wait``: ``wait_for`` and ``eventually`` (async), poll-until-true with a deadline.
- ``manifests``: ``render``, the deploy/ kustomizations as ``kubectl kustomize`` prints them, and
  lookups in them (``of_kind``, ``container``, ``container_port``).
- ``schemas``: ``assert_valid``, a rendered object against kubernetes-validate's strict schemas
  (custom resources by hand).
- ``sim``: what the tests on the simulated engine read of its /metrics.
- ``autoscalers``: the shipped KEDA and HPA overlays' queries and targets, and KEDA's formula.
- ``vllm_idle``: ``idle_preemptions``, vLLM's preemption counter once vLLM is idle (fails if not).
- ``exporter``: an exporter over a real admission controller on a fake clock, no vLLM.
- ``external``: ``unless_external``, the one skip allowed: only when the run targets an external
  vLLM (``KV_SIDECAR_TEST_VLLM_URL``); with the harness's own, a failure.
- ``fake_upstream``: the fixtures ``model_dir``, ``server`` and ``upstream`` (a fake vLLM per
  module, a fresh app per test) and ``serve_fresh``.
- ``owners``: ``admission_owner``, the relay workers' admission owner in this process.
- ``shapes``: the request shapes whose prompt counts are checked.
- ``stepped``: clients on a loop of their own and a simulated engine stepped by hand; the real
  vLLM's engine stopped for a burst (``frozen_engine``).
"""
