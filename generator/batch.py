"""Drafting for an engine's batch: rows of token ids, no request ids (vLLM's proposer).

An engine such as vLLM keeps its running requests as rows of one token array and hands the
proposer, once per step, each row's tokens so far and what it sampled this step, but no request
ids: rows are reused as requests finish and arrive, and moved when the batch is compacted.
:class:`BatchDrafter` turns that into the request life that :class:`~.drafting.NgramDrafter`
follows (``start``, ``extend``, ``draft``, ``accepted``, ``finish``), one drafter per request, so
the engine drafts exactly as ``ngram-generate`` does: the request-local table, the hot and
recent tiers in shared memory, asynchronous daemon asks (sent for the whole batch in one
message), and feedback of every finished request, once.

**Knowing the request of a row** is :class:`~.tracker.RequestTracker`'s: it says which request
each row holds (continuing, moved, back in the batch, or new) and when one has finished
(missing from the batch for ``park_s``: done, aborted or preempted for long).  A finished
request's tokens are fed back (the output, and the prompt when the table's ``learn_prompts``
says so) with its per-order acceptance, and its drafter is reused.  A request that continues a
finished one (a resumed preemption, or the next turn of a chat, whose prompt holds the finished
one) feeds back only what follows the tokens that one held (``skip``): nothing is counted twice.
n-grams across such a cut are not counted.  Two requests with the same tokens are
interchangeable: which drafter serves which row does not change a draft.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ngramd.drafttiers import LOCAL_FIRST, DraftTiers
from ngramd.wire.constants import MAX_ORDER, TIER_NAMES

from . import stepkernels
from .drafting import EMPTY_DRAFT, AskGate, Draft, DraftConfig, NgramDrafter, draft_rows
from .policy import DraftLengthPolicy, DraftScorer, RunClock, StepCost, sampling_band, step_kind
from .remote import DaemonLink
from .tracker import RequestTracker, Rows, TrackedRequest

log = logging.getLogger(__name__)

_ORDERS = MAX_ORDER + 1
_TIERS = len(TIER_NAMES)
_POSITIONS = 16  # positions counted one by one in the stats; later ones share the last


@dataclass(frozen=True)
class BatchSettings:
    """How rows are recognised and when a request counts as finished."""

    park_s: float = 2.0  # seconds a request may be missing from the batch before it is finished
    max_parked: int = 256  # requests missing from the batch at most (the oldest finish first)
    remember: int = 4096  # finished requests remembered, so a resumed one is not fed back twice
    check_tokens: int = 8  # tokens compared at the head and at the tail to recognise a row
    idle_drafters: int = 64  # drafters kept for reuse (each holds a local table of >= 2 MiB)
    # True: verify every draft in full; False: the draft tokens that pay for themselves by the
    # step cost measured here and the acceptance learned (DraftLengthPolicy.choose_batch)
    full_drafts: bool = False
    # a request left the batch and none came in this many steps after: the batch drains (no
    # one waits for its rows), and the rows that will end last are what the policy speeds up
    drain_after: int = 2
    # draining, a row this many output tokens ahead of the row with the fewest is worth 1/e
    drain_slack: float = 4.0


class _Request:
    """What the batch drafter keeps for one request (``TrackedRequest.data``): its drafter,
    which holds its ``n`` tokens, and the slot of its accounting (``_OrderCounts``)."""

    __slots__ = ("drafter", "scorer", "n", "last", "slot")

    def __init__(self, drafter: NgramDrafter, scorer: DraftScorer, n: int, slot: int):
        self.drafter, self.scorer, self.n, self.slot = drafter, scorer, n, slot
        self.last: Draft = EMPTY_DRAFT  # the draft proposed at the last step


class _OrderCounts:
    """Per request, the draft tokens verified and accepted per order (its feedback), as rows
    of one array (``counts[slot, 0 | 1, order]``), so a step counts all its rows in one call
    (``stepkernels.account``).  A request takes a slot when it starts and gives it back, with
    its counts, when it finishes."""

    def __init__(self, slots: int = 16):
        self.counts = np.zeros((slots, 2, _ORDERS), np.int64)
        self._free = list(range(slots - 1, -1, -1))

    def take(self) -> int:
        if not self._free:
            n = self.counts.shape[0]
            self.counts = np.concatenate([self.counts, np.zeros_like(self.counts)])
            self._free = list(range(2 * n - 1, n - 1, -1))
        return self._free.pop()

    def release(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """The request's (drafted, accepted) per order; the slot is free again."""
        drafted, accepted = self.counts[slot].copy()
        self.counts[slot] = 0
        self._free.append(slot)
        return drafted, accepted


