"""Draft sources and the choice of draft length.

* :class:`DraftSource` — what the speculative loop asks for drafts.  It follows a request's
  life: ``start(prompt)``, ``extend(tokens)`` as tokens are emitted, ``draft(max_len)``,
  ``finish()``.  The base class keeps the request's context (prompt + output so far) in a
  growing ``uint32`` buffer; test doubles subclass it and only write ``draft``.
* :class:`NgramDrafter` — the production source (ARCHITECTURE §3, §8): chained longest match over the
  request-local table (built incrementally from the context by ``kernels.local.local_add``) and the
  shared-memory hot and recent tiers, local first; when that draft is short, the daemon is asked
  without waiting, and its answer is used at a later step if it still fits the tokens emitted
  since and beats the in-process draft (the class says when it asks).

How many of a draft's tokens to verify is :mod:`.policy`'s decision.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from ngramd import kernels
from ngramd.kernels.drafting import draft_keys
from ngramd.kernels.local import local_add
from ngramd.wire.constants import MAX_ORDER, SLOT_WORDS
from ngramd.drafttiers import LOCAL_FIRST, NO_SHARED, DraftTiers, SharedTiers
from ngramd.wire.commands import Draft
from ngramd.wire.rules import DEFAULT_RULES, RULE_FIELDS, DraftRules

from .remote import DaemonLink

log = logging.getLogger(__name__)

#: Largest request-local table: 2M slots = 64 MiB, at load factor <= 1/2 (``_capacity_for``) a
#: 64k-token request at orders 1..16 (16 keys a token at most); a longer one fills it further.
MAX_LOCAL_SLOTS = 1 << 21


@dataclass(frozen=True)
class DraftConfig:
    """Settings of request-local drafting (defaults from ARCHITECTURE §3).

    ``rules``: orders, stop rules and the draft limit (``max_draft_len``: the longest draft
    this generator verifies), ``DraftRules``' defaults until a daemon's ``info()`` replaces
    them (``settings_from_table``).  The rest is local: ``local_slots`` is the minimum
    capacity of the request-local table (slots of 32 bytes); it grows to twice the number of
    keys a request can insert, up to ``MAX_LOCAL_SLOTS``.  ``ask_below_order``,
    ``remote_budget_ms``, ``remote_wait_ms`` and ``ask_backoff`` govern the asynchronous daemon
    asks (see :class:`NgramDrafter` and :class:`AskGate`).
    """

    rules: DraftRules = DEFAULT_RULES
    max_probe: int = 16
    local_slots: int = 1 << 16
    # the daemon (whole table, cold tier included) is asked, without waiting, whenever the
    # in-process draft is shorter than asked or starts below this order; its answer is used at
    # the next step (one verify forward later: 10-30 ms on a GPU, 60-180 ms on this CPU) if it
    # is longer or starts at a longer order
    ask_below_order: int = 12
    remote_budget_ms: float = 20.0  # the daemon's time for cold reads per ask
    remote_wait_ms: float = 0.0  # wait this long for an answer on a total miss (0: never wait)
    # while the daemon's answers are not used, at most every ask_backoff-th short draft asks
    # (AskGate; 1: every one)
    ask_backoff: int = 64

    def __post_init__(self):
        if not isinstance(self.rules, DraftRules):
            raise ValueError(f"rules must be a DraftRules, got {type(self.rules).__name__}")
        if self.ask_backoff < 1:
            raise ValueError(f"ask_backoff must be >= 1, got {self.ask_backoff}")
        if self.local_slots & (self.local_slots - 1) or self.local_slots < 64:
            raise ValueError(f"local_slots must be a power of two >= 64, got {self.local_slots}")


def settings_from_table(info: dict, base: DraftConfig = DraftConfig(),
                        overrides: dict | None = None) -> DraftConfig:
    """``base`` with the rules of the daemon's ``info()`` (``DraftRules.from_info``: orders,
    stop rules, ``limits.max_draft_len``), then ``overrides``.

    ``overrides`` are explicit local settings (CLI flags; ``None`` values are unset): the
    ``DraftRules`` fields among them win over the table's (``DraftRules.updated``: new orders
    refit the table's per-order lists) and are logged, once, here; the others replace
    ``base``'s.  ``max_draft_len`` is always clamped to the daemon's (logged): above it every
    remote draft would be ``bad_input``.  Without an answer from a daemon (``info`` empty) the
    result is ``base`` plus ``overrides``.
    """
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    mine = {k: v for k, v in overrides.items() if k in RULE_FIELDS}
    table = DraftRules.from_info(info, base.rules)
    rules = table.updated(**mine)
    if mine:
        log.info("local draft settings override the table's: %s", ", ".join(
            f"{k}={v!r} (table: {getattr(table, k) if info else 'not set'!r})"
            for k, v in mine.items()))
    limit = (info.get("limits") or {}).get("max_draft_len")
    if isinstance(limit, int) and limit >= 1 and rules.max_draft_len > limit:
        log.warning("max_draft_len %d is above the daemon's %d: clamped to %d",
                    rules.max_draft_len, limit, limit)
        rules = replace(rules, max_draft_len=limit)
    rest = {k: v for k, v in overrides.items() if k not in RULE_FIELDS}
    return replace(base, rules=rules, **rest)


EMPTY_DRAFT = Draft(np.zeros(0, np.uint32), np.zeros(0, np.uint8), np.zeros(0, np.uint8),
                    np.zeros(0, np.float32))


class DraftSource:
    """Base of draft sources: keeps the request's context; subclasses implement ``draft``."""

    def __init__(self, capacity: int = 4096):
        self._ctx = np.zeros(capacity, np.uint32)
        self._n = 0

    @property
    def context(self) -> np.ndarray:
        """Prompt + output so far (a view: do not keep it across ``extend``)."""
        return self._ctx[:self._n]

    @property
    def length(self) -> int:
        """Tokens of the context (prompt + output so far)."""
        return self._n

    def start(self, prompt, expected_new: int = 0) -> None:
        """Begin a request; ``expected_new`` (tokens) lets sources size their buffers."""
        self._n = 0
        self.extend(prompt)

    def extend(self, tokens) -> None:
        tokens = np.asarray(tokens, np.uint32)
        need = self._n + tokens.shape[0]
        if need > self._ctx.shape[0]:
            grown = np.zeros(max(need, 2 * self._ctx.shape[0]), np.uint32)
            grown[:self._n] = self._ctx[:self._n]
            self._ctx = grown
        self._ctx[self._n:need] = tokens
        self._n = need

    def draft(self, max_len: int) -> Draft:
        """Up to ``max_len`` tokens that may follow :attr:`context`."""
        raise NotImplementedError

    def accepted(self, draft: Draft, n: int) -> None:
        """The first ``n`` tokens of ``draft`` (the last one this source returned) were
        accepted by verification."""

    def used_keys(self) -> np.ndarray:
        """Kernel keys of the shared-table entries whose drafts were accepted this request."""
        return np.zeros(0, np.uint64)

    def finish(self) -> None:
        """End of request."""


