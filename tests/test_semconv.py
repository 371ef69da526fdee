import doctest
import re

from kvobs import semconv as sc


def test_docstring_examples():
    assert doctest.testmod(sc).failed == 0


def test_metric_names_follow_prometheus_conventions():
    for metric in sc.METRICS.values():
        assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", metric.name)
        assert metric.name.endswith("_total") == (metric.type == "counter"), metric.name
        if metric.unit in ("seconds", "bytes"):
            assert metric.name.removesuffix("_total").endswith(metric.unit), metric.name


def test_no_conversation_label_anywhere():
    for metric in sc.METRICS.values():
        assert not {"conversation_id", "conversation", sc.CONVERSATION_ID.key} & set(
            metric.labels)


def test_names_are_unique_across_kinds():
    names = list(sc.SPANS) + list(sc.ATTRIBUTES) + list(sc.METRICS)
    assert len(names) == len(set(names))
