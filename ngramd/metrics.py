"""Prometheus metrics of one daemon, read from its counters at scrape time, and the HTTP
endpoint that serves them (``start_metrics``, ``MetricsHTTPServer``).

``NgramdCollector`` is a ``prometheus_client`` custom collector: the hot path keeps
incrementing its own numpy counters and histograms (``stats.py``, STYLE habit 8), and a scrape
turns them into metric families.  Nothing is copied into ``prometheus_client`` objects on the
request path, and a scrape resets nothing (the old hand-written exposition read the
"since the last read" ingest rate, so each scrape zeroed the CLI's figure).

Choices, and why:

* **Types say what a series is.**  Anything that only grows (requests, errors, lookups, hits,
  drafted and accepted tokens, ingested tokens, degrades, storage errors) is a counter:
  Prometheus' ``rate()`` survives restarts and sums across instances.  Sizes, lag, the hot
  generation and its age, and health are gauges.
* **Latency is a histogram in seconds**, never precomputed percentiles: percentiles of two
  daemons cannot be combined, bucket counts can (``histogram_quantile(0.99, sum by (le)
  (rate(...[5m])))``).  The ``le`` edges are every 4th edge of the stats histogram (half an
  octave, x1.414) from 1 µs to 2^34 µs (~4.8 h), so each cumulative count is exact (no event
  is split between buckets; the ``le`` labels are the edges to 4 significant digits) and
  ``histogram_quantile`` is off by at most one half-octave bucket; the CLI's percentiles keep
  the finer 8-per-octave resolution (~9%).  70 buckets (with ``+Inf``) x 16 histograms is
  ~1,100 series, small for one daemon per host.  A scrape takes milliseconds, most of it
  formatting; it runs on the metrics thread, and the serving thread gets the GIL back within
  the daemon's 1 ms switch interval (ARCHITECTURE §13).
* **The series set is fixed from the first scrape**: every op, error code, order, tier and
  latency kind is present with zeros, so dashboards and alerts never see a series appear (an
  absent series makes ``rate()`` and ``absent()`` alerts lie).  Ops outside the protocol (a
  garbled request) count under ``op="invalid"``: a client cannot mint new series.
* **RSS and CPU** come from ``prometheus_client``'s standard ``ProcessCollector``
  (``process_resident_memory_bytes``, ...), so generic process dashboards work unchanged.
"""

from __future__ import annotations

import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector,
                               generate_latest)
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)
from prometheus_client.utils import floatToGoString

from .wire import protocol as P
from .wire.errors import ALL_CODES
from .stats import BUCKETS_PER_OCTAVE, EDGES, MIN_US, N_BUCKETS, LatencyHistogram, TableStats
from .writefront import BOUNDS

log = logging.getLogger("ngramd.metrics")

PREFIX = "ngramd"
#: indices into ``stats.EDGES`` exposed as ``le`` buckets: 1 µs, then every half octave
_FIRST = int(round(np.log2(1.0 / MIN_US) * BUCKETS_PER_OCTAVE))  # the edge at 1 µs
LE_INDEX = np.arange(_FIRST, N_BUCKETS + 1, BUCKETS_PER_OCTAVE // 2)
LE_LABELS = [floatToGoString(float(f"{EDGES[i] / 1e6:.4g}")) for i in LE_INDEX] + ["+Inf"]
#: ``op`` label values: every protocol op, plus requests that never named a valid one
OPS = tuple(P.OPS) + ("invalid",)
#: tiers whose keys are looked up and counted (``TableStats``: hot by `lookup`, cold by reads)
LOOKUP_TIERS = ("hot", "cold")
LATENCY_KINDS = {
    "hot": "a probe of the hot tier for a `lookup` request",
    "cold": "one key read from the cold tier (RocksDB), per key",
    "draft": "one daemon-side draft call (every tier)",
    "ingest": "appending an ingest batch to the durable log (until the ack)",
}
MEMORY_PARTS = ("delta", "filter", "block_cache", "hot", "recent", "warm", "hits",
                "count_buffers")
_EMPTY = LatencyHistogram()


def make_registry(server) -> CollectorRegistry:
    """A registry with this daemon's collector and the standard process metrics."""
    registry = CollectorRegistry(auto_describe=False)  # no collect() at registration
    registry.register(NgramdCollector(server))
    ProcessCollector(registry=registry)
    return registry


def histogram_buckets(h: LatencyHistogram) -> tuple[list[tuple[str, float]], float]:
    """``(buckets, sum_s)`` of ``h`` for a ``HistogramMetricFamily``: cumulative counts at
    ``LE_LABELS`` (seconds; the last is ``+Inf``) and the sum in seconds."""
    below, count, total_us = h.cumulative(LE_INDEX)
    counts = [*below.tolist(), count]
    return list(zip(LE_LABELS, counts)), total_us / 1e6


class NgramdCollector:
    """Reads a ``Server`` (and its ``Table``) at scrape time; see the module docstring."""

    def __init__(self, server):
        self._server = server

    def describe(self):
        return []  # the families are known only by collecting; nothing to check up front

    def collect(self):
        srv = self._server
        s = srv.stats()  # the gauges, read once (the same figures as `ngram-client stats`)
        orders = _Orders(srv.table.n_min, srv.table.n_max)
        yield from _request_families(srv)
        yield from _table_families(srv.table.stats, srv.stall.hist, orders)
        yield from _health_families(s)
        yield from _size_families(s, orders.names)
        yield from _fleet_families(s.get("fleet", {}))


def _counter(name, doc, labels=(), rows=()) -> CounterMetricFamily:
    """A counter family ``ngramd_<name>``; ``rows``: ``(label values, value)`` pairs."""
    f = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=list(labels))
    for lv, v in rows:
        f.add_metric(list(lv), float(v))
    return f


