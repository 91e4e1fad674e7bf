"""The proxy's Prometheus metrics, read from the instance pools at each scrape (GET /metrics).

Per instance (labels `role`, `instance`): requests in flight, requests sent (`_total`), failures (`_total`:
connection errors, an answer cut off, a 5xx), and whether it is up.
"""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedserve.proxy.instance_pool import InstancePool


class ProxyMetrics(Collector):
    """A collector over the pools' counters (so the counters live in one place, the Instance objects)."""

    def __init__(self, pools: list[InstancePool]) -> None:
        self.pools = pools
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def collect(self) -> Iterator[Metric]:
        labels = ["role", "instance"]
        in_flight = GaugeMetricFamily("pagedserve:proxy_requests_in_flight",
                                      "Requests the proxy has in flight at this instance.", labels=labels)
        requests = CounterMetricFamily("pagedserve:proxy_requests", "Requests the proxy sent to this instance.",
                                       labels=labels)
        failures = CounterMetricFamily("pagedserve:proxy_failures",
                                       "Requests this instance failed (unreachable, cut off, or a 5xx answer).",
                                       labels=labels)
        up = GaugeMetricFamily("pagedserve:proxy_instance_up",
                               "1 while the proxy sends requests to this instance, 0 while it is down.", labels=labels)
        for pool in self.pools:
            for instance in pool.instances:
                values = [instance.role, instance.url]
                in_flight.add_metric(values, instance.num_in_flight)
                requests.add_metric(values, instance.num_requests)
                failures.add_metric(values, instance.num_failures)
                up.add_metric(values, 1.0 if instance.is_up else 0.0)
        yield from (in_flight, requests, failures, up)

    def render(self) -> bytes:
        return generate_latest(self.registry)
