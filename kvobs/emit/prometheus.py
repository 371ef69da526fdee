"""prometheus_client instruments built from ``semconv.Metric`` (name, help, labels and
buckets written once there), on a registry the caller owns: the proxy's and the live
classifier's /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvobs import semconv as sc


def client_name(metric: sc.Metric) -> str:
    """The name prometheus_client wants: it appends ``_total`` to counters itself."""
    return metric.name[: -len("_total")] if metric.type == "counter" else metric.name


def counter(metric: sc.Metric, registry: CollectorRegistry) -> Counter:
    return Counter(client_name(metric), metric.doc, metric.labels, registry=registry)


def gauge(metric: sc.Metric, registry: CollectorRegistry) -> Gauge:
    return Gauge(client_name(metric), metric.doc, metric.labels, registry=registry)


def histogram(metric: sc.Metric, registry: CollectorRegistry) -> Histogram:
    return Histogram(
        client_name(metric), metric.doc, metric.labels, buckets=metric.buckets, registry=registry
    )
