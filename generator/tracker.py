"""Which request each row of an engine's batch holds, when the engine names none; and whether
the engine has gone idle.

vLLM's proposer hook (``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, ...)``)
hands over, once per step, every row of its input batch (the row's tokens so far and what it
sampled this step) but no request ids: rows are reused as requests finish and arrive, moved when
the batch is condensed (its last row into a hole), and left out of a step while a request is
preempted or not scheduled.  :class:`RequestTracker` turns rows back into requests and does
nothing else: per step, which request each row holds (the one it held, one that held another
row, one that had left the batch, or a new one), and later which requests have finished.  What
a caller keeps per request (``BatchDrafter``: a drafter and its accounting) hangs on
:attr:`TrackedRequest.data`; the tracker never looks at it.

**If vLLM's hook ever passes request ids** (its input batch has them, ``req_ids``), this module
shrinks to nothing: a dict from id to ``data``, an unknown id started, an id gone finished.
Everything below is recognising a request by its content because that id is missing.

**Knowing the request of a row.**  A row continues a request when it holds at least the
request's tokens and its first and last ``check_tokens`` known tokens are the request's
(``_continues``).  A row is first checked against the request it held at the last step; rows
that match nothing are looked up, by their first tokens, among the requests that left their rows
(moved) and those that left the batch (parked: an engine drops a request from its batch while it
is preempted or not scheduled for a step).  A row that continues none is a new request, once it
has sampled a token (a row still in prefill is left alone until then).  A request's known tokens
grow at the steps where its row samples.

**Finished requests.**  A request missing from the batch for ``park_s`` (or the oldest, past
``max_parked`` parked ones) is finished: :meth:`RequestTracker.finished` hands it out once.  Its
head and tail are remembered (the last ``remember``), so a request that comes back after that (a
resumed preemption, or the next turn of a chat, whose prompt holds the finished one) starts with
``skip``: the tokens the finished one already held, so that a caller feeding requests back
counts nothing twice.

Two requests with the same tokens are interchangeable: which of them a row is said to hold
changes nothing a caller does with the tokens, and each is finished once.

:class:`IdleWatch` is the other half of what vLLM does not say: it calls nothing once its last
request is done, so whether an engine is idle (and its remaining requests finished) is read from
the time since its last step and the CPU time of the thread that runs its steps.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, NamedTuple

import numpy as np


class TrackedRequest:
    """One request the tracker knows.  ``n``: its tokens known (the row's count at the last step
    its row sampled in); ``head`` and ``tail``: the first and the last ``check_tokens`` of them
    (uint32 bytes); ``prompt_len``: its tokens before the first one it sampled; ``skip``: its
    first tokens that a finished request held (0: none); ``data``: the caller's."""

    __slots__ = ("n", "head", "tail", "prompt_len", "skip", "parked_at", "data")

    def __init__(self, n: int, head: bytes, tail: bytes, prompt_len: int, skip: int):
        self.n, self.head, self.tail = n, head, tail
        self.prompt_len, self.skip = prompt_len, skip
        self.parked_at = 0.0  # when it left the batch (the tracker's clock)
        self.data = None


class Rows(NamedTuple):
    """What :meth:`RequestTracker.step` found.  ``requests[i]``: the request of row ``i`` (None:
    a row in prefill that is no request yet); ``started``: the rows whose request is new this
    step; ``stable``: the rows hold the last step's requests, row for row, and nothing else."""

    requests: list
    started: list
    stable: bool


@dataclass
class TrackerCounts:
    """What the tracker saw, in requests (``RequestTracker.counts``)."""

    started: int = 0
    finished: int = 0
    resumed: int = 0  # rows recognised as a request that had left the batch
    continued: int = 0  # new requests that continue a finished one (``skip`` > 0)
    moved: int = 0  # rows recognised as a request that held another row

    def to_dict(self) -> dict:
        return asdict(self)


