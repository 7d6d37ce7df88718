"""vllm-kv-sidecar: a KV-cache admission controller and Prometheus exporter beside vLLM."""

__version__ = "0.1.0"
