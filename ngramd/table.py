"""``Table``: drafting and lookups over both tiers, ingest, hot rebuilds and statistics.

Fast path: the hot tier (the slot array this process last published to shared memory) plus a
small in-daemon *warm cache* of entries read from the cold tier, both drafted by the same
kernel (``kernels.draft_batch``).  Slow path: keys longer than what the fast path matched are
read from RocksDB when the estimated cost fits the caller's latency budget; otherwise the
request is answered from the fast path at a lower order (a *degrade*, counted per order) and
the cold read runs in the background so the next request finds the entry in the warm cache
(DESIGN §7).

Writes never block reads: ``ingest`` only appends to the durable log; one writer thread applies
the log to the counts and refreshes the hot candidate pool; a rebuild thread publishes new hot
generations on a schedule and on demand.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from pathlib import Path

import numpy as np

from . import kernels as K
from .cold import ColdStore
from .config import TableConfig
from .errors import TIMEOUT, BadInput, NgramError
from .hot import HotBuilder, HotCandidates, HotPublisher
from .identity import TableIdentity, tokenizer_fingerprint
from .stats import TableStats

log = logging.getLogger("ngramd.table")

_EMPTY_SLOTS = np.zeros((0, K.SLOT_WORDS), np.uint32)
_NO_TIER = 255


class Table:
    """One n-gram table: cold tier in RocksDB, hot tier in shared memory."""

    def __init__(self, config: TableConfig):
        self.config = config
        fp = tokenizer_fingerprint(config.tokenizer) if config.tokenizer else ""
        self.identity = TableIdentity(n_min=config.n_min, n_max=config.n_max,
                                      cold_k=config.cold_k, vocab_size=config.vocab_size,
                                      tokenizer=fp)
        self.n_min, self.n_max = config.n_min, config.n_max
        self.c_min = config.per_order("c_min", np.uint32)
        self.s_min = config.per_order("s_min", np.float32)
        self.max_probe = config.hot_max_probe
        self.stats = TableStats(self.n_max)
        path = Path(config.data_dir) / config.name
        path.parent.mkdir(parents=True, exist_ok=True)
        self.cold = ColdStore(str(path), self.identity, config.cold)
        self.publisher = HotPublisher(config.shm_dir, config.name, self.identity,
                                      grace_s=config.hot_grace_s)
        self.builder = HotBuilder()
        budget_slots = int(config.hot_budget_mb * 2**20) // K.SLOT_BYTES
        self.pool = HotCandidates(max_rows=max(4 * budget_slots, 1024))
        self._pool_lock = threading.Lock()  # writer (upsert) vs rebuild (decay/rows)
        self._hit_keys: list[np.ndarray] = []  # drained into the pool at each rebuild
        self._redundant = np.zeros(0, np.uint64)  # Bloom filter of keys pruned as redundant
        self._hot = _EMPTY_SLOTS  # the generation this process last published (immutable)
        self._hot_info: dict = {}
        warm_cap = 1 << max(10, int(np.ceil(np.log2(max(config.warm_cache_entries, 1) * 2))))
        self._warm = np.zeros((warm_cap, K.SLOT_WORDS), np.uint32)
        self._warm_used = 0
        self._warm_lock = threading.Lock()
        self._cold_us = 50.0  # running estimate of one cold key read (µs), refined as we go
        self._hot_us = 1.0  # running estimate of one hot draft step (µs)
        self._bg = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="ngramd-coldbg")
        self._bg_pending = 0  # background cold reads queued or running (<= 4)
        self._bg_lock = threading.Lock()
        self._closed = False
        self._wake = threading.Condition()
        self._applied_cv = threading.Condition()
        self._rebuild_req = threading.Event()
        self._rebuild_full = False  # what the pending on-demand rebuild asked for
        self._rebuild_done = threading.Condition()
        self._generation = 0
        self._stop = threading.Event()
        self._writer_error: BaseException | None = None
        self._warm_kernels()
        # a table that already holds counts starts with a full hot build from the cold tier
        self._rebuild(full=self.cold.last_seq() > 0)
        self._writer = threading.Thread(target=self._writer_loop, name="ngramd-writer", daemon=True)
        self._writer.start()
        self._rebuilder = threading.Thread(target=self._rebuild_loop, name="ngramd-hot", daemon=True)
        self._rebuilder.start()

    # ------------------------------------------------------------------ reads (never block)
    def draft(self, tokens: np.ndarray, offsets: np.ndarray, max_len: int,
              budget_us: float | None = None) -> dict:
        """Draft up to ``max_len`` tokens for each context ``tokens[offsets[i]:offsets[i+1]]``.

        Returns arrays ``tok, order, tier, conf`` of shape (B, max_len) and ``length`` (B,).
        ``budget_us`` bounds the time spent on cold reads for this call (default: the
        configured budget, or 1.5 x the mean fast-path draft time).
        """
        t0 = time.perf_counter()
        max_len = int(max_len)
        if not 1 <= max_len <= self.config.max_draft_len:
            raise BadInput(f"max_len {max_len} outside 1..{self.config.max_draft_len}")
        out = self._fast_draft(tokens, offsets, max_len)
        t_fast = (time.perf_counter() - t0) * 1e6
        nb = offsets.shape[0] - 1
        self._hot_us = 0.95 * self._hot_us + 0.05 * (t_fast / max(nb, 1))
        budget = budget_us if budget_us is not None else self._budget_us()
        redo = self._cold_refine(tokens, offsets, out, max(budget - t_fast, 0.0))
        if redo.size:
            sub_tok, sub_off = _select(tokens, offsets, redo)
            again = self._fast_draft(sub_tok, sub_off, max_len)
            for k in ("tok", "order", "tier", "conf", "length"):
                out[k][redo] = again[k]
        self._count_draft(tokens, offsets, out)
        self.stats.latency["draft"].add((time.perf_counter() - t0) * 1e6)
        return out

    def lookup(self, tokens: np.ndarray, offsets: np.ndarray) -> dict:
        """Top-3 candidates per order for each context, hot first then cold for the orders the
        hot tier lacks.  ``tier`` is 1 (hot), 2 (cold) or 255 (absent)."""
        nb = offsets.shape[0] - 1
        w = self.n_max + 1
        tok = np.full((nb, w, K.HOT_K), K.EMPTY_TOKEN, np.uint32)
        cnt = np.zeros((nb, w, K.HOT_K), np.uint32)
        total = np.zeros((nb, w), np.uint32)
        t0 = time.perf_counter()
        K.lookup_batch(self._hot, self.max_probe, tokens, offsets, self.n_min, self.n_max,
                       tok, cnt, total)
        self.stats.latency["hot"].add((time.perf_counter() - t0) * 1e6)
        tier = np.where(total > 0, K.TIER_HOT, _NO_TIER).astype(np.uint8)
        lens = np.diff(offsets)
        miss_b, miss_n = np.nonzero((total == 0) & (np.arange(w)[None, :] >= self.n_min)
                                    & (np.arange(w)[None, :] <= lens[:, None]))
        for n in range(self.n_min, w):  # keys looked up: contexts at least n tokens long
            self.stats.lookups[K.TIER_HOT, n] += int((lens >= n).sum())
            self.stats.hits[K.TIER_HOT, n] += int((tier[:, n] == K.TIER_HOT).sum())
        if miss_b.size:
            rows = self._cold_get(miss_n, tokens, offsets, miss_b)
            for b, n, r in zip(miss_b, miss_n, rows):
                if r is None:
                    continue
                t, tk, ct = r
                k = min(K.HOT_K, tk.size)
                tok[b, n, :k] = tk[:k]
                cnt[b, n, :k] = ct[:k]
                total[b, n] = t
                tier[b, n] = K.TIER_COLD
        return {"tok": tok, "cnt": cnt, "total": total, "tier": tier}

    # ------------------------------------------------------------------ writes
    def ingest(self, tokens: np.ndarray, offsets: np.ndarray) -> tuple[int, int]:
        """Append sequences to the durable ingest log; returns (first_seq, last_seq) once they
        are durable.  Counting happens later on the writer thread."""
        t0 = time.perf_counter()
        seqs = self.cold.append_log(tokens, offsets)
        self.stats.latency["ingest"].add((time.perf_counter() - t0) * 1e6)
        with self._wake:
            self._wake.notify()
        return seqs

    def report(self, drafted: dict, accepted: dict) -> None:
        self.stats.report(drafted, accepted)

    def flush(self, timeout_s: float = 600.0) -> int:
        """Wait until everything in the log is applied to the counts; returns the applied seq."""
        target = self.cold.last_seq()
        deadline = time.monotonic() + timeout_s
        with self._wake:
            self._wake.notify()
        with self._applied_cv:
            while self.cold.applied_seq() < target:
                if self._writer_error is not None:
                    raise self._writer_error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NgramError(f"ingest log not applied within {timeout_s} s "
                                     f"(log lag {self.cold.last_seq() - self.cold.applied_seq()})",
                                     TIMEOUT)
                self._applied_cv.wait(min(left, 0.5))
        self.cold.flush()
        return self.cold.applied_seq()

    def rebuild_hot(self, full: bool = False, timeout_s: float = 600.0) -> int:
        """Build and publish a new hot generation now; returns its number."""
        with self._rebuild_done:
            before = self._generation
            self._rebuild_full = full
            self._rebuild_req.set()
            ok = self._rebuild_done.wait_for(lambda: self._generation > before or self._closed,
                                             timeout_s)
        if not ok:
            raise NgramError(f"hot rebuild did not finish within {timeout_s} s", TIMEOUT)
        return self._generation

    # ------------------------------------------------------------------ info
    def info(self) -> dict:
        return {
            "identity": self.identity.__dict__.copy(),
            "hot": {"shm_dir": str(self.config.shm_dir), "table": self.config.name,
                    "generation": self._generation, "max_probe": self.max_probe},
            "orders": [self.n_min, self.n_max],
            "limits": {"max_draft_len": self.config.max_draft_len},
            "confidence": {"c_min": self.c_min[self.n_min:].tolist(),
                           "s_min": [round(float(x), 4) for x in self.s_min[self.n_min:]],
                           "p_cum": self.config.p_cum, "f_cap": self.config.f_cap},
        }

    def stats_dict(self) -> dict:
        s = self.stats.snapshot(self.n_min)
        cold = self.cold.stats()
        s["cold"] = cold
        s["hot"] = dict(self._hot_info, generation=self._generation,
                        bytes=int(self._hot.nbytes), slots=int(self._hot.shape[0]),
                        redundant_filter_bytes=int(self._redundant.nbytes))
        s["warm_cache"] = {"entries": self._warm_used, "capacity": int(self._warm.shape[0])}
        s["budget_us"] = round(self._budget_us(), 2)
        s["log_lag"] = self.cold.last_seq() - self.cold.applied_seq()
        return s

    def top(self, order: int, n: int):
        if not self.n_min <= order <= self.n_max:
            raise BadInput(f"order {order} outside {self.n_min}..{self.n_max}")
        return self.cold.top(order, n)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        with self._wake:
            self._wake.notify_all()
        self._rebuild_req.set()
        self._writer.join(timeout=60)
        self._rebuilder.join(timeout=60)
        self._bg.shutdown(wait=True, cancel_futures=True)
        with self._rebuild_done:
            self._rebuild_done.notify_all()
        self.publisher.close(unlink=True)
        self.cold.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ internals
    def _warm_kernels(self) -> None:
        """Compile (or load from numba's cache) every kernel of the request path now: a first
        compile inside a request would blow its latency budget by seconds."""
        toks = np.arange(self.n_max + 2, dtype=np.uint32)
        offs = np.array([0, toks.size], np.int64)
        out = self._fast_draft(toks, offs, 2)
        self._candidates(toks, offs, out)
        keys = np.empty(4, np.uint64)
        K.draft_keys(toks, offs, out["tok"], out["order"], out["length"], self.n_max, keys)
        K.bloom_has(K.bloom_build(keys, K.BLOOM_BITS_PER_KEY), keys[0])
        K.warm_insert(np.zeros((16, K.SLOT_WORDS), np.uint32), 4, np.uint64(1), 1,
                     toks[:1], toks[:1], 1)
        w = self.n_max + 1
        K.lookup_batch(self._hot, self.max_probe, toks, offs, self.n_min, self.n_max,
                       np.zeros((1, w, K.HOT_K), np.uint32), np.zeros((1, w, K.HOT_K), np.uint32),
                       np.zeros((1, w), np.uint32))
        self.stats.latency["hot"] = type(self.stats.latency["hot"])()  # not a real request

    def _budget_us(self) -> float:
        if self.config.budget_us > 0:
            return self.config.budget_us
        # DESIGN §7: the seed's rule, 1.5 x the mean in-memory lookup time, per draft step
        return 1.5 * self._hot_us * self.config.max_draft_len

    def _fast_draft(self, tokens, offsets, max_len) -> dict:
        nb = offsets.shape[0] - 1
        out = {"tok": np.zeros((nb, max_len), np.uint32),
               "order": np.zeros((nb, max_len), np.uint8),
               "tier": np.zeros((nb, max_len), np.uint8),
               "conf": np.zeros((nb, max_len), np.float32),
               "length": np.zeros(nb, np.int32)}
        hot = self._hot
        t0 = time.perf_counter()
        K.draft_batch(self._warm, hot, self.max_probe, tokens, offsets, self.n_min, self.n_max,
                      max_len, self.c_min, self.s_min, self.config.p_cum, self.config.f_cap,
                      K.TIER_COLD, K.TIER_HOT, out["tok"], out["order"], out["tier"],
                      out["conf"], out["length"], True, True)  # both tables are incomplete
        self.stats.latency["hot"].add((time.perf_counter() - t0) * 1e6)
        return out

    def _cold_refine(self, tokens, offsets, out, budget_us) -> np.ndarray:
        """Read from the cold tier the keys longer than what the fast path matched, step by
        step along the drafts, while the estimated cost fits ``budget_us``; past the budget,
        degrade (answer from the fast path) and read them in the background.  Returns the
        indices of contexts whose draft should be recomputed (their keys are now warm)."""
        t_end = time.perf_counter() + budget_us / 1e6
        redo_all = np.zeros(0, np.int64)
        cur_tok, cur_off, cur_idx = tokens, offsets, np.arange(offsets.shape[0] - 1)
        cur = out
        for _ in range(out["tok"].shape[1] + 1):  # each round fixes at least one more step
            rows = self._candidates(cur_tok, cur_off, cur)
            if rows is None:
                break
            c_ctx, c_ord, c_key, c_pos = rows
            # the context of candidate i is context + its draft up to step c_pos[i]
            ext_tok, ext_off = _extend(cur_tok, cur_off, cur["tok"], c_ctx, c_pos)
            if not self._fetch_longest_first(c_ctx, c_pos, c_ord, c_key, ext_tok, ext_off,
                                             t_end):
                break
            touched = np.unique(c_ctx)
            cur_idx = cur_idx[touched]
            redo_all = np.union1d(redo_all, cur_idx)
            cur_tok, cur_off = _select(cur_tok, cur_off, touched)
            cur = self._fast_draft(cur_tok, cur_off, out["tok"].shape[1])
        return redo_all

    def _fetch_longest_first(self, c_ctx, c_pos, c_ord, c_key, tokens, offsets, t_end) -> bool:
        """Read candidate keys into the warm cache, longest order first within each draft step,
        stopping a step at its first key present in the cold tier: only the longest match
        matters, and absent keys are cheap (Bloom filter) while present ones cost a data-block
        read.  Rounds that do not fit before ``t_end`` degrade to the background.  Returns
        False when it degraded."""
        # keys the Bloom filters rule out need no read: cache them as absent right away
        maybe = self.cold.may_exist(c_ord, tokens, offsets)
        if not maybe.all():
            self._warm_negative(c_ord[~maybe], c_key[~maybe])
            keep = np.flatnonzero(maybe)
            if not keep.size:
                return True
            c_ctx, c_pos, c_ord, c_key = c_ctx[keep], c_pos[keep], c_ord[keep], c_key[keep]
            tokens, offsets = _select(tokens, offsets, keep)
        group = c_ctx * (self.config.max_draft_len + 2) + c_pos
        starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])  # rows come grouped
        rank = np.arange(group.size) - np.repeat(starts, np.diff(np.r_[starts, group.size]))
        done = np.zeros(group.size, bool)  # per row: its step already has its longest match
        for r in range(int(rank.max()) + 1):
            sel = np.flatnonzero((rank == r) & ~done)
            if not sel.size:
                break
            if sel.size * self._cold_us > (t_end - time.perf_counter()) * 1e6:
                rest = np.flatnonzero((rank >= r) & ~done)
                self._degrade(c_ord[rest], c_key[rest], *_select(tokens, offsets, rest))
                return False
            rows = self._fetch_into_warm(c_ord[sel], c_key[sel], tokens, offsets, sel)
            hit_groups = group[sel[[i for i, row in enumerate(rows) if row is not None]]]
            done |= np.isin(group, hit_groups)
        return True

    def _candidates(self, tokens, offsets, d):
        nb = offsets.shape[0] - 1
        cap = nb * self.n_max * (d["tok"].shape[1] + 1)
        c_ctx = np.empty(cap, np.int64)
        c_ord = np.empty(cap, np.int64)
        c_key = np.empty(cap, np.uint64)
        c_pos = np.empty(cap, np.int64)
        with self._warm_lock:
            m = K.cold_candidates(tokens, offsets, d["tok"], d["order"], d["length"], self.n_min,
                                 self.n_max, self._warm, self._hot, self.max_probe,
                                 self._redundant, c_ctx, c_ord, c_key, c_pos)
        if not m:
            return None
        return c_ctx[:m], c_ord[:m], c_key[:m], c_pos[:m]

    def _degrade(self, orders, keys, tokens, offsets) -> None:
        """Answer from the fast path now; warm the cache in the background (bounded queue).
        ``tokens``/``offsets`` hold one context per key."""
        np.add.at(self.stats.degrades, orders, 1)
        with self._bg_lock:
            if self._bg_pending >= 4:  # bounded: a burst of misses must not queue without end
                return
            self._bg_pending += 1
        fut = self._bg.submit(self._fetch_into_warm, orders, keys, tokens, offsets,
                              np.arange(keys.size))
        fut.add_done_callback(self._bg_done)

    def _bg_done(self, fut):
        with self._bg_lock:
            self._bg_pending -= 1
        if fut.exception() is not None and not self._closed:
            log.warning("background cold read failed: %s", fut.exception())

    def _cold_get(self, orders, tokens, offsets, ctx_idx):
        """Cold reads of the last ``orders[i]`` tokens of context ``ctx_idx[i]`` (timed)."""
        sub_tok, sub_off = _select(tokens, offsets, ctx_idx)
        t0 = time.perf_counter()
        rows = self.cold.get_many(np.asarray(orders, np.int64), sub_tok, sub_off)
        us = (time.perf_counter() - t0) * 1e6
        orders = np.asarray(orders, np.int64)
        np.add.at(self.stats.lookups[K.TIER_COLD], orders, 1)
        found = np.fromiter((r is not None for r in rows), bool, count=len(rows))
        np.add.at(self.stats.hits[K.TIER_COLD], orders[found], 1)
        n = max(len(rows), 1)
        self.stats.latency["cold"].add(us / n, n)
        self._cold_us = 0.9 * self._cold_us + 0.1 * (us / n)
        return rows

    def _warm_negative(self, orders, keys) -> None:
        """Record keys known to be absent from the cold tier in the warm cache."""
        np.add.at(self.stats.lookups[K.TIER_COLD], np.asarray(orders, np.int64), 1)
        self._warm_put(orders, keys, [None] * len(keys))

    def _fetch_into_warm(self, orders, keys, tokens, offsets, ctx_idx) -> list:
        """Cold reads of ``keys`` (of context ``ctx_idx[i]``) into the warm cache, absent ones
        as negative entries; returns the rows read (None = absent)."""
        rows = self._cold_get(orders, tokens, offsets, ctx_idx)
        self._warm_put(orders, keys, rows)
        return rows

    def _warm_put(self, orders, keys, rows) -> None:
        """Insert cold rows (None = absent: a negative entry) into the bounded warm cache."""
        empty_u32 = np.zeros(0, np.uint32)
        with self._warm_lock:
            if self._warm_used + len(rows) > self._warm.shape[0] // 2:
                self._warm[:] = 0  # bounded cache: start over rather than grow probe chains
                self._warm_used = 0
            for key, n, r in zip(keys, orders, rows):
                if r is None:
                    tk = ct = empty_u32
                    t = 0
                else:
                    t, tk, ct = r
                ok = K.warm_insert(self._warm, self.max_probe, np.uint64(key), int(n),
                                   tk.astype(np.uint32), ct.astype(np.uint32), int(t))
                self._warm_used += 1
                if not ok:
                    self._warm[:] = 0
                    self._warm_used = 0

    def _count_draft(self, tokens, offsets, out) -> None:
        L = out["length"]
        if not L.any():
            return
        K.tally_drafts(out["tier"], out["order"], L, self.stats.drafted)
        if len(self._hit_keys) < 4096:  # bounded between rebuilds
            keys = np.empty(int(L.sum()), np.uint64)
            m = K.draft_keys(tokens, offsets, out["tok"], out["order"], L, self.n_max, keys)
            self._hit_keys.append(keys[:m])

    def _writer_loop(self) -> None:
        """The single writer: applies the ingest log to the counts."""
        while not self._stop.is_set():
            try:
                res = self.cold.apply(self.config.apply_batch_tokens)
            except BaseException as e:  # keep serving reads; report through flush()/stats
                log.exception("applying the ingest log failed")
                self._writer_error = e
                self._stop.wait(1.0)
                continue
            self._writer_error = None
            if res is not None:
                self.stats.ingested_tokens += res.tokens
                with self._pool_lock:
                    self.pool.upsert({"key": res.key, "parent": res.parent, "order": res.order,
                                      "total": res.total, "tok": res.tok, "cnt": res.cnt})
                with self._applied_cv:
                    self._applied_cv.notify_all()
                continue
            with self._applied_cv:
                self._applied_cv.notify_all()
            with self._wake:
                if self.cold.applied_seq() >= self.cold.last_seq():
                    self._wake.wait(0.2)

    def _rebuild_loop(self) -> None:
        period = self.config.hot_rebuild_s
        while not self._stop.is_set():
            fired = self._rebuild_req.wait(period if period > 0 else None)
            if self._stop.is_set():
                break
            full = self._rebuild_full if fired else False
            self._rebuild_req.clear()
            self._rebuild_full = False
            try:
                self._rebuild(full)
            except Exception:
                log.exception("hot rebuild failed; keeping generation %d", self._generation)
                with self._rebuild_done:
                    self._rebuild_done.notify_all()

    def _rebuild(self, full: bool) -> None:
        t0 = time.perf_counter()
        applied = self.cold.applied_seq()
        fields = ("key", "parent", "order", "total", "tok", "cnt")
        with self._pool_lock:
            if full:
                self.pool.clear()
                for chunk in self.cold.scan():
                    self.pool.upsert({f: chunk[f] for f in fields})
            self.pool.decay(self.config.hit_decay)
            hits, self._hit_keys = self._hit_keys, []
            for keys in hits:
                self.pool.add_hits(keys)
            rows = self.pool.rows()
        budget = int(self.config.hot_budget_mb * 2**20)
        slots, info, redundant = self.builder.build(rows, budget, self.c_min, self.s_min,
                                                    self.max_probe, return_pruned=True)
        skip = K.bloom_build(redundant, K.BLOOM_BITS_PER_KEY) if redundant.size else \
            np.zeros(0, np.uint64)
        gen = self.publisher.publish(slots, self.max_probe, applied)
        self._hot = slots
        self._redundant = skip
        self._hot_info = dict(info, build_s=round(time.perf_counter() - t0, 3))
        with self._warm_lock:
            self._warm[:] = 0  # entries may now be hot (or stale): start the warm cache over
            self._warm_used = 0
        with self._rebuild_done:
            self._generation = gen
            self._rebuild_done.notify_all()
        log.info("hot generation %d: %s", gen, self._hot_info)


def _extend(tokens, offsets, d_tok, ctx_idx, steps):
    """Contexts ``ctx_idx[i]`` extended by their first ``steps[i]`` drafted tokens."""
    seqs = [np.concatenate((tokens[offsets[b]:offsets[b + 1]], d_tok[b, :j]))
            for b, j in zip(ctx_idx.tolist(), steps.tolist())]
    offs = np.zeros(len(seqs) + 1, np.int64)
    np.cumsum([s.size for s in seqs], out=offs[1:])
    return np.concatenate(seqs).astype(np.uint32, copy=False), offs


def _select(tokens: np.ndarray, offsets: np.ndarray, idx: np.ndarray):
    """Sub-batch (tokens, offsets) of the contexts ``idx`` (repeats allowed)."""
    idx = np.asarray(idx, np.int64)
    starts, ends = offsets[idx], offsets[idx + 1]
    lens = ends - starts
    new_off = np.zeros(idx.size + 1, np.int64)
    np.cumsum(lens, out=new_off[1:])
    if idx.size == 0:
        return np.zeros(0, np.uint32), new_off
    gather = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)])
    return tokens[gather], new_off