def _gauge(name, doc, value=None, labels=(), rows=()) -> GaugeMetricFamily:
    """A gauge family ``ngramd_<name>``: one unlabelled ``value``, or ``rows`` as above."""
    f = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=list(labels))
    if value is not None:
        f.add_metric([], float(value))
    for lv, v in rows:
        f.add_metric(list(lv), float(v))
    return f


def _histogram(name, doc, labels=(), rows=()) -> HistogramMetricFamily:
    """A histogram family ``ngramd_<name>`` in seconds; ``rows``: ``(label values,
    LatencyHistogram)`` pairs (``histogram_buckets``)."""
    f = HistogramMetricFamily(f"{PREFIX}_{name}", doc, labels=list(labels))
    for lv, hist in rows:
        buckets, total = histogram_buckets(hist)
        f.add_metric(list(lv), buckets, total)
    return f


class _Orders:
    """The table's orders ``n_min..n_max`` as label values, and the rows of a per-order (or
    per-tier, per-order) counter array of ``TableStats`` (indexed by order, from 0)."""

    def __init__(self, n_min: int, n_max: int):
        self.names = [str(n) for n in range(n_min, n_max + 1)]
        self._sl = slice(n_min, n_max + 1)

    def rows(self, arr) -> list:
        return [((o,), int(v)) for o, v in zip(self.names, np.asarray(arr)[self._sl].tolist())]

    def tier_rows(self, arr, tiers) -> list:
        return [((t, o), int(v)) for t in tiers
                for o, v in zip(self.names, arr[TableStats.TIERS.index(t), self._sl].tolist())]


def _request_families(srv):
    """Requests, error replies and request latency, by op and by error code."""
    def by_op(counts):
        got = {op: counts.get(op, 0) for op in P.OPS}
        got["invalid"] = sum(v for k, v in counts.items() if k not in P.OPS)
        return [((op,), got[op]) for op in OPS]

    yield _counter("requests", "Requests answered, by op (errors included).", ["op"],
                   by_op(dict(srv.requests)))
    yield _counter("request_errors", "Requests answered with an error, by op.", ["op"],
                   by_op(dict(srv.op_errors)))
    errors = dict(srv.errors)
    yield _counter("errors", "Error replies by stable error code (ngramd/wire/errors.py).",
                   ["code"], [((c,), errors.get(c, 0)) for c in ALL_CODES])
    lat = dict(srv.latency)
    invalid = LatencyHistogram.merged([v for k, v in lat.items() if k not in P.OPS])
    yield _histogram("request_duration_seconds",
                     "Time from receiving a request to sending its reply, by op.", ["op"],
                     [((op,), invalid if op == "invalid" else lat.get(op, _EMPTY))
                      for op in OPS])