class AskGate:
    """Which short drafts ask the daemon: all of them while its answers are used, fewer and
    fewer while they are not (the daemon's answers back off as the draft length does).

    An ask costs the generator a copy and a reply to decode, and the daemon CPU for its cold
    reads, on the host the model runs on.  Where the hot and recent tiers hold what the table
    knows the answer almost never beats the in-process draft (ARCHITECTURE §8.4).  So after
    ``BACKOFF_AFTER`` answers in a row that were not used, only every 2nd short draft asks,
    every 4th after as many more, at most every ``max_interval``-th; one answer used and every
    short draft asks again.  Answers that did not arrive count for nothing.  One gate serves all
    the drafters of a batch (``BatchDrafter``), so they learn together; ``max_interval`` 1:
    every short draft asks."""

    BACKOFF_AFTER = 32

    __slots__ = ("max_interval", "interval", "unused", "ticks", "skipped")

    def __init__(self, max_interval: int = DraftConfig.ask_backoff):
        if max_interval < 1:
            raise ValueError(f"max_interval must be >= 1, got {max_interval}")
        self.max_interval = int(max_interval)
        self.interval = 1  # every interval-th short draft asks
        self.unused = 0  # answers in a row that were not used
        self.ticks = 0  # short drafts seen
        self.skipped = 0  # short drafts that did not ask (counter)

    def want(self) -> bool:
        """A draft is short and no ask of its drafter is pending: whether to ask now."""
        self.ticks += 1
        if self.ticks % self.interval == 0:
            return True
        self.skipped += 1
        return False

    def answered(self, used: bool) -> None:
        """An answer came back and beat the in-process draft (``used``) or not."""
        if used:
            self.interval, self.unused = 1, 0
            return
        self.unused += 1
        if self.unused >= self.BACKOFF_AFTER:
            self.interval = min(2 * self.interval, self.max_interval)
            self.unused = 0


