"""Drafting for an engine's batch: rows of token ids, no request ids (vLLM's proposer).

An engine such as vLLM keeps its running requests as rows of one token array and hands the
proposer, once per step, each row's tokens so far and what it sampled this step, but no request
ids: rows are reused as requests finish and arrive, and moved when the batch is compacted.
:class:`BatchDrafter` turns that into the request life that :class:`~.drafting.NgramDrafter`
follows (``start``, ``extend``, ``draft``, ``accepted``, ``finish``), one drafter per request, so
the engine drafts exactly as ``ngram-generate`` does: the request-local table, the hot and
recent tiers in shared memory, asynchronous daemon asks (sent for the whole batch in one
message), and feedback of every finished request, once.

**Knowing the request of a row.**  A request is recognised by its content: a row continues a
request when it holds at least the request's tokens and its first and last ``check_tokens``
known tokens are the request's (``_continues``).  A row is first checked against the request it
held at the last step; rows that match nothing are looked up among the requests that left their
rows (moved) and those that left the batch (parked: an engine drops a request from its batch
while it is preempted or not scheduled for a step).  A row that continues none is a new request.

**Finished requests.**  A request missing from the batch for ``park_s`` is finished (done,
aborted or preempted for long): its tokens are fed back (the output, and the prompt when the
table's ``learn_prompts`` says so) with its per-order acceptance, and its drafter is reused.
Its head and tail are remembered (the last ``remember``), so a request that comes back after
that (a resumed preemption, or the next turn of a chat, whose prompt holds this request) feeds
back only what is new: nothing is counted twice.  n-grams across such a cut are not counted.

Two requests with the same tokens are interchangeable: which drafter serves which row does not
change a draft, and each is fed back once.
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

from .drafting import EMPTY_DRAFT, Draft, DraftConfig, NgramDrafter, draft_rows
from .policy import DraftLengthPolicy, DraftScorer, StepCost
from .remote import DaemonLink

log = logging.getLogger(__name__)

_ORDERS = MAX_ORDER + 1
_TIERS = len(TIER_NAMES)


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


class _Request:
    """One request of the batch: its drafter (which holds its tokens) and its accounting."""

    __slots__ = ("drafter", "scorer", "n", "head", "tail", "prompt_len", "skip", "last",
                 "drafted", "accepted", "parked_at")

    def __init__(self, drafter: NgramDrafter, scorer: DraftScorer, n: int, head: bytes,
                 prompt_len: int, skip: int):
        self.drafter, self.scorer, self.n, self.head = drafter, scorer, n, head
        self.tail = b""
        self.prompt_len, self.skip = prompt_len, skip
        self.last: Draft = EMPTY_DRAFT  # the draft proposed at the last step
        self.drafted = np.zeros(_ORDERS, np.int64)  # tokens drafted (accepted) per order
        self.accepted = np.zeros(_ORDERS, np.int64)
        self.parked_at = 0.0


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
    rows: int = 0  # rows drafted for (a row with sampled tokens)
    started: int = 0
    finished: int = 0
    resumed: int = 0  # rows recognised as a request that had left the batch
    continued: int = 0  # new requests that continue a finished one (fed back from the cut)
    moved: int = 0  # rows recognised as a request that held another row
    asks_sent: int = 0
    drafted_by_tier: np.ndarray = field(default_factory=lambda: np.zeros(_TIERS, np.int64))
    accepted_by_tier: np.ndarray = field(default_factory=lambda: np.zeros(_TIERS, np.int64))
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
            "steps": self.steps, "rows": self.rows, "started": self.started,
            "finished": self.finished, "resumed": self.resumed, "continued": self.continued,
            "moved": self.moved, "asks_sent": self.asks_sent,
            "drafted_tokens": drafted, "accepted_tokens": accepted,
            "acceptance": accepted / drafted if drafted else 0.0,
            "drafted_by_tier": _named(self.drafted_by_tier),
            "accepted_by_tier": _named(self.accepted_by_tier),
            "propose_ms_p50": float(np.median(times)) if times.size else 0.0,
            "propose_ms_p99": float(np.percentile(times, 99)) if times.size else 0.0,
            "propose_ms_p50_by_batch": {b: round(float(np.median(q)) * 1e3, 4)
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
    ``max_len`` the draft limit (one for every row, or a sequence).  It returns one draft (a list
    of token ids below ``vocab_size``) per row, cut by ``policy`` (``settings.full_drafts``:
    not cut).  ``cost`` is the policy's step-cost prior (``StepCost.for_device``; a CPU's by
    default).  ``clock`` is injectable for tests.
    """

    def __init__(self, config: DraftConfig, link: DaemonLink | None, *, vocab_size: int,
                 settings: BatchSettings = BatchSettings(), learn_prompts: bool | None = None,
                 cost: StepCost | None = None, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.link = link
        self.vocab_size = int(vocab_size)
        self.settings = settings
        self._learn_prompts = learn_prompts  # None: as the table says (link.learn_prompts)
        self.clock = clock
        self.asks = BatchAsks(link)
        self.stats = BatchStats()
        self.policy = DraftLengthPolicy(cost)  # acceptance learned, step cost measured
        # every row's draft in one kernel call: its request's table first, then hot and recent;
        # compiled (or loaded from numba's cache) now, with its typed list, not in a step
        self._tiers = DraftTiers(LOCAL_FIRST, None, config.max_probe)
        warm = NgramDrafter(config)
        warm.start(np.arange(4, dtype=np.uint32))
        draft_rows([warm, warm], [1, 1], self._tiers)  # two rows: one would take draft()
        self._step_end: float | None = None  # when our last step returned (self.clock)
        self._step_tokens = 0  # tokens the engine verifies in the step after it
        self._stable = False  # this step's rows hold the last step's requests, row for row
        self._idle: list[NgramDrafter] = []
        self._rows: list[_Request | None] = []  # the request of each row at the last step
        self._parked: dict[int, _Request] = {}  # id -> request missing from the batch (by age)
        # finished requests: head -> {tokens: tail}, and the order they finished in (eviction)
        self._done: dict[bytes, dict[int, bytes]] = {}
        self._done_order: collections.deque = collections.deque()
        self._done_lengths: collections.Counter = collections.Counter()  # head length -> heads

    def report(self) -> dict:
        """The batch's figures (``BatchStats.to_dict``) and the draft-length policy's
        (``DraftLengthPolicy.report``, under ``policy``)."""
        return {**self.stats.to_dict(), "full_drafts": self.settings.full_drafts,
                "policy": self.policy.report()}

    @property
    def active(self) -> int:
        """Requests in the batch or parked (not yet finished)."""
        return sum(r is not None for r in self._rows) + len(self._parked)

    # -- one engine step -----------------------------------------------------------------------
    def step(self, sampled: Sequence[Sequence[int]], num_tokens, token_ids,
             max_len: int | Sequence[int]) -> list[list[int]]:
        t0 = time.perf_counter()
        if self.link is not None:
            self.link.refresh()  # remap a newly published hot generation (a load, mostly)
        rows = self._assign(sampled, num_tokens, token_ids)
        self._observe_step(self.clock(), sampled)
        drafts = self._draft_rows(rows, sampled, num_tokens, token_ids, max_len)
        for req, d in zip(rows, drafts):
            if req is not None and len(d):  # every position scored, verified or not
                req.scorer.drafted(d, req.n)
        if not self.settings.full_drafts:
            drafts = [d.truncate(k) if k < len(d) else d
                      for d, k in zip(drafts, self.policy.choose_batch(drafts))]
        for req, d in zip(rows, drafts):
            if req is not None:
                req.last = d
        self._step_tokens = len(rows) + sum(len(d) for d in drafts)
        self.stats.asks_sent += self.asks.send()
        self._finish_parked(self.clock())
        self.stats.steps += 1
        self._step_end = self.clock()
        self.stats.timed(len(rows), time.perf_counter() - t0)
        return [d.tokens.tolist() for d in drafts]

    def _observe_step(self, now: float, sampled) -> None:
        """The engine's step since our last call: its seconds for the tokens it verified (one
        per row plus our drafts), when the batch held the same requests, all decoding (a
        prefill in between would add tokens we do not see)."""
        if self._step_end is not None and self._stable and all(len(s) for s in sampled):
            self.policy.timed(self._step_tokens, now - self._step_end)

    def _draft_rows(self, rows, sampled, num_tokens, token_ids, max_len) -> list[Draft]:
        """Each row's draft, all in one kernel call (``drafting.draft_rows``), once every row's
        drafter has the tokens the engine emitted; a row without a request or still in
        prefill (nothing sampled) gets none."""
        drafts: list[Draft] = [EMPTY_DRAFT] * len(rows)
        live, limits = [], []
        for i, req in enumerate(rows):
            if req is None or not len(sampled[i]):
                continue
            self._catch_up(req, sampled[i], int(num_tokens[i]), token_ids[i])
            live.append(i)
            limits.append(max_len if isinstance(max_len, int) else int(max_len[i]))
        got = draft_rows([rows[i].drafter for i in live], limits, self._tiers, self.link)
        for i, d in zip(live, got):
            if len(d) and int(d.tokens.max()) >= self.vocab_size:  # a table of another vocabulary
                d = d.truncate(int(np.flatnonzero(d.tokens >= self.vocab_size)[0]))
            drafts[i] = d
        return drafts

    def _catch_up(self, req: _Request, sampled, n: int, row: np.ndarray) -> None:
        """Score the last draft of ``req`` and give its drafter the tokens emitted since."""
        self._verified(req, sampled)
        if n > req.n:
            req.scorer.emitted(row[req.n:n], req.n)
            req.drafter.extend(np.asarray(row[req.n:n], np.uint32))
            req.n = n
            req.tail = _tail(row, n, self.settings.check_tokens)
        self.stats.rows += 1

    def _verified(self, req: _Request, sampled) -> None:
        """Acceptance of the draft proposed for ``req`` at the last step: the engine sampled the
        accepted draft tokens, then one of its own."""
        d = req.last
        if not len(d):
            return
        n, drafted = 0, d.tokens.tolist()
        for got, want in zip(sampled[:len(sampled) - 1], drafted):  # <= k tokens: a plain loop
            if int(got) != want:
                break
            n += 1
        req.drafter.accepted(d, n)
        self.policy.verified(d, n)
        req.drafted += np.bincount(d.orders, minlength=_ORDERS)
        req.accepted += np.bincount(d.orders[:n], minlength=_ORDERS)
        s = self.stats
        s.drafted_by_tier += np.bincount(d.tiers, minlength=_TIERS)
        s.accepted_by_tier += np.bincount(d.tiers[:n], minlength=_TIERS)
        req.last = EMPTY_DRAFT

    # -- which request each row holds ------------------------------------------------------------
    def _assign(self, sampled, num_tokens, token_ids) -> list[_Request | None]:
        batch = len(sampled)
        prev = self._rows
        rows: list[_Request | None] = [None] * batch
        taken: set[int] = set()
        for i in range(min(batch, len(prev))):  # most rows hold what they held
            req = prev[i]
            if req is not None and self._continues(req, token_ids[i], int(num_tokens[i])):
                rows[i] = req
                taken.add(id(req))
        left = [r for r in prev if r is not None and id(r) not in taken]
        self._stable = batch == len(prev) and not left and all(r is not None for r in rows)
        if any(rows[i] is None for i in range(batch)):
            by_head: dict[bytes, list] = collections.defaultdict(list)
            for r in left + list(self._parked.values()):
                by_head[r.head].append(r)
            for i in range(batch):
                if rows[i] is None:
                    rows[i] = self._recognise(i, sampled, num_tokens, token_ids, by_head, taken)
        now = self.clock()
        for r in left:
            if id(r) not in taken:
                r.parked_at = now
                self._parked[id(r)] = r
        self._rows = rows
        return rows

    def _recognise(self, i, sampled, num_tokens, token_ids, by_head, taken) -> _Request | None:
        """The request row ``i`` holds: one that left its row or the batch, or a new one (a row
        still in prefill, with nothing sampled, is left alone until it samples)."""
        n, row = int(num_tokens[i]), token_ids[i]
        head = _head(row, n, self.settings.check_tokens)
        for r in _candidates(by_head, row, n):
            if id(r) not in taken and self._continues(r, row, n):
                taken.add(id(r))
                if self._parked.pop(id(r), None) is not None:
                    self.stats.resumed += 1
                else:
                    self.stats.moved += 1
                return r
        if not len(sampled[i]):
            return None
        return self._start(row, n, head, prompt_len=n - len(sampled[i]))

    def _continues(self, req: _Request, row: np.ndarray, n: int) -> bool:
        """Whether ``row`` (``n`` tokens) holds ``req``'s tokens and maybe more."""
        if n < req.n:
            return False
        k = self.settings.check_tokens
        return (_head(row, len(req.head) // 4, k) == req.head
                and (req.n <= k or _tail(row, req.n, k) == req.tail))

    def _start(self, row: np.ndarray, n: int, head: bytes, prompt_len: int) -> _Request:
        skip = self._done_prefix(row, n, head)
        if skip:
            self.stats.continued += 1
        drafter = self._idle.pop() if self._idle else NgramDrafter(self.config, self.link,
                                                                  asker=self.asks)
        drafter.start(np.asarray(row[:n], np.uint32))
        req = _Request(drafter, self.policy.scorer(), n, head, prompt_len, skip)
        req.tail = _tail(row, n, self.settings.check_tokens)
        self.stats.started += 1
        return req

    # -- finished requests -----------------------------------------------------------------------
    def _finish_parked(self, now: float) -> None:
        s = self.settings
        while self._parked:
            first = next(iter(self._parked.values()))  # the oldest: dicts keep insertion order
            if now - first.parked_at < s.park_s and len(self._parked) <= s.max_parked:
                break
            del self._parked[id(first)]
            self._finish(first)

    def idle(self) -> None:
        """No step for a while (the engine ran out of requests, whose last rows are still
        here): every row has left the batch; finish those parked ``park_s`` ago.  Call it from
        a timer, never during a step.  A request that was only slow (a long prefill) and does
        step again later is recognised as continuing what was fed back, so nothing is counted
        twice."""
        now = self.clock()
        for req in self._rows:
            if req is not None:
                req.parked_at = now
                self._parked[id(req)] = req
        self._rows = []
        self._finish_parked(now)

    def finish_all(self) -> None:
        """Feed back every request, running or parked (engine shutdown)."""
        for req in [r for r in self._rows if r is not None] + list(self._parked.values()):
            self._finish(req)
        self._rows, self._parked = [], {}

    def _finish(self, req: _Request) -> None:
        d = req.drafter
        self.stats.finished += 1
        learn = (self._learn_prompts if self._learn_prompts is not None
                 else self.link is not None and self.link.learn_prompts)
        start = max(req.skip, 0 if learn else req.prompt_len)
        if self.link is not None and self.link.state not in ("off", "refused"):
            seq = d.context[start:req.n].copy()  # the drafter (and its buffer) is reused
            self.link.feedback([seq], _counts(req.drafted), _counts(req.accepted),
                               keys=d.used_keys())
        if req.head not in self._done:
            self._done[req.head] = {}
            self._done_lengths[len(req.head) // 4] += 1
        self._done[req.head][req.n] = _tail(d.context, req.n, self.settings.check_tokens)
        self._done_order.append((req.head, req.n))
        while len(self._done_order) > self.settings.remember:
            h, m = self._done_order.popleft()
            ends = self._done.get(h, {})
            ends.pop(m, None)
            if not ends and h in self._done:
                del self._done[h]
                self._done_lengths[len(h) // 4] -= 1
        d.finish()
        req.scorer.clear()
        if len(self._idle) < self.settings.idle_drafters:
            self._idle.append(d)

    def _done_prefix(self, row: np.ndarray, n: int, head: bytes) -> int:
        """Tokens of ``row`` that a finished request already fed back (0: none)."""
        k = self.settings.check_tokens
        best = 0
        lengths = [m for m, count in self._done_lengths.items() if count]
        for ends in _candidates(self._done, row, n, lengths, many=False):
            for m, tail in ends.items():
                if best < m <= n and (m <= k or _tail(row, m, k) == tail):
                    best = m
        return best


def _candidates(by_head: dict, row: np.ndarray, n: int, lengths=None, many: bool = True):
    """The values of ``by_head`` whose head key ``row`` starts with: heads are the first
    ``check_tokens`` tokens, or all of a request shorter than that when it started
    (``lengths``: the head lengths in ``by_head``, if known)."""
    if lengths is None:
        lengths = {len(h) // 4 for h in by_head}
    for length in sorted(lengths, reverse=True):
        if length <= n:
            got = by_head.get(np.asarray(row[:length]).astype(np.uint32, copy=False).tobytes())
            if got is not None:
                yield from got if many else (got,)


def _head(row: np.ndarray, n: int, k: int) -> bytes:
    return np.asarray(row[:min(n, k)]).astype(np.uint32, copy=False).tobytes()


def _tail(row: np.ndarray, n: int, k: int) -> bytes:
    return np.asarray(row[max(n - k, 0):n]).astype(np.uint32, copy=False).tobytes()
