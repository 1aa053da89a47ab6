"""The vLLM proposer seen by an operator: its lines in vLLM's own log, its counters on a
Prometheus port (without this module the proposer's INFO lines never show in ``vllm serve``'s
log, and nothing of it reaches any ``/metrics``).

* **Log.**  vLLM gives its handler to the ``vllm`` logger only, and that logger does not
  propagate: a library's INFO line goes to the root logger, which has no handler, and Python's
  last resort prints WARNING and above.  :func:`attach_to_vllm_log` hands the handlers and the
  level of the ``vllm`` logger to ``ngram_generator`` and ``ngram_client`` (once, and only when
  vLLM has configured its logger and ours have no handler of their own), so the proposer's
  lines appear in vLLM's log, formatted and filtered as vLLM's (``VLLM_LOGGING_LEVEL``).
* **Metrics.**  The proposer runs in vLLM's engine-core process; vLLM's ``/metrics`` is served
  by the API server process from prometheus_client's default registry, and the engine core
  sends it only vLLM's own stats (no multiprocess collection of other registries).  So the
  proposer serves its own, on the port the operator sets (``metrics_port`` in ``[proposer]``,
  or ``$NGRAM_PROPOSER_METRICS_PORT``; loopback unless ``metrics_addr`` says otherwise):
  :class:`ProposerCollector` reads the proposer's ``stats()`` at scrape time, so a scrape
  changes nothing and the hot path only increments counters.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

#: the loggers whose lines belong in vLLM's log: the proposer, its batch drafter and link, the
#: client under them
OUR_LOGGERS = ("ngram_generator", "ngram_client")


def attach_to_vllm_log() -> bool:
    """Give our loggers the ``vllm`` logger's handlers and level (module doc).  Returns whether
    it did: False outside vLLM, or when the application gave our loggers handlers itself
    (then its choice stands)."""
    vllm_log = logging.getLogger("vllm")
    if not vllm_log.handlers:
        return False
    done = False
    for name in OUR_LOGGERS:
        ours = logging.getLogger(name)
        if ours.handlers:
            continue
        for h in vllm_log.handlers:
            ours.addHandler(h)
        ours.setLevel(vllm_log.getEffectiveLevel())
        ours.propagate = False
        done = True
    return done


class ProposerCollector:
    """Prometheus families over a proposer's ``stats()`` (``{"proposer": BatchStats.to_dict(),
    "link": DaemonLink.stats()}``), read at scrape time.  Every family exists from the first
    scrape; tiers appear as they draft."""

    def __init__(self, stats):
        self._stats = stats  # () -> dict

    def describe(self):
        return []  # no description pass: collect() reads the proposer only at scrape time

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self._stats()
        p, link = s.get("proposer", {}), s.get("link", {})
        counters = {
            "steps": ("engine steps the proposer drafted for", p.get("steps", 0)),
            "requests_finished": ("requests finished and fed back", p.get("finished", 0)),
            "feedback_sent": ("finished requests sent to ngramd", link.get("feedback_sent", 0)),
            "feedback_dropped": ("finished requests dropped (queue full while ngramd was "
                                 "down)", link.get("feedback_dropped", 0)),
            "link_drops": ("times the link to ngramd went down", link.get("link_drops", 0)),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"ngram_proposer_{name}", doc, value=value)
        for what in ("drafted", "accepted"):
            c = CounterMetricFamily(f"ngram_proposer_{what}_tokens",
                                    f"draft tokens {what}, by the tier they came from",
                                    labels=["tier"])
            for tier, n in sorted(p.get(f"{what}_by_tier", {}).items()):
                c.add_metric([str(tier)], n)
            yield c
        for what in ("verified", "accepted"):  # position 1: the first token after the row's
            c = CounterMetricFamily(f"ngram_proposer_{what}_by_position",
                                    f"draft tokens {what} at each position of their draft (the "
                                    "last label counts it and every later one)",
                                    labels=["position"])
            counts = p.get(f"{what}_by_position", [])
            for i, n in enumerate(counts):
                c.add_metric([f"{i + 1}+" if i == len(counts) - 1 else str(i + 1)], n)
            yield c
        pol = p.get("policy") or {}
        if pol:  # the draft-length policy's view (absent with full drafts)
            yield GaugeMetricFamily("ngram_proposer_plain_share",
                                    "share of steps the policy verified no draft in",
                                    value=pol.get("plain_share", 0.0))
            tally = pol.get("same_steps") or {}
            for other in ("plain", "full", "oracle"):
                v = tally.get(f"vs_{other}")
                if v is not None:
                    yield GaugeMetricFamily(
                        f"ngram_proposer_speed_vs_{other}",
                        f"the policy's tokens a second over the {other} policy's on the same "
                        "steps, by the cost model", value=v)
        state = GaugeMetricFamily("ngram_proposer_link_state", "1 for the link's state now",
                                  labels=["state"])
        for st in ("up", "down", "connecting", "refused", "off"):
            state.add_metric([st], 1.0 if link.get("state") == st else 0.0)
        yield state
        yield GaugeMetricFamily("ngram_proposer_feedback_queued_sequences",
                                "finished requests not yet acknowledged by ngramd",
                                value=link.get("queued_seqs", 0))
        yield GaugeMetricFamily("ngram_proposer_feedback_queued_tokens",
                                "their tokens", value=link.get("queued_tokens", 0))
        for q in ("p50", "p99"):
            yield GaugeMetricFamily(f"ngram_proposer_propose_seconds_{q}",
                                    f"propose() time a step, {q} of the recent steps",
                                    value=p.get(f"propose_ms_{q}", 0.0) / 1e3)


def serve_metrics(stats, port: int, addr: str = "127.0.0.1"):
    """Serve :class:`ProposerCollector` over ``stats`` at ``http://addr:port/metrics`` in a
    thread of its own; returns the HTTP server (``shutdown()`` stops it), or None when the
    port cannot be bound (logged: a second engine process on the same port, say)."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(ProposerCollector(stats))
    try:
        server, _ = start_http_server(port, addr=addr, registry=registry)
    except OSError as e:
        log.warning("ngramd proposer: cannot serve metrics on %s:%d (%s); none served", addr,
                    port, e)
        return None
    log.info("ngramd proposer: metrics on http://%s:%d/metrics", addr, server.server_port)
    return server