class NgramDrafter(DraftSource):
    """Request-local table + hot and recent tiers (in-process, µs) + the daemon (async).

    Every step drafts in-process first.  When that draft is short (fewer tokens than asked, or
    a first match below ``ask_below_order``), the daemon is asked for the same context without
    waiting (as often as its answers are used: :class:`AskGate`); by the next step one verify forward has passed, and its answer (the whole table:
    warm cache and cold tier too) is used if it still fits the tokens emitted since and beats
    the in-process draft (more tokens, or a longer first match); an answer waited for on a total
    miss almost never arrives in time (ARCHITECTURE §13).

    It also remembers the keys of hot-tier entries whose drafts were accepted (``used_keys``):
    the generator reports them, and they rank the next hot generation.

    Buffers are allocated and the numba kernels compiled here, once; a request only clears the
    local table (``local_slots`` × 32 bytes) and, for long requests, grows it.

    ``asker`` sends the daemon asks (``draft_async(context, max_len, budget_us)`` returning a
    handle with ``done()``, ``poll(handle, timeout_s)``, ``available``): the link itself by
    default; a batch front end (``ngram_generator.batch``) passes one that sends the asks of all
    its rows in one message.  ``gate`` decides which short drafts ask (:class:`AskGate`; its
    own by default, one ``config.ask_backoff`` allows).
    """

    def __init__(self, config: DraftConfig = DraftConfig(), link: DaemonLink | None = None,
                 asker=None, gate: AskGate | None = None):
        super().__init__()
        self.config = config
        self.link = link
        self.asker = asker if asker is not None else link
        self.gate = gate if gate is not None else AskGate(config.ask_backoff)
        c, r = config, config.rules
        self._local = np.zeros((c.local_slots, SLOT_WORDS), np.uint32)
        # request-local table first, then the hot and recent tiers the link maps
        self.tiers = DraftTiers(LOCAL_FIRST, self._local, c.max_probe)
        self._added = 0  # context tokens already in the local table
        self._pending = None  # (future, context length it was asked for)
        self.dropped = 0  # counter: local keys that found no slot within max_probe
        # counters: daemon asks, answers that came back in time, answers used
        self.asked = self.answered = self.used = 0
        self._last = EMPTY_DRAFT  # the draft last returned, and the context length it follows
        self._last_at = 0
        self._keys: list[np.ndarray] = []
        self._key_buf = np.zeros(r.max_draft_len, np.uint64)
        self._warm()

    def _warm(self) -> None:
        """Compile (or load from numba's cache) the kernels now, not in the first request."""
        self.start(np.arange(4, dtype=np.uint32))
        self.draft(1)
        self.finish()

    def _capacity_for(self, tokens: int) -> int:
        """Slots for a request of ``tokens`` tokens: load factor <= 1/2 keeps linear probes
        short.  The table stops growing at MAX_LOCAL_SLOTS; past that a key that finds no slot
        within ``max_probe`` is dropped (counted in ``dropped``)."""
        c, r = self.config, self.config.rules
        keys = (r.n_max - r.n_min + 1) * tokens
        return min(max(c.local_slots, 1 << int(2 * keys - 1).bit_length()), MAX_LOCAL_SLOTS)

    def start(self, prompt, expected_new: int = 0) -> None:
        """Begin a request; ``expected_new`` (tokens) sizes the local table (it grows when the
        request outgrows it)."""
        cap = self._capacity_for(len(prompt) + expected_new)
        if cap > self._local.shape[0]:
            self._local = np.zeros((cap, SLOT_WORDS), np.uint32)
            self.tiers.set_first(self._local)
        else:
            self._local[:] = 0
        self._added = 0
        self._pending = None
        self._keys = []
        self._last = EMPTY_DRAFT
        super().start(prompt)

    def extend(self, tokens) -> None:
        super().extend(tokens)
        c = self.config
        cap = self._capacity_for(self._n)
        if cap > self._local.shape[0]:  # outgrown (an engine gives no expected length): rebuild
            self._local = np.zeros((cap, SLOT_WORDS), np.uint32)
            self.tiers.set_first(self._local)
            self._added = 0
        self.dropped += local_add(self._local, c.max_probe, self._ctx, self._added,
                                  self._n, c.rules.n_min, c.rules.n_max)
        self._added = self._n

    def draft(self, max_len: int) -> Draft:
        max_len = min(max_len, self.config.rules.max_draft_len)
        if max_len <= 0:
            return EMPTY_DRAFT
        self.tiers.share(shared_tiers(self.link))
        d = self.tiers.draft(self._ctx, self._n, max_len, self.config.rules)
        return self.drafted(d.copy() if len(d) else EMPTY_DRAFT, max_len)

    def drafted(self, d: Draft, max_len: int) -> Draft:
        """What ``draft(max_len)`` returns once the tables drafted ``d`` (a draft this drafter
        may keep) for its context: the better of it and the daemon's answer, the daemon asked
        again when it is short (``draft_rows`` calls it for each row of a batch)."""
        if self.asker is not None:
            d = self._with_daemon(d, max_len)
        self._last, self._last_at = d, self._n
        return d

    def _with_daemon(self, d: Draft, max_len: int) -> Draft:
        """The better of ``d`` and the daemon's answer to the last ask; then ask again when
        ``d`` is short.  Never waits (unless ``remote_wait_ms`` on a total miss)."""
        link, c = self.asker, self.config
        best = d
        if self._pending is not None:
            fut, base = self._pending
            got = link.poll(fut, 0.0)
            if got is not None or fut.done():
                self._pending = None
            if got is not None:
                self.answered += 1
                r = self._align(got, base, max_len)
                better = r is not None and _better(r, d)
                self.gate.answered(better)
                if better:
                    self.used += 1
                    best = r
        short = len(d) < max_len or int(d.orders[0]) < c.ask_below_order
        wait = not len(best) and c.remote_wait_ms > 0  # asked for: not gated
        if (short and self._pending is None and link.available
                and (wait or self.gate.want())):
            fut = link.draft_async(self.context[-MAX_ORDER:], c.rules.max_draft_len,
                                   budget_us=c.remote_budget_ms * 1e3)
            if fut is not None:
                self.asked += 1
                self._pending = (fut, self._n)
                if not len(best) and c.remote_wait_ms > 0:
                    got = link.poll(fut, c.remote_wait_ms / 1e3)
                    if got is not None:
                        self._pending = None
                        self.answered += 1
                        r = self._align(got, self._n, max_len)
                        if r is not None and len(r):
                            self.used += 1
                            best = r
        return best

    def accepted(self, draft: Draft, n: int) -> None:
        """Remember the keys of the accepted tokens that came from the hot tier."""
        if draft is not self._last or n <= 0:
            return
        is_hot = draft.tiers[:n] == kernels.TIER_HOT
        if not is_hot.any():
            return
        hot = np.flatnonzero(is_hot)
        ctx = self._ctx[:self._last_at]
        m = draft_keys(ctx, np.array([0, ctx.shape[0]], np.int64),
                       draft.tokens[None, :n].astype(np.uint32),
                       draft.orders[None, :n].astype(np.uint8),
                       np.array([n], np.int32), self.config.rules.n_max, self._key_buf)
        self._keys.append(self._key_buf[:m][hot].copy())

    def used_keys(self) -> np.ndarray:
        return np.concatenate(self._keys) if self._keys else np.zeros(0, np.uint64)

    def _align(self, got: Draft, base: int, max_len: int) -> Draft | None:
        """The part of the daemon's draft ``got`` (asked after ``base`` context tokens) that
        follows the tokens emitted since, or None when they differ."""
        tokens = got.tokens
        since = self._ctx[base:self._n]
        m = since.shape[0]
        if tokens.shape[0] <= m or not np.array_equal(tokens[:m], since):
            return None
        end = min(tokens.shape[0], m + max_len)
        return Draft(tokens[m:end], got.orders[m:end], got.tiers[m:end], got.conf[m:end])

    def finish(self) -> None:
        self._pending = None
        if self.asked:
            log.debug("daemon asks: %d, answered in time: %d, used: %d", self.asked,
                      self.answered, self.used)
        if self.dropped:
            log.debug("request-local table: %d keys found no slot so far", self.dropped)


