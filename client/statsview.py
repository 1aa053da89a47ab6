"""``ngram-client stats`` as readable tables: :func:`format_stats` and its helpers (percent,
byte sizes, the policy, backlog and fleet clauses).  Pure functions of the ``stats`` reply.
"""

from __future__ import annotations


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _fmt_bytes(n) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _hot_hit(r: dict):
    """The "hot hit" column of one order's row: the hot tier's hit rate over `lookup` requests
    when there were any, else its share of the tokens the daemon drafted at this order.

    The daemon counts hot-tier lookups only for `lookup` requests (its drafts probe the hot
    tier inside one kernel, and generators probe it in their own process), so ``hot_hit_rate``
    alone was ``-`` on every table that only served drafts."""
    if r.get("hot_lookups"):
        return r.get("hot_hit_rate")
    drafted = sum(v for k, v in r.items() if k.endswith("_drafted") and k != "reported_drafted")
    return r.get("hot_drafted", 0) / drafted if drafted else None


def _policy_line(pol: dict) -> str:
    """The generators' draft-length policy (``stats``' ``policy``) in one line."""
    vs = ", ".join(f"{pol[f'vs_{k}']:.2f}x {name}" for k, name in
                   (("plain", "plain"), ("full", "full drafts"), ("oracle", "the oracle"))
                   if pol.get(f"vs_{k}") is not None)
    return (f"draft lengths (generators' reports): {pol['steps']} steps with a draft, plain "
            f"chosen in {pol['plain_share']:.0%}"
            + (f"; tokens/s on the same steps by their cost models: {vs}" if vs else ""))


def _kept_states(kept: dict) -> list[str]:
    """The sizes' line of the generators' draft-length-policy states (``save_policy``), if
    any are kept."""
    if not kept.get("keys"):
        return []
    return [f"  policy states  {kept['keys']} keys, {_fmt_bytes(kept.get('bytes', 0))}"]


