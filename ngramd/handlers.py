"""What the daemon does for each op: one handler per op declared in ``wire/commands.py``.

The declarations (the contract both sides share) say what a request and a reply hold; the
handlers here are the daemon's half, the only code that reaches into the serving
``ngramd.server.Server`` (``srv.table``, ``srv.fleet``, ``srv.cfg``, ``srv.stopping``).  The
server validates a request by its declaration, then calls ``HANDLERS[op](srv, **args)``
with the validated fields (and ``tokens``, ``offsets``, ``keys``); the handler returns the
reply's fields, the declared ``arrays`` among them (or None for an empty reply).  Where it
runs (the serving loop, a worker, the ingest thread) is the declaration's ``runs``.

``ingest`` has no handler: the server's ingest thread group-commits it
(``writefront.IngestFront``).

Importing this module loads neither numba nor RocksDB (``import ngramd.server`` must not:
tests/test_server.py); what a handler needs of the table comes in through ``srv``.
"""

from __future__ import annotations

import os
from typing import Callable

import numpy as np

from .wire.commands import COMMANDS, MAX_POLICY_STATES
from .wire.constants import EMPTY_TOKEN
from .wire.errors import UNAVAILABLE, BadInput, NgramError
from .wire.protocol import PROTOCOL_VERSION

#: op name -> handler(srv, **args) -> reply fields (module doc)
HANDLERS: dict[str, Callable[..., dict | None]] = {}


def handles(name: str) -> Callable:
    """Register the decorated function as the daemon's handler of op ``name``."""
    def register(fn: Callable) -> Callable:
        assert name not in HANDLERS, f"op {name} handled twice"
        HANDLERS[name] = fn
        return fn
    return register


@handles("ping")
def ping(srv):
    return {"instance": srv.instance, "health": srv.table.health()["state"]}


@handles("info")
def info(srv):
    out = srv.table.info()
    out["health"] = srv.table.health()
    out["server"] = {
        "protocol": PROTOCOL_VERSION, "instance": srv.instance, "pid": os.getpid(),
        "endpoints": srv.endpoints, "ops": sorted(COMMANDS),
        "limits": {k: getattr(srv.cfg, k) for k in
                   ("max_msg_bytes", "max_batch", "max_tokens", "max_pending")},
    }
    return out


@handles("stats")
def stats(srv):
    return srv.stats()


@handles("draft")
def draft(srv, tokens, offsets, max_len, budget_us):
    return srv.table.draft(tokens, offsets, max_len, budget_us).arrays()


@handles("lookup")
def lookup(srv, tokens, offsets):
    return srv.table.lookup(tokens, offsets)


@handles("report")
def report(srv, drafted, accepted, policy, keys):
    srv.table.report(drafted, accepted, keys, policy)


@handles("top")
def top(srv, order, n):
    rows = srv.table.top(order, n)
    k = max((len(r[2]) for r in rows), default=0)
    tok = np.full((len(rows), k), EMPTY_TOKEN, np.uint32)
    cnt = np.zeros((len(rows), k), np.uint32)
    for i, (_key, _total, t, c) in enumerate(rows):
        tok[i, :len(t)] = t
        cnt[i, :len(c)] = c
    return {"order": order, "key": np.array([r[0] for r in rows], np.uint64),
            "total": np.array([r[1] for r in rows], np.uint64), "tok": tok, "cnt": cnt}


@handles("rebuild_hot")
def rebuild_hot(srv, full):
    return {"generation": int(srv.table.rebuild_hot(full=full, abort=srv.stopping))}


@handles("flush")
def flush(srv, wait_s):
    if srv.stopping.is_set():
        raise NgramError("daemon is shutting down", UNAVAILABLE)
    return {"applied": int(srv.table.writes.flush(timeout_s=wait_s, abort=srv.stopping))}


@handles("checksum")
def checksum(srv):
    return srv.table.cold.checksum(srv.stopping)


@handles("snapshot")
def snapshot(srv, to_dir):
    from .fleet import snapshot_to_dir  # RocksDB: loaded when a snapshot is asked for

    if srv.fleet is not None:
        return srv.fleet.snapshot(srv.snapshot_dir if to_dir else None, abort=srv.stopping)
    if not to_dir:
        raise BadInput("[fleet] is off: there is no object store; use to_dir "
                       "(ngramd snapshot --to-dir)")
    return snapshot_to_dir(srv.table, srv.snapshot_dir, abort=srv.stopping)


@handles("hot_curve")
def hot_curve(srv, tokens, offsets, max_mb, points, prompt_tokens, max_len):
    return srv.table.hotcycle.hot_curve(tokens, offsets, max_mb=max_mb, points=points,
                               prompt_tokens=prompt_tokens, max_len=max_len,
                               abort=srv.stopping)


@handles("save_policy")
def save_policy(srv, key, state):
    held = srv.table.policies.save(key.encode("ascii"), state, MAX_POLICY_STATES)
    return {"key": key, "bytes": len(state), "states": held}


@handles("load_policy")
def load_policy(srv, key):
    state, saved_at = srv.table.policies.load(key.encode("ascii")) or (None, None)
    return {"state": state, "saved_at": saved_at}