def shared_tiers(link) -> SharedTiers:
    """The hot and recent tiers ``link`` maps now (``HotReader.tiers``); ``NO_SHARED`` when
    it maps none (no daemon, or not yet)."""
    hot = link.hot_table() if link is not None else None
    return hot.tiers if hot is not None else NO_SHARED


def draft_rows(drafters: Sequence[NgramDrafter], limits: Sequence[int], tiers: DraftTiers,
               link=None) -> list[Draft]:
    """``drafters[i].draft(limits[i])`` for every ``i`` in one kernel call (an engine step's
    rows, ``DraftTiers.draft_rows``): each request's own table first, then the tiers ``link``
    maps (a single row: the drafter's own ``draft``).  The same drafts, daemon asks included,
    as each drafter's ``draft``.  The drafters share one ``DraftConfig``, whose ``max_probe``
    ``tiers`` was made with."""
    out = [EMPTY_DRAFT] * len(drafters)
    rows, firsts, contexts, lengths, lim = [], [], [], [], []
    for i, (d, k) in enumerate(zip(drafters, limits)):
        k = min(k, d.config.rules.max_draft_len)
        if k > 0:
            rows.append(i)
            firsts.append(d.tiers.first)
            contexts.append(d.context)
            lengths.append(d.length)
            lim.append(k)
    if len(rows) <= 1:  # a batch of one: the drafter's own fast call costs less
        for i in rows:
            out[i] = drafters[i].draft(limits[i])
        return out
    tiers.share(shared_tiers(link))
    got = tiers.draft_rows(firsts, contexts, lengths, lim, drafters[rows[0]].config.rules)
    # copies the drafters may keep: one per array for the whole batch, a view a row
    width = max(lim)
    tok, order, tier, conf = (a[:, :width].copy() for a in (got.tokens, got.orders, got.tiers,
                                                             got.conf))
    for j, n in enumerate(got.lengths.tolist()):
        d = Draft(tok[j, :n], order[j, :n], tier[j, :n], conf[j, :n]) if n else EMPTY_DRAFT
        out[rows[j]] = drafters[rows[j]].drafted(d, lim[j])
    return out


def _better(r: Draft, d: Draft) -> bool:
    """Whether the daemon's draft ``r`` beats the in-process ``d``: more tokens, or as many
    from a longer first match."""
    if not len(r):
        return False
    if not len(d):
        return True
    if len(r) != len(d):
        return len(r) > len(d)
    return int(r.orders[0]) > int(d.orders[0])