class RequestTracker:
    """The request of each row of an engine's batch, from the rows' tokens (module doc).

    ``step(sampled, num_tokens, token_ids)`` once per engine step: ``sampled[i]`` the tokens row
    ``i`` sampled this step (empty for a row in prefill), ``num_tokens[i]`` how many tokens it
    holds now, ``token_ids[i]`` the row (at least that long).  ``finished()`` after it hands out
    the requests that have now been missing for ``park_s``; ``idle()`` and ``finish_all()`` end
    the batch's requests when the engine is idle or shuts down.  ``clock`` is injectable for
    tests."""

    def __init__(self, *, check_tokens: int = 8, park_s: float = 2.0, max_parked: int = 256,
                 remember: int = 4096, clock: Callable[[], float] = time.monotonic):
        self.check_tokens = int(check_tokens)
        self.park_s, self.max_parked, self.remember = park_s, int(max_parked), int(remember)
        self.clock = clock
        self.counts = TrackerCounts()
        self._rows: list[TrackedRequest | None] = []  # the request of each row at the last step
        self._parked: dict[int, TrackedRequest] = {}  # id -> request missing from the batch
        # finished requests: head -> {tokens: tail}, and the order they finished in (eviction)
        self._done: dict[bytes, dict[int, bytes]] = {}
        self._done_order: collections.deque = collections.deque()
        self._done_lengths: collections.Counter = collections.Counter()  # head length -> heads

    @property
    def active(self) -> int:
        """Requests in the batch or parked (not yet finished)."""
        return sum(r is not None for r in self._rows) + len(self._parked)

    # -- one engine step -----------------------------------------------------------------------
    def step(self, sampled, num_tokens, token_ids) -> Rows:
        """The request of each row this step (class doc)."""
        batch = len(sampled)
        prev = self._rows
        rows: list[TrackedRequest | None] = [None] * batch
        taken: set[int] = set()
        for i in range(min(batch, len(prev))):  # most rows hold what they held
            req, n = prev[i], int(num_tokens[i])
            if req is not None and self._continues(req, token_ids[i], n):
                rows[i] = req
                taken.add(id(req))
                self._grow(req, sampled[i], token_ids[i], n)
        left = [r for r in prev if r is not None and id(r) not in taken]
        stable = batch == len(prev) and not left and all(r is not None for r in rows)
        started: list[int] = []
        if any(r is None for r in rows):
            by_head: dict[bytes, list] = collections.defaultdict(list)
            for r in left + list(self._parked.values()):
                by_head[r.head].append(r)
            for i in range(batch):
                if rows[i] is None:
                    rows[i] = self._recognise(i, sampled, num_tokens, token_ids, by_head, taken)
                    if rows[i] is not None and id(rows[i]) not in taken:
                        started.append(i)
        now = self.clock()
        for r in left:
            if id(r) not in taken:
                r.parked_at = now
                self._parked[id(r)] = r
        self._rows = rows
        return Rows(rows, started, stable)

    def _recognise(self, i, sampled, num_tokens, token_ids, by_head, taken):
        """The request row ``i`` holds: one that left its row or the batch, or a new one (a row
        still in prefill, with nothing sampled, is left alone until it samples)."""
        n, row = int(num_tokens[i]), token_ids[i]
        for r in _candidates(by_head, row, n):
            if id(r) not in taken and self._continues(r, row, n):
                taken.add(id(r))
                if self._parked.pop(id(r), None) is not None:
                    self.counts.resumed += 1
                else:
                    self.counts.moved += 1
                self._grow(r, sampled[i], row, n)
                return r
        if not len(sampled[i]):
            return None
        return self._start(row, n, prompt_len=n - len(sampled[i]))

    def _continues(self, req: TrackedRequest, row: np.ndarray, n: int) -> bool:
        """Whether ``row`` (``n`` tokens) holds ``req``'s tokens and maybe more."""
        if n < req.n:
            return False
        k = self.check_tokens
        return (_head(row, len(req.head) // 4, k) == req.head
                and (req.n <= k or _tail(row, req.n, k) == req.tail))

    def _grow(self, req: TrackedRequest, sampled, row: np.ndarray, n: int) -> None:
        """``req``'s row holds ``n`` tokens: known once the row samples (a row in prefill may
        still be recomputing them)."""
        if n > req.n and len(sampled):
            req.n = n
            req.tail = _tail(row, n, self.check_tokens)

    def _start(self, row: np.ndarray, n: int, prompt_len: int) -> TrackedRequest:
        k = self.check_tokens
        head = _head(row, n, k)
        skip = self._done_prefix(row, n)
        if skip:
            self.counts.continued += 1
        self.counts.started += 1
        return TrackedRequest(n, head, _tail(row, n, k), prompt_len, skip)

    # -- finished requests -----------------------------------------------------------------------
    def finished(self) -> list[TrackedRequest]:
        """The requests missing from the batch for ``park_s`` (or the oldest, past
        ``max_parked``), oldest first; each is handed out once."""
        now = self.clock()
        out = []
        while self._parked:
            first = next(iter(self._parked.values()))  # the oldest: dicts keep insertion order
            if now - first.parked_at < self.park_s and len(self._parked) <= self.max_parked:
                break
            del self._parked[id(first)]
            out.append(self._finish(first))
        return out

    def idle(self) -> list[TrackedRequest]:
        """No step for a while (the engine ran out of requests, whose last rows are still
        here): every row has left the batch; the requests parked ``park_s`` ago are finished
        (returned).  A request that was only slow and does step again later is a new request
        whose ``skip`` covers what it held, so a caller counts nothing twice."""
        now = self.clock()
        for req in self._rows:
            if req is not None:
                req.parked_at = now
                self._parked[id(req)] = req
        self._rows = []
        return self.finished()

    def finish_all(self) -> list[TrackedRequest]:
        """Every request, running or parked, finished (engine shutdown)."""
        out = [self._finish(r) for r in [r for r in self._rows if r is not None]
               + list(self._parked.values())]
        self._rows, self._parked = [], {}
        return out

    def _finish(self, req: TrackedRequest) -> TrackedRequest:
        """Count ``req`` finished and remember its head and tail (``remember`` of them)."""
        self.counts.finished += 1
        if req.head not in self._done:
            self._done[req.head] = {}
            self._done_lengths[len(req.head) // 4] += 1
        self._done[req.head][req.n] = req.tail
        self._done_order.append((req.head, req.n))
        while len(self._done_order) > self.remember:
            h, m = self._done_order.popleft()
            ends = self._done.get(h, {})
            ends.pop(m, None)
            if not ends and h in self._done:
                del self._done[h]
                self._done_lengths[len(h) // 4] -= 1
        return req

    def _done_prefix(self, row: np.ndarray, n: int) -> int:
        """Tokens of ``row`` that a finished request held (0: none)."""
        k = self.check_tokens
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
            got = by_head.get(_uint32_bytes(row[:length]))
            if got is not None:
                yield from got if many else (got,)


def _head(row: np.ndarray, n: int, k: int) -> bytes:
    return _uint32_bytes(row[:min(n, k)])


def _tail(row: np.ndarray, n: int, k: int) -> bytes:
    return _uint32_bytes(row[max(n - k, 0):n])


def _uint32_bytes(tokens) -> bytes:
    """The bytes of ``tokens`` as uint32.  An engine's rows are int32 (vLLM's) or uint32, whose
    bytes are those already (ids are >= 0), so most calls copy nothing (half the cost of a
    head or a tail)."""
    dtype = getattr(tokens, "dtype", None)
    if dtype is not None and dtype.itemsize == 4 and dtype.kind in "iu":
        return tokens.tobytes()
    return np.asarray(tokens).astype(np.uint32).tobytes()


# ---------------------------------------------------------------------------------------------
# an idle engine
# ---------------------------------------------------------------------------------------------
class IdleWatch:
    """Whether an engine that calls nothing once its last request is done has gone idle.

    The engine is taken for idle when no step came for ``min_quiet_s`` (and four times the 90th
    percentile of the last 64 gaps between its steps) *and* the thread that runs its steps used
    no CPU meanwhile: a long prefill keeps that thread busy (it runs the forward on a CPU, and
    launches and waits on a GPU), an engine without requests leaves it blocked on its queue.

    ``stepped(busy)`` is called by the engine's step (on its thread, which it remembers),
    ``busy`` when requests were running before the step (then the gap since the last one was a
    step's, not idle time); ``thread_ran()`` and ``idle(ran)`` by a timer on another thread.
    ``clock`` and ``cpu_ticks`` (thread id -> CPU ticks, or None) are injectable for tests."""

    def __init__(self, min_quiet_s: float, *, clock: Callable[[], float] = time.monotonic,
                 cpu_ticks: Callable[[int | None], int | None] | None = None):
        self.min_quiet_s = float(min_quiet_s)
        self.clock = clock
        self._cpu_ticks = cpu_ticks or thread_cpu_ticks
        self._last_step = clock()
        self._gaps: collections.deque = collections.deque(maxlen=64)  # seconds between steps
        self._tid: int | None = None  # native id of the thread the engine steps on
        self._ticks: int | None = None  # that thread's CPU ticks at the last thread_ran()

    def stepped(self, busy: bool) -> None:
        """A step has just ended (on the engine's thread)."""
        if self._tid is None:
            self._tid = threading.get_native_id()
        now = self.clock()
        if busy:
            self._gaps.append(now - self._last_step)
        self._last_step = now

    def thread_ran(self) -> bool:
        """Whether the engine's thread used CPU since the last call (False when unknown: no
        step yet, or no /proc)."""
        ticks = self._cpu_ticks(self._tid)
        ran = ticks is not None and self._ticks is not None and ticks > self._ticks
        self._ticks = ticks
        return ran

    def idle(self, ran: bool) -> bool:
        """Whether the engine is idle, given ``ran`` (``thread_ran()``, read just before)."""
        gaps = np.array(self._gaps) if self._gaps else np.zeros(1)
        quiet = self.clock() - self._last_step
        return not ran and quiet >= max(self.min_quiet_s, 4 * float(np.percentile(gaps, 90)))


def thread_cpu_ticks(tid: int | None) -> int | None:
    """User + system CPU ticks of thread ``tid`` of this process (Linux), or None."""
    if tid is None:
        return None
    try:
        with open(f"/proc/self/task/{tid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    except (OSError, IndexError, ValueError):
        return None


__all__ = ["IdleWatch", "RequestTracker", "Rows", "TrackedRequest", "TrackerCounts"]
