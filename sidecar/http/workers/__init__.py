"""Relay workers: the proxy port served by several processes, admission decided by one.

With ``--workers N`` (N > 1) the main process is the admission *owner*: it keeps the scraper,
discovery, the admission controller and the metrics port, binds the proxy port and starts N relay
worker processes that serve it (:mod:`~sidecar.http.workers.worker`). A worker asks the owner
before it forwards a generation request, over a private Unix socket
(:mod:`~sidecar.http.workers.wire`): its gate, metrics sink and engine are remote stand-ins for
the owner's (:mod:`~sidecar.http.workers.remote`); the owner maps their messages onto its one
controller (:mod:`~sidecar.http.workers.owner`) and keeps the workers running
(:mod:`~sidecar.http.workers.supervisor`). The design: ``docs/relay-workers.md``.
"""