def format_stats(s: dict) -> str:
    """The stats reply as readable tables: per order (hits per tier, degrades, entries,
    reported acceptance), latency percentiles per kind, sizes per tier, server counters."""
    out = []
    entries = {int(k): v for k, v in (s.get("cold", {}).get("entries") or {}).items()}
    orders = s.get("orders", [])
    if orders:
        # hit rates are per key looked up; "drafted" counts tokens the daemon drafted (generators
        # draft in-process from shared memory and show up under "reported" instead)
        out.append(f"{'order':>5} {'hot hit':>8} {'cold reads':>10} {'cold hit':>8} "
                   f"{'degrades':>8} {'drafted h/r/c':>13} {'entries':>10} {'reported':>9} "
                   f"{'accepted':>9} {'accept':>7}")
        for r in orders:
            drafted = "/".join(str(r.get(f"{t}_drafted", 0)) for t in ("hot", "recent", "cold"))
            out.append(f"{r['order']:>5} {_pct(_hot_hit(r)):>8} "
                       f"{r.get('cold_lookups', 0):>10} {_pct(r.get('cold_hit_rate')):>8} "
                       f"{r.get('degrades', 0):>8} {drafted:>13} "
                       f"{entries.get(r['order'], '-'):>10} {r.get('reported_drafted', 0):>9} "
                       f"{r.get('reported_accepted', 0):>9} "
                       f"{_pct(r.get('reported_acceptance')):>7}")
        out.append("")
    lat = dict(s.get("latency", {}))
    lat.update({f"op {k}": v for k, v in s.get("server", {}).get("latency", {}).items()})
    if lat:
        out.append(f"{'latency (µs)':18s} {'count':>10} {'mean':>9} {'p50':>9} {'p99':>9} "
                   f"{'p999':>9}")
        for k, v in lat.items():
            out.append(f"{k:18s} {v.get('count', 0):>10} {v.get('mean_us', 0):>9.1f} "
                       f"{v.get('p50_us', 0):>9.1f} {v.get('p99_us', 0):>9.1f} "
                       f"{v.get('p999_us', 0):>9.1f}")
        out.append("")
    if s.get("policy"):  # the generators' draft-length policies, as they reported them
        out += [_policy_line(s["policy"]), ""]
    hot, cold = s.get("hot", {}), s.get("cold", {})
    out.append("sizes")
    if hot:
        out.append(f"  hot   generation {hot.get('generation', '?')}: "
                   f"{hot.get('slots', 0)} slots, {_fmt_bytes(hot.get('bytes', 0))}")
        if hot.get("source"):  # where it came from (shm, image, rebuild), how far behind
            out.append(f"        from: {hot['source']}, {hot.get('behind_records', 0)} log records "
                       f"behind the table" + (" (starved: rebuilding first)"
                                              if hot.get("starved") else ""))
        why = (hot.get("sizing") or {}).get("why")
        if why:
            out.append(f"        size: {why}")
        rb = hot.get("rebuilds")
        if rb:
            out.append(f"        rebuilds: {rb['rebuilds']}, the last {rb['last_cpu_s']:.2f} CPU-s; "
                       f"{rb['cpu_share_since_start']:.1%} of a core since start (limit "
                       f"{rb['cpu_share_limit']:.0%}); next scheduled one in "
                       f"{rb['next_scheduled_in_s']:.0f} s at the earliest")
    if cold:
        out.append(f"  cold  {cold.get('entries_total', 0)} entries in {cold.get('runs', 0)} "
                   f"runs: {_fmt_bytes(cold.get('live_bytes', 0))} live (runs and log), "
                   f"{_fmt_bytes(cold.get('disk_bytes', cold.get('total_bytes', 0)))} on disk "
                   f"({cold.get('bytes_per_entry', 0):.1f} B/row in runs)")
    warm = s.get("warm_cache")
    if warm:
        out.append(f"  warm  {warm.get('entries', 0)} / {warm.get('capacity', 0)} entries")
    out += _kept_states(s.get("policy_states") or {})
    out.append("")
    out.append(f"ingest: {s.get('ingested_tokens', 0)} tokens counted, "
               f"{s.get('ingest_tokens_per_s', 0)} tokens/s over the last 10 s, "
               f"log lag {s.get('log_lag', 0)} records / {s.get('log_lag_s', 0):.1f} s"
               f"{_backlog_clause(s.get('server', {}).get('backlog') or {})}; "
               f"budget {s.get('budget_us', '-')} µs; uptime {s.get('uptime_s', '-')} s")
    fl = s.get("fleet", {})
    if fl.get("state", "off") != "off":
        age = fl.get("last_snapshot_age_s")
        out.append(f"fleet: {fl['state']} as host {fl.get('host_id')} on stream "
                   f"{fl.get('stream')}; publish backlog {fl.get('publish_backlog_records', 0)} "
                   f"records, consume lag {fl.get('consume_lag_msgs', '-')} messages, "
                   f"{fl.get('origins', 0)} other hosts heard; last snapshot "
                   f"{'none' if age is None else f'{age:.0f} s ago'}" + _fleet_error(fl))
    srv = s.get("server", {})
    if srv:
        req = ", ".join(f"{k} {v}" for k, v in sorted(srv.get("requests", {}).items()))
        err = ", ".join(f"{k} {v}" for k, v in sorted(srv.get("errors", {}).items())) or "none"
        out.append(f"requests: {req or 'none'}; errors: {err}; pending {srv.get('pending', 0)}")
    return "\n".join(out)


def _backlog_clause(b: dict) -> str:
    """The ingest backlog's forecast for the ``ingest:`` line: how long counting needs to
    drain it at the measured rate, against ``backlog_s``, and the ``busy`` answers so far
    ("" from a daemon that does not forecast)."""
    if "forecast_s" not in b:
        return ""
    busy = b.get("busy") or {}
    refused = ", ".join(f"{k} {v}" for k, v in busy.items() if v) or "none"
    return (f", drains in {b['forecast_s']:.1f} s at {b.get('rate_records_s', 0):.1f} "
            f"records/s (bound {b.get('limit_s', 0):g} s); busy answers: {refused}")


def _fleet_error(fl: dict) -> str:
    """The fleet's last error, with its age when the daemon gives one; "" when there is none
    (the daemon clears it once connected again: it showed a stale error next to
    ``connected``)."""
    if not fl.get("last_error"):
        return ""
    age = fl.get("last_error_age_s")
    return f"; last error{'' if age is None else f' {age:.0f} s ago'}: {fl['last_error']}"
