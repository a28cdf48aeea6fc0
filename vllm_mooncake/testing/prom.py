"""vLLM's front-end Prometheus path on a registry of the test's own.

``KVConnectorProm`` is what vLLM's API server builds from the connector
class's ``build_prom_metrics``; bound to a fresh registry, tests can feed it
reports and read the exposition without touching the process-global one.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm


def prom_in(registry: CollectorRegistry) -> type[KVConnectorProm]:
    """vLLM's ``KVConnectorProm`` with its metric types bound to ``registry``."""

    def bound(base: type[Any]) -> type[Any]:
        class Bound(base):  # type: ignore[misc,valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                kwargs.setdefault("registry", registry)
                super().__init__(*args, **kwargs)

        return Bound

    class Prom(KVConnectorProm):  # type: ignore[misc]
        _gauge_cls = bound(Gauge)
        _counter_cls = bound(Counter)
        _histogram_cls = bound(Histogram)

    return Prom