def _table_families(ts: TableStats, stall: LatencyHistogram, orders: _Orders):
    """The table's counters per tier and order, its latency by kind, the stall monitor's."""
    yield _counter("lookups", "Keys looked up in a tier, by order (hot: `lookup` requests; "
                   "cold: every cold read). hits/lookups is the tier's hit rate.",
                   ["tier", "order"], orders.tier_rows(ts.lookups, LOOKUP_TIERS))
    yield _counter("hits", "Keys looked up in a tier and found there, by order.",
                   ["tier", "order"], orders.tier_rows(ts.hits, LOOKUP_TIERS))
    yield _counter("drafted_tokens", "Tokens the daemon drafted, by the tier and order "
                   "they came from (generators draft in-process: see reported_*).",
                   ["tier", "order"], orders.tier_rows(ts.drafted, TableStats.TIERS))
    yield _counter("reported_drafted_tokens", "Draft tokens generators reported having "
                   "verified, by order.", ["order"], orders.rows(ts.reported_drafted))
    yield _counter("reported_accepted_tokens", "Draft tokens generators reported accepted, "
                   "by order; accepted/drafted is the acceptance rate.", ["order"],
                   orders.rows(ts.reported_accepted))
    yield _counter("degrades", "Cold reads deferred to the background to keep a draft "
                   "within its latency budget, by order.", ["order"], orders.rows(ts.degrades))
    yield _counter("ingested_tokens", "Tokens counted into the table from the ingest log "
                   "(rate() of it is the ingest rate).", rows=[((), ts.ingested_tokens)])
    yield _counter("recent_skipped_tokens", "Tokens counted under a backlog and not put in "
                   "the recent table (they reach readers with the next hot generation).",
                   rows=[((), ts.recent_skipped_tokens)])
    yield _histogram("table_latency_seconds", "Latency inside the table, by kind: " + "; ".join(
        f"{k}: {v}" for k, v in LATENCY_KINDS.items()) + ".", ["kind"],
        [((kind,), ts.latency.get(kind, _EMPTY)) for kind in LATENCY_KINDS])
    yield _histogram("stall_seconds", "How late a daemon thread's timer wake-ups came: time "
                     "the process kept Python threads (the serving loop included) from "
                     "running.", rows=[((), stall)])


def _health_families(s: dict):
    """Health and the write path, from the server's stats ``s``."""
    health = s.get("health", {})
    yield _gauge("health_degraded", "1 while a part of the write path fails or an ingest "
                 "waits on the disk (reason: `ngram-client stats`), else 0.",
                 health.get("degraded", 0))
    yield _counter("storage_errors", "Storage (disk, RocksDB) errors met by the write path.",
                   rows=[((), health.get("storage_errors", 0))])
    yield _counter("quarantined_records", "Ingest log records that could not be counted and "
                   "were moved to <data dir>/quarantine/.",
                   rows=[((), health.get("quarantined_records", 0))])
    yield _counter("hot_rebuild_failures", "Hot tier rebuilds that failed.",
                   rows=[((), s.get("rebuild_failures", 0))])
    yield _gauge("log_lag_records", "Ingest log records acknowledged but not yet counted.",
                 s.get("log_lag", 0))
    yield _gauge("log_lag_seconds", "Age of the oldest acknowledged ingest log record not "
                 "yet counted (0 while counting keeps up).", s.get("log_lag_s", 0.0))
    yield _gauge("pending_jobs", "Slow requests (ingest, flush, lookup, ...) queued or "
                 "running.", s.get("server", {}).get("pending", 0))
    backlog = s.get("server", {}).get("backlog", {})
    yield _gauge("ingest_backlog_bytes", "Bytes the ingest log keeps on disk (the backlog "
                 "bound's measure).", backlog.get("bytes", 0))
    yield _gauge("ingest_backlog_limit_bytes", "Past this, ingests answer busy ([server] "
                 "backlog_mb).", backlog.get("limit_bytes", 0))
    yield _gauge("ingest_backlog_limit_seconds", "Past this forecast drain time, or this age "
                 "of the oldest record not yet counted, ingests answer busy ([server] "
                 "backlog_s).", backlog.get("limit_s", 0.0))
    yield _gauge("ingest_backlog_forecast_seconds", "Seconds counting needs to drain the "
                 "backlog at the measured counting rate (0 without a backlog).",
                 backlog.get("forecast_s", 0.0))
    yield _gauge("counting_rate_records_per_second", "Ingest log records counted per second "
                 "of the writer's recent work (the forecast's rate).",
                 backlog.get("rate_records_s", 0.0))
    yield _gauge("counting_rate_bytes_per_second", "Bytes of tokens counted per second of the "
                 "writer's recent work.", backlog.get("rate_bytes_s", 0.0))
    yield _counter("ingest_busy", "Ingests answered busy, by the backlog bound passed (bytes, "
                   "forecast, age).", ["bound"],
                   [((b,), (backlog.get("busy") or {}).get(b, 0)) for b in BOUNDS])


