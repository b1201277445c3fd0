"""Prometheus metrics of one process (`--metrics-port`), read from the process's own counters at each scrape.

Each process has a registry of its own (not prometheus_client's global one) holding one collector: a function that
builds the metric families from live state when Prometheus asks. Nothing is updated on the hot path; the scrape runs
on prometheus_client's HTTP thread and only reads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

PREFIX = "swarm_"


@dataclass(kw_only=True)
class MetricsConfig:
    """Where the process serves its metrics, if at all."""

    port: int | None = field(
        default=None, metadata={"help": "serve Prometheus metrics at http://HOST:PORT/metrics (0: any free port)"}
    )
    host: str = field(
        default="127.0.0.1", metadata={"help": "address of the metrics endpoint (0.0.0.0 to let Prometheus in)"}
    )

    def __post_init__(self) -> None:
        if self.port is not None and not 0 <= self.port < 65536:
            raise ValueError(f"--metrics-port must be in [0, 65535], got {self.port}")


class Families:
    """The metric families of one scrape, built with one call per sample:
    `f.gauge("queue_length", "requests waiting or running", 3, stage="1")`."""

    def __init__(self) -> None:
        self._families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

    def gauge(self, name: str, doc: str, value: float, **labels: str) -> None:
        self._add(GaugeMetricFamily, name, doc, value, labels)

    def counter(self, name: str, doc: str, value: float, **labels: str) -> None:
        """`name` without `_total`: the exposition adds it."""
        self._add(CounterMetricFamily, name, doc, value, labels)

    def traffic(self, name: str, doc: str, by_role: dict[str, tuple[int, int]]) -> None:
        """Bytes per traffic class, as sent and as whole fp32 tensors: `{name}_bytes_total{role, form}`."""
        for role, (wire, fp32) in by_role.items():
            self.counter(f"{name}_bytes", doc, wire, role=role, form="wire")
            self.counter(f"{name}_bytes", doc, fp32, role=role, form="fp32")

    def _add(
        self,
        kind: type[GaugeMetricFamily | CounterMetricFamily],
        name: str,
        doc: str,
        value: float,
        labels: dict[str, str],
    ) -> None:
        key = PREFIX + name
        family = self._families.get(key)
        if family is None:
            family = self._families[key] = kind(key, doc, labels=sorted(labels))
        family.add_metric([labels[k] for k in sorted(labels)], float(value))

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._families.values())


class _Collector(Collector):
    def __init__(self, fill: Callable[[Families], None]):
        self.fill = fill

    def collect(self) -> Iterable[Metric]:
        families = Families()
        try:
            self.fill(families)
        except Exception:  # a scrape must not take the process down; say what broke, serve what was built
            logger.exception("building the metrics failed")
        return list(families)


@dataclass
class MetricsEndpoint:
    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def serve_metrics(cfg: MetricsConfig, fill: Callable[[Families], None], role: str) -> MetricsEndpoint | None:
    """Start the endpoint if `cfg.port` is set; `fill` adds the process's metrics to each scrape. None if off."""
    if cfg.port is None:
        return None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(fill))
    server, thread = start_http_server(cfg.port, addr=cfg.host, registry=registry)
    endpoint = MetricsEndpoint(server, thread)
    logger.info("%s metrics at http://%s:%d/metrics", role, cfg.host, endpoint.port)
    return endpoint