class _Ask:
    """One row's daemon ask inside a batch message (``BatchAsks``)."""

    __slots__ = ("fut", "index", "failed")

    def __init__(self):
        self.fut, self.index, self.failed = None, 0, False

    def done(self) -> bool:
        return self.failed or (self.fut is not None and self.fut.done())


class BatchAsks:
    """The asker of a batch's drafters: collects their asks during a step and sends them as one
    ``draft`` message (:meth:`send`); the daemon drafts a batch in one kernel call."""

    def __init__(self, link: DaemonLink | None):
        self.link = link
        self._contexts: list[np.ndarray] = []
        self._asks: list[_Ask] = []
        self._max_len = 1
        self._budget_us: float | None = None

    @property
    def available(self) -> bool:
        return self.link is not None and self.link.available

    def draft_async(self, context: np.ndarray, max_len: int, budget_us: float | None = None):
        ask = _Ask()
        self._contexts.append(np.array(context, np.uint32))  # the row's buffer moves on
        self._asks.append(ask)
        self._max_len = max(self._max_len, int(max_len))
        self._budget_us = budget_us
        return ask

    def poll(self, ask: _Ask, timeout_s: float):
        if ask.fut is None:
            return None
        return self.link.poll(ask.fut, timeout_s, ask.index)

    def send(self) -> int:
        """Send the asks collected this step; returns how many."""
        asks, contexts = self._asks, self._contexts
        if not asks:
            return 0
        self._asks, self._contexts = [], []
        fut = self.link.draft_async(contexts, self._max_len, self._budget_us)
        for i, ask in enumerate(asks):
            ask.fut, ask.index, ask.failed = fut, i, fut is None
        self._max_len = 1
        return len(asks)


@dataclass
class BatchStats:
    """What the batch drafter did (``BatchDrafter.stats``); ``propose_s`` keeps the last 1024
    step times, ``by_batch`` the last 256 per batch size (up to 64 sizes)."""

    steps: int = 0
    draining_steps: int = 0  # steps decided while the batch drained (``BatchSettings``)
    rows: int = 0  # rows drafted for (a row with sampled tokens)
    asks_sent: int = 0
    drafted_by_tier: np.ndarray = field(default_factory=lambda: np.zeros(_TIERS, np.int64))
    accepted_by_tier: np.ndarray = field(default_factory=lambda: np.zeros(_TIERS, np.int64))
    # verified draft tokens at each position (0 = the first after the row's last token; the
    # last counts every later one) and those of them accepted: counters, never decayed
    verified_by_position: np.ndarray = field(
        default_factory=lambda: np.zeros(_POSITIONS, np.int64))
    accepted_by_position: np.ndarray = field(
        default_factory=lambda: np.zeros(_POSITIONS, np.int64))
    propose_s: collections.deque = field(default_factory=lambda: collections.deque(maxlen=1024))
    by_batch: dict = field(default_factory=dict)  # rows -> deque of step seconds

    def timed(self, rows: int, seconds: float) -> None:
        self.propose_s.append(seconds)
        q = self.by_batch.get(rows)
        if q is None and len(self.by_batch) < 64:
            q = self.by_batch[rows] = collections.deque(maxlen=256)
        if q is not None:
            q.append(seconds)

    def to_dict(self) -> dict:
        times = np.array(self.propose_s) * 1e3
        drafted = int(self.drafted_by_tier.sum())
        accepted = int(self.accepted_by_tier.sum())
        return {
            "steps": self.steps, "draining_steps": self.draining_steps, "rows": self.rows,
            "asks_sent": self.asks_sent,
            "drafted_tokens": drafted, "accepted_tokens": accepted,
            "acceptance": accepted / drafted if drafted else 0.0,
            "drafted_by_tier": _named(self.drafted_by_tier),
            "accepted_by_tier": _named(self.accepted_by_tier),
            "verified_by_position": self.verified_by_position.tolist(),
            "accepted_by_position": self.accepted_by_position.tolist(),
            "propose_ms_p50": float(np.median(times)) if times.size else 0.0,
            "propose_ms_p99": float(np.percentile(times, 99)) if times.size else 0.0,
            "propose_ms_p50_by_batch": {b: round(float(np.median(q)) * 1e3, 4)
                                        for b, q in sorted(self.by_batch.items())},
            # the mean too: a step that asks the daemon or starts a request costs several
            # times the median one, and those are a minority of the steps
            "propose_ms_mean_by_batch": {b: round(float(np.mean(q)) * 1e3, 4)
                                         for b, q in sorted(self.by_batch.items())},
        }