def _size_families(s: dict, orders: list):
    """Sizes of the tiers, the daemon's memory by part, the draft budget."""
    hot = s.get("hot", {})
    created = hot.get("created_s", 0.0)
    yield _gauge("hot_generation", "Number of the hot generation being served.",
                 hot.get("generation", 0))
    yield _gauge("hot_generation_age_seconds", "Seconds since the hot generation being "
                 "served was built (grows without bound while rebuilds fail or nothing "
                 "new is ingested).", max(time.time() - created, 0.0) if created else 0.0)
    yield _gauge("hot_slots", "Slots of the hot generation.", hot.get("slots", 0))
    cold = s.get("cold", {})
    entries = {str(k): v for k, v in (cold.get("entries") or {}).items()}
    yield _gauge("cold_entries", "Entries (distinct contexts) in the cold tier, by order.",
                 labels=["order"], rows=[((o,), entries.get(o, 0)) for o in orders])
    yield _gauge("cold_disk_bytes", "Bytes the table's directory holds on disk.",
                 cold.get("total_bytes", 0))
    yield _gauge("cold_runs", "Runs in the cold tier's LSM (merges keep it small).",
                 cold.get("runs", 0))
    yield _gauge("ingest_log_bytes", "Bytes of ingest log segments on disk.",
                 cold.get("log_bytes", 0))
    yield _gauge("warm_cache_entries", "Entries in the warm cache of cold answers.",
                 s.get("warm_cache", {}).get("entries", 0))
    mem = s.get("memory", {})
    yield _gauge("memory_bytes", "RAM the daemon holds by design, by part (the process' "
                 "RSS is process_resident_memory_bytes).", labels=["part"],
                 rows=[((p,), mem.get(f"{p}_bytes", 0)) for p in MEMORY_PARTS])
    yield _gauge("draft_budget_seconds", "Latency budget of a draft's cold reads.",
                 s.get("budget_us", 0.0) / 1e6)


def _fleet_families(fl: dict):
    """Many hosts: present with zeros when [fleet] is off."""
    yield _gauge("fleet_connected", "1 while the fleet's NATS connection is up and this "
                 "host has joined the stream ([fleet]), else 0.",
                 int(fl.get("state") == "connected"))
    yield _gauge("fleet_refused", "1 if the fleet's stream carries another table identity "
                 "and this host refused to join.", int(fl.get("state") == "refused"))
    yield _gauge("fleet_publish_backlog_records", "This host's ingest log records not yet "
                 "published to the fleet (grows while NATS is unreachable).",
                 fl.get("publish_backlog_records", 0))
    yield _gauge("fleet_consume_lag_messages", "Fleet stream messages not yet applied here.",
                 fl.get("consume_lag_msgs") or 0)
    age = fl.get("last_snapshot_age_s")
    yield _gauge("fleet_last_snapshot_age_seconds", "Seconds since this host's last snapshot "
                 "(-1: none since start).", -1 if age is None else age)
    for name, doc in FLEET_COUNTERS.items():
        yield _counter(f"fleet_{name}", doc, rows=[((), fl.get(name, 0))])


FLEET_COUNTERS = {
    "published_records": "Log records this host published to the fleet.",
    "applied_records": "Other hosts' records appended to this host's log.",
    "duplicate_records": "Redelivered records dropped (already here).",
    "bad_msgs": "Malformed fleet messages dropped.",
    "publish_errors": "Failed publish attempts (retried).",
    "consume_errors": "Failed fetches or appends of fleet messages (retried).",
    "snapshots": "Snapshots this host took.",
}


class MetricsHTTPServer(ThreadingHTTPServer):
    """An HTTP server for one scraper, not for the world: at most ``max_connections``
    connections are handled at once (a thread each) and a connection beyond that is closed at
    once; each handled connection gets ``timeout_s`` per socket read or write.

    ThreadingHTTPServer alone starts a thread per connection and waits forever for a request,
    so idle connections cost a thread each, without bound.  Here idle peers hold at most
    ``max_connections`` threads for ``timeout_s`` each; a scrape sends its request at once and
    takes milliseconds."""

    daemon_threads = True
    block_on_close = False  # shutdown() never waits for a slow peer
    max_connections = 8
    timeout_s = 5.0

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._slots = threading.BoundedSemaphore(self.max_connections)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            log.debug("metrics: %d connections busy; closing one from %s",
                      self.max_connections, client_address)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # starts the handler thread
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def start_metrics(server, host: str, port: int) -> MetricsHTTPServer:
    """Prometheus endpoint on ``host:port`` for ``server`` (``ngramd.server.Server``):
    ``ngramd/metrics.py`` reads its counters at scrape time (counters, histograms in seconds,
    gauges; a fixed series set), served by ``MetricsHTTPServer``: a bounded number of
    connections, each with a timeout.  The server imports this module only when metrics are
    on: the offline tools and ``--check-config`` do not need ``prometheus_client``."""
    registry = make_registry(server)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            try:
                body = generate_latest(registry)
            except Exception:
                log.exception("metrics: collecting stats failed")
                self.send_error(500)
                return
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt, *args):
            log.debug("metrics: " + fmt, *args)

    Handler.timeout = MetricsHTTPServer.timeout_s  # socket timeout: idle peers are dropped
    httpd = MetricsHTTPServer((host, port), Handler)
    threading.Thread(target=httpd.serve_forever, name="ngramd-metrics", daemon=True).start()
    log.info("metrics on http://%s:%d/metrics", host, httpd.server_address[1])
    return httpd
