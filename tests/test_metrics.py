"""``ngramd/metrics.py``: the stats histograms as Prometheus histograms in seconds.  The
collector on a real daemon is tested in ``test_server.py`` (a scrape over HTTP)."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.core import HistogramMetricFamily  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from ngramd.metrics import LE_LABELS, histogram_buckets  # noqa: E402
from ngramd.stats import LatencyHistogram  # noqa: E402


def _exposed(h: LatencyHistogram):
    """``h`` through a registry and back through the text parser: {le: count}, count, sum."""
    class One:
        def collect(self):
            f = HistogramMetricFamily("x_seconds", "test", labels=[])
            buckets, total = histogram_buckets(h)
            f.add_metric([], buckets, total)
            yield f

    reg = CollectorRegistry(auto_describe=False)
    reg.register(One())
    fam, = text_string_to_metric_families(generate_latest(reg).decode())
    assert fam.type == "histogram"
    le = {float(s.labels["le"]): s.value for s in fam.samples if s.name.endswith("_bucket")}
    count = next(s.value for s in fam.samples if s.name.endswith("_count"))
    total = next(s.value for s in fam.samples if s.name.endswith("_sum"))
    return le, count, total


def test_a_3_second_latency_lands_in_a_bucket_above_1_second():
    h = LatencyHistogram()
    h.add(3e6)
    le, count, total = _exposed(h)
    assert count == 1 and total == pytest.approx(3.0)
    assert all(v == 0 for b, v in le.items() if b <= 1.1) and le[float("inf")] == 1
    first = min(b for b, v in le.items() if v == 1)
    assert 3.0 <= first <= 3.0 * 2 ** 0.5  # the half-octave bucket that holds 3 s


def test_buckets_are_cumulative_fixed_and_span_microseconds_to_hours():
    h = LatencyHistogram()
    for us in (0.5, 2.0, 40.0, 1e3, 2e5, 7e6, 3600e6, 10 * 3600e6):
        h.add(us)
    le, count, _ = _exposed(h)
    assert len(le) == len(LE_LABELS)  # the same edges whatever was recorded
    values = [le[b] for b in sorted(le)]
    assert values == sorted(values) and values[-1] == count == 8
    edges = sorted(le)
    assert edges[0] == pytest.approx(1e-6) and 4 * 3600 < edges[-2] < 5 * 3600
    assert le[edges[-2]] == 7  # 10 hours: above the last edge, counted only in +Inf
    empty, n, s = _exposed(LatencyHistogram())
    assert set(empty) == set(le) and n == 0 and s == 0