def _named(by_tier: np.ndarray) -> dict:
    return {TIER_NAMES[t]: int(n) for t, n in enumerate(by_tier) if n}


def _counts(by_order: np.ndarray) -> dict[int, int]:
    return {o: int(n) for o, n in enumerate(by_order) if n}


class BatchDrafter:
    """Drafts for every row of an engine's batch, one :class:`NgramDrafter` per request.

    ``step(sampled, num_tokens, token_ids, max_len)`` is one engine step: ``sampled[i]`` the
    tokens row ``i`` sampled this step (empty for a row still in prefill), ``num_tokens[i]``
    how many tokens row ``i`` holds now, ``token_ids[i]`` the row (at least that long), and
    ``max_len`` the draft limit (one for every row, or a sequence), and ``sampling`` what the
    engine samples with: ``(temperatures, filtered)``, each row's temperature (0: greedy) and
    whether any row asks for top-p or top-k (None: all greedy).  It returns one draft (a list
    of token ids below ``vocab_size``) per row, cut by ``policy`` (``settings.full_drafts``:
    not cut), each row priced by its request's sampling band and the step by its kind.  ``cost`` is the policy's step-cost prior (``StepCost.for_device``; a CPU's by
    default).  ``clock`` is injectable for tests; ``step_clock`` times the engine's steps for
    the cost model (default: ``RunClock``, wall time less this thread's wait for a CPU, or
    ``clock`` when a test injected one).
    """

    def __init__(self, config: DraftConfig, link: DaemonLink | None, *, vocab_size: int,
                 settings: BatchSettings = BatchSettings(), learn_prompts: bool | None = None,
                 cost: StepCost | None = None, clock: Callable[[], float] = time.monotonic,
                 step_clock: Callable[[], float] | None = None):
        self.config = config
        self.link = link
        self.vocab_size = int(vocab_size)
        self.settings = settings
        self._learn_prompts = learn_prompts  # None: as the table says (link.learn_prompts)
        self.clock = clock
        if step_clock is None:
            step_clock = RunClock() if clock is time.monotonic else clock
        self.step_clock = step_clock
        self.asks = BatchAsks(link)
        self.gate = AskGate(config.ask_backoff)  # the rows' asks back off together
        self.stats = BatchStats()
        self.policy = DraftLengthPolicy(cost)  # acceptance learned, step cost measured
        # every row's draft in one kernel call: its request's table first, then hot and recent;
        # compiled (or loaded from numba's cache) now, with its typed list, not in a step
        self._tiers = DraftTiers(LOCAL_FIRST, None, config.max_probe)
        warm = NgramDrafter(config)
        warm.start(np.arange(4, dtype=np.uint32))
        draft_rows([warm, warm], [1, 1], self._tiers)  # two rows: one would take draft()
        self._step_end: float | None = None  # when our last step returned (step_clock)
        self._step_tokens = 0  # tokens the engine verifies in the step after it, over
        self._step_rows = 0  # this many rows
        self._beside = 0  # tokens of a prefill the next step likely carries (_observe_step)
        self._step_kind = 0  # the kind (policy.STEP_KINDS) of the step after our last return
        self._live = 0  # requests in the batch at the last step
        self._left_at: int | None = None  # the step a request left, none coming in since
        self._idle: list[NgramDrafter] = []
        self._by_order = _OrderCounts()
        self.tracker = RequestTracker(check_tokens=settings.check_tokens, park_s=settings.park_s,
                                      max_parked=settings.max_parked, remember=settings.remember,
                                      clock=clock)

    def report(self) -> dict:
        """The batch's figures (``BatchStats.to_dict``), the requests'
        (``TrackerCounts.to_dict``), the daemon asks' back-off (``AskGate``: short drafts that
        did not ask, and the interval now) and the draft-length policy's
        (``DraftLengthPolicy.report``, under ``policy``)."""
        return {**self.stats.to_dict(), **self.tracker.counts.to_dict(),
                "asks_not_sent": self.gate.skipped, "ask_interval": self.gate.interval,
                "full_drafts": self.settings.full_drafts, "policy": self.policy.report()}

    @property
    def active(self) -> int:
        """Requests in the batch or parked (not yet finished)."""
        return self.tracker.active

    # -- one engine step -----------------------------------------------------------------------
    def step(self, sampled: Sequence[Sequence[int]], num_tokens, token_ids,
             max_len: int | Sequence[int], sampling=None) -> list[list[int]]:
        t0 = time.perf_counter()
        if self.link is not None:
            self.link.refresh()  # remap a newly published hot generation (a load, mostly)
        seen = self.tracker.step(sampled, num_tokens, token_ids)
        temps = sampling[0] if sampling is not None else ()
        rows = self._requests(seen, token_ids, temps)
        kind = step_kind(temps[:len(rows)], bool(sampling[1])) if sampling is not None else 0
        weights = self._drain_weights(seen)
        self._observe_step(self.step_clock(), sampled, seen.stable)
        # the policy's back-off: no draft (nor ask, nor decision) on most steps while it keeps
        # choosing plain; the rows' drafters still take the tokens emitted
        skip = not self.settings.full_drafts and self.policy.skip_step()
        drafts = self._draft_rows(rows, sampled, num_tokens, token_ids, max_len, skip)
        for req, d in zip(rows, drafts):
            if req is not None and len(d):  # every position scored, verified or not
                req.scorer.drafted(d, req.n)
        if not self.settings.full_drafts and not skip:
            history = [0 if req is None else req.scorer.history for req in rows]
            bands = [0 if req is None else req.scorer.band for req in rows]
            counts = self.policy.choose_batch(drafts, history, beside=self._beside, bands=bands,
                                              kind=kind, weights=weights)
            drafts = [d.truncate(k) if k < len(d) else d for d, k in zip(drafts, counts)]
            self.stats.draining_steps += weights is not None
        for req, d in zip(rows, drafts):
            if req is not None:
                req.last = d
        self._step_rows = len(rows)
        self._step_tokens = len(rows) + sum(len(d) for d in drafts)
        self._step_kind = kind
        self.stats.asks_sent += self.asks.send()
        for req in self.tracker.finished():
            self._finish(req)
        self.stats.steps += 1
        self._step_end = self.step_clock()
        self.stats.timed(len(rows), time.perf_counter() - t0)
        return [d.tokens.tolist() for d in drafts]

    def _observe_step(self, now: float, sampled, stable: bool) -> None:
        """The engine's step since our last call: its seconds for the tokens it verified (one
        per row plus our drafts), when the batch held the same requests (``stable``), all
        decoding (a prefill in between would add tokens we do not see).

        When a row is still in its prefill (it sampled nothing: its prompt is being computed
        a chunk a step), the next step will likely carry another chunk beside the decoding
        rows, as this one did: the tokens this step's seconds stand for beyond ours (by the
        cost curve, ``StepCost.beside``) price the next step's drafts.  A draft token costs
        the same in a step of thousands of prefill tokens, but the step it lengthens is
        long: full drafts pay there where a pure decode step would verify a few tokens a row
        (bench/RESULTS.md, "drafts beside a prefill")."""
        self._beside = 0
        if self._step_end is None:
            return
        seconds = now - self._step_end
        if stable and all(len(s) for s in sampled):
            self.policy.timed(self._step_tokens, seconds, self._step_rows, self._step_kind)
        elif any(not len(s) for s in sampled):
            self._beside = self.policy.cost_of(self._step_kind).beside(self._step_tokens,
                                                                        seconds)

    def _drain_weights(self, seen: Rows) -> list[float] | None:
        """What a token of each row is worth while the batch drains, else None (every token
        alike).  A batch drains when a request left it and none came in for
        ``drain_after`` steps (a row in prefill is one coming in): nobody waits for a row that
        ends early, and the batch lasts as long as its longest row.  With one ``max_tokens``
        for all, the rows with the fewest output tokens end last: a row ``drain_slack``
        tokens ahead of them is worth 1/e of a token of theirs (a row ahead by more is barely
        worth a draft)."""
        live = sum(t is not None for t in seen.requests)
        arrived = bool(seen.started) or live < len(seen.requests)
        left = self._live + len(seen.started) > live
        self._live = live
        if arrived:
            self._left_at = None
        elif left and self._left_at is None:
            self._left_at = self.stats.steps
        if (self._left_at is None or live < 2
                or self.stats.steps - self._left_at < self.settings.drain_after):
            return None
        out = np.array([t.n - t.prompt_len if t is not None else 0 for t in seen.requests],
                       np.float64)
        return np.exp(-(out - out.min()) / self.settings.drain_slack).tolist()

    def _draft_rows(self, rows, sampled, num_tokens, token_ids, max_len,
                    skip: bool = False) -> list[Draft]:
        """Each row's draft, all in one kernel call (``drafting.draft_rows``), once every row's
        drafter has the tokens the engine emitted; a row without a request or still in
        prefill (nothing sampled) gets none, and every row when ``skip``."""
        drafts: list[Draft] = [EMPTY_DRAFT] * len(rows)
        live, limits, verified = [], [], []
        for i, req in enumerate(rows):
            if req is None or not len(sampled[i]):
                continue
            self._catch_up(req, sampled[i], int(num_tokens[i]), token_ids[i], verified)
            live.append(i)
            limits.append(max_len if isinstance(max_len, int) else int(max_len[i]))
        self._account(verified)
        if skip:
            return drafts
        got = draft_rows([rows[i].drafter for i in live], limits, self._tiers, self.link)
        for i, d in zip(live, got):
            if len(d) and int(d.tokens.max()) >= self.vocab_size:  # a table of another vocabulary
                d = d.truncate(int(np.flatnonzero(d.tokens >= self.vocab_size)[0]))
            drafts[i] = d
        return drafts

    def _catch_up(self, req: _Request, sampled, n: int, row: np.ndarray,
                  verified: list) -> None:
        """Score the last draft of ``req`` (into ``verified``: ``(req, draft, accepted)``,
        counted for the whole step by ``_account``) and give its drafter the tokens emitted
        since."""
        d = req.last
        if len(d):  # the engine sampled the accepted draft tokens, then one of its own
            k = 0
            for got, want in zip(sampled[:len(sampled) - 1], d.tokens.tolist()):  # <= k tokens
                if int(got) != want:
                    break
                k += 1
            verified.append((req, d, k))
            req.last = EMPTY_DRAFT
        if n > req.n:
            req.scorer.emitted(row[req.n:n], req.n)
            req.drafter.extend(np.asarray(row[req.n:n], np.uint32))
            req.n = n
        self.stats.rows += 1

    def _account(self, verified: list) -> None:
        """The acceptance of the drafts the engine verified at its last step, ``(request,
        draft, tokens accepted)`` a row: per request and order (its feedback), per tier and
        position (stats) and for the policy's report, counted for all rows in one call."""
        if not verified:
            return
        for req, d, k in verified:
            if k:
                req.drafter.accepted(d, k)
        m, s, out = len(verified), self.stats, self.policy.out
        stepkernels.account(
            np.fromiter((len(d) for _, d, _ in verified), np.int64, m),
            np.fromiter((k for _, _, k in verified), np.int64, m),
            np.concatenate([d.orders for _, d, _ in verified], dtype=np.int64),
            np.concatenate([d.tiers for _, d, _ in verified], dtype=np.int64),
            np.fromiter((req.slot for req, _, _ in verified), np.int64, m),
            self._by_order.counts, s.drafted_by_tier, s.accepted_by_tier,
            s.verified_by_position, s.accepted_by_position, out.verified, out.accepted)

    # -- the requests of the rows (RequestTracker) --------------------------------------------
    def _requests(self, seen: Rows, token_ids, temps=()) -> list[_Request | None]:
        """The drafting state of each row's request; a drafter started for each new one (its
        sampling band from ``temps``, the rows' temperatures: greedy when not given)."""
        for i in seen.started:
            t = seen.requests[i]
            t.data = self._start(token_ids[i], t.n,
                                 sampling_band(float(temps[i])) if i < len(temps) else 0)
        return [t.data if t is not None else None for t in seen.requests]

    def _start(self, row: np.ndarray, n: int, band: int = 0) -> _Request:
        drafter = self._idle.pop() if self._idle else NgramDrafter(
            self.config, self.link, asker=self.asks, gate=self.gate)
        drafter.start(np.asarray(row[:n], np.uint32))
        return _Request(drafter, self.policy.scorer(band), n, self._by_order.take())

    def idle(self) -> None:
        """No step for a while (the engine ran out of requests, whose last rows are still
        here): feed back the requests parked ``park_s`` ago (``RequestTracker.idle``).  Call it
        from a timer, never during a step."""
        for req in self.tracker.idle():
            self._finish(req)

    def finish_all(self) -> None:
        """Feed back every request, running or parked (engine shutdown)."""
        for req in self.tracker.finish_all():
            self._finish(req)

    def _finish(self, t: TrackedRequest) -> None:
        """Feed back a finished request: from ``skip`` on (what a finished one it continues
        did not hold), its prompt only when the table learns prompts."""
        req = t.data
        d = req.drafter
        learn = (self._learn_prompts if self._learn_prompts is not None
                 else self.link is not None and self.link.learn_prompts)
        start = max(t.skip, 0 if learn else t.prompt_len)
        drafted, accepted = self._by_order.release(req.slot)
        if self.link is not None and self.link.state not in ("off", "refused"):
            seq = d.context[start:req.n].copy()  # the drafter (and its buffer) is reused
            self.link.feedback([seq], _counts(drafted), _counts(accepted),
                               keys=d.used_keys(), policy=self.policy.figures())
        d.finish()
        req.scorer.clear()
        if len(self._idle) < self.settings.idle_drafters:
            self._idle.append(d)
