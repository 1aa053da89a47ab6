"""Generators' draft-length-policy states, kept as opaque blobs in the table's ``meta`` family.

A generator saves what its policy learned under a key (``save``) and a later one of the same
kind loads it (``load``), so a restart does not start cold.  The states ride the table: they
survive a restart and travel in checkpoints and snapshots.  The daemon never reads inside a
state; a stored value is msgpack ``{"state": bytes, "saved_at": unix s}`` under
``rocks.META_POLICY + key``.
"""

from __future__ import annotations

import logging
import threading
import time

import msgpack

from ..wire.errors import BadInput
from .rocks import META_POLICY, Rocks
from .runs import storage as _storage

log = logging.getLogger("ngramd.cold")


def _policy_value(raw: bytes) -> tuple[bytes, float] | None:
    """``(state, saved_at)`` of a stored policy value, None when it is unreadable."""
    try:
        v = msgpack.unpackb(raw, raw=False)
    except Exception:  # msgpack raises several types
        return None
    if not (isinstance(v, dict) and isinstance(v.get("state"), bytes)
            and isinstance(v.get("saved_at"), (int, float))):
        return None
    return v["state"], float(v["saved_at"])


class PolicyStates:
    """The policy states of one table (``ColdStore.policies``).  ``save`` and ``load`` from any
    thread; ``lock`` serialises saves, and the store takes it too while it closes or reopens
    RocksDB.  ``check_open()`` raises ``StorageError`` while RocksDB is closed or reopened."""

    def __init__(self, rocks: Rocks, check_open):
        self.rocks = rocks
        self._check_open = check_open
        self.lock = threading.Lock()
        #: key -> size of the state stored under it; replaced, never changed in place, so
        #: ``stats`` reads it without the lock
        self._held: dict[bytes, int] = {
            k[len(META_POLICY):]: len((_policy_value(v) or (v, 0))[0])
            for k, v in rocks.meta_range(META_POLICY)}

    def save(self, key: bytes, state: bytes, max_keys: int) -> int:
        """Store ``state`` under ``key`` with the time (one durable write), replacing what was
        there; returns the keys stored now.  A key not stored yet while ``max_keys`` are is
        ``BadInput`` (nothing is written)."""
        value = msgpack.packb({"state": bytes(state), "saved_at": time.time()},
                              use_bin_type=True)
        with self.lock:
            self._check_open()
            held = self._held
            if key not in held and len(held) >= max_keys:
                raise BadInput(f"the table holds policy states under {len(held)} keys, the "
                               f"most it keeps (MAX_POLICY_STATES = {max_keys}); save under "
                               f"one of them")
            with _storage("saving a policy state"):
                self.rocks.put_meta({META_POLICY + key: value})
            self._held = {**held, key: len(state)}
            return len(self._held)

    def load(self, key: bytes) -> tuple[bytes, float] | None:
        """``(state, saved_at)`` stored under ``key`` by ``save``, or None (an unreadable value
        is logged and read as none: the generator starts cold and its next save replaces
        it)."""
        self._check_open()
        with _storage("reading a policy state"):
            raw = self.rocks.meta.get(META_POLICY + key)
        if raw is None:
            return None
        got = _policy_value(raw)
        if got is None:
            log.warning("cold tier: the policy state under %r is unreadable; answered as none",
                        key)
        return got

    def stats(self) -> dict:
        """Keys holding a policy state, and the states' bytes (no I/O)."""
        held = self._held
        return {"keys": len(held), "bytes": sum(held.values())}
