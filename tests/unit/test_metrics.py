"""swarm/metrics.py: the endpoint, its families, and what a broken collector does to a scrape."""

import pytest

from swarm.metrics import Families, MetricsConfig, serve_metrics
from tests.conftest import scrape


@pytest.mark.timeout(30)
def test_an_endpoint_serves_what_its_fill_builds_at_each_scrape():
    calls = []

    def fill(f: Families) -> None:
        calls.append(1)
        f.gauge("queue_length", "requests waiting", 3)
        f.counter("rounds", "rounds", 5, result="ok")
        f.counter("rounds", "rounds", 2, result="failed")
        f.traffic("pipeline", "bytes", {"activations": (100, 400), "tokens": (8, 8)})

    endpoint = serve_metrics(MetricsConfig(port=0), fill, "test")
    assert endpoint is not None
    try:
        first = scrape(endpoint.port)
        second = scrape(endpoint.port)
    finally:
        endpoint.close()
    assert len(calls) == 2, "each scrape reads the live state again"
    assert first == second
    assert first["swarm_queue_length"] == [("swarm_queue_length", {}, 3.0)]
    assert first["swarm_rounds"] == [
        ("swarm_rounds_total", {"result": "ok"}, 5.0),
        ("swarm_rounds_total", {"result": "failed"}, 2.0),
    ]
    assert ("swarm_pipeline_bytes_total", {"role": "activations", "form": "fp32"}, 400.0) in first[
        "swarm_pipeline_bytes"
    ]
    assert len(first["swarm_pipeline_bytes"]) == 4


@pytest.mark.timeout(30)
def test_a_failing_collector_serves_what_it_built_and_the_process_goes_on(caplog):
    def fill(f: Families) -> None:
        f.gauge("epoch", "epoch", 7)
        raise RuntimeError("state went away mid-scrape")

    endpoint = serve_metrics(MetricsConfig(port=0), fill, "test")
    assert endpoint is not None
    try:
        assert scrape(endpoint.port)["swarm_epoch"] == [("swarm_epoch", {}, 7.0)]
        assert scrape(endpoint.port)["swarm_epoch"] == [("swarm_epoch", {}, 7.0)]
    finally:
        endpoint.close()
    assert "building the metrics failed" in caplog.text


def test_metrics_are_off_unless_a_port_is_given_and_ports_are_checked():
    assert serve_metrics(MetricsConfig(), lambda f: None, "test") is None
    for bad in (-1, 65536):
        with pytest.raises(ValueError, match="--metrics-port"):
            MetricsConfig(port=bad)
