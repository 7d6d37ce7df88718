"""The sidecar's Grafana dashboard and Prometheus alert rules, as code.

``dashboard`` builds the dashboard, ``alerts`` the alert rules, and ``build`` writes both to the
committed files (``grafana/kv-sidecar.json``, ``grafana/alerts.yaml`` and their Kubernetes
wrappers in ``deploy/monitoring/``): ``python -m grafana.build``.
"""
