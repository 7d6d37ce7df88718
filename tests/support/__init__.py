"""Helpers shared by the test modules, so that no test module imports another.

- ``faultkit``: the in-process sidecar (``ThreadedSidecar``), ``ToughFake``, ``/proc`` readings.
- ``fake_process``: the fake vLLM in a process of its own.
- ``prometheus_server``: a real Prometheus on loopback.
- ``wait``: ``wait_for``, one poll-until-true with a deadline.
"""
