"""``RequestTracker``: which request each row of an engine's batch holds, from the rows' tokens
alone (vLLM passes no request ids), step by step with exact expectations; and ``IdleWatch``,
which tells an idle engine from a slow one."""

from __future__ import annotations

import threading

import numpy as np

from ngram_generator.tracker import IdleWatch, RequestTracker, thread_cpu_ticks


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def step(tracker: RequestTracker, *rows, sampled=None):
    """One engine step over ``rows`` (token lists); each row sampled its last token unless
    ``sampled`` says otherwise (``[]``: a row in prefill)."""
    num = np.array([len(r) for r in rows], np.int64)
    ids = np.zeros((len(rows), max(num, default=0) + 4), np.int32)  # rows are longer than n
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    if sampled is None:
        sampled = [[r[-1]] for r in rows]
    return tracker.step(sampled, num, ids)


def tracker(**kw):
    clock = Clock()
    return RequestTracker(clock=clock, **kw), clock


A = list(range(100, 120))
B = list(range(200, 220))
C = list(range(300, 320))


def test_new_rows_start_requests_and_rows_that_keep_them_are_stable():
    tr, _ = tracker()
    seen = step(tr, A, B)
    a, b = seen.requests
    assert seen.started == [0, 1] and not seen.stable
    assert (a.n, a.prompt_len, a.skip) == (20, 19, 0)
    seen = step(tr, A + [1], B + [2])
    assert seen.requests == [a, b] and seen.started == [] and seen.stable
    assert a.n == 21 and tr.counts.to_dict() == {"started": 2, "finished": 0, "resumed": 0,
                                                 "continued": 0, "moved": 0}


def test_a_row_moved_into_a_hole_keeps_its_request():
    """The batch is condensed: the first request leaves, the last row moves into its hole."""
    tr, clock = tracker(park_s=1.0)
    a, b, c = step(tr, A, B, C).requests
    seen = step(tr, C + [5], B + [6])
    assert seen.requests == [c, b] and seen.started == [] and not seen.stable
    assert tr.counts.moved == 1 and tr.counts.resumed == 0 and c.n == 21
    assert tr.active == 3  # a is parked, not finished yet
    clock.t += 1.0
    assert tr.finished() == [a] and tr.active == 2


def test_a_row_reused_by_a_new_request_with_the_same_head_starts_it():
    """Row 0 is taken by a request whose first 8 tokens (``check_tokens``) are the old one's
    but whose tail is not: a new request; the old one is parked, then finished once."""
    tr, clock = tracker(park_s=1.0)
    (a,) = step(tr, A).requests
    other = A[:8] + list(range(900, 915))  # longer than a, same head
    seen = step(tr, other)
    (d,) = seen.requests
    assert d is not a and seen.started == [0] and (d.n, d.skip) == (23, 0)
    assert tr.counts.started == 2 and tr.active == 2
    clock.t += 1.0
    assert tr.finished() == [a] and tr.finished() == []
    assert step(tr, other + [7]).requests == [d]


def test_a_preempted_request_resumed_in_another_row_is_the_same_request():
    """Preempted (left out of the batch), then recomputed whole in another row: its prefill
    samples nothing and leaves it as it was; the step after, it grows."""
    tr, _ = tracker(park_s=5.0)
    a, b = step(tr, A, B).requests
    seen = step(tr, B + [1])
    assert seen.requests == [b] and tr.counts.moved == 1 and tr.active == 2
    seen = step(tr, B + [1, 2], A, sampled=[[2], []])
    assert seen.requests == [b, a] and seen.started == [] and a.n == 20
    assert tr.counts.resumed == 1 and tr.finished() == []
    seen = step(tr, B + [1, 2, 3], A + [9])
    assert seen.requests == [b, a] and seen.stable and a.n == 21
    assert tr.counts.started == 2


def test_a_request_back_after_park_s_is_a_new_one_that_skips_what_the_finished_one_held():
    tr, clock = tracker(park_s=1.0)
    (a,) = step(tr, A + [1, 2]).requests
    step(tr, B)
    clock.t += 1.0
    assert tr.finished() == [a] and tr.counts.finished == 1
    seen = step(tr, B + [3], A + [1, 2, 3, 4])
    back = seen.requests[1]
    assert seen.started == [1] and back is not a
    assert (back.n, back.prompt_len, back.skip) == (24, 23, 22)
    assert tr.counts.continued == 1 and tr.counts.resumed == 0


def test_finished_requests_come_out_oldest_first_once_and_past_max_parked_at_once():
    tr, clock = tracker(park_s=10.0, max_parked=1)
    a, b, c = step(tr, A, B, C).requests
    step(tr, C + [1])  # a and b parked: one too many
    assert tr.finished() == [a] and tr.active == 2
    clock.t += 10.0
    assert tr.finished() == [b] and tr.finished() == []
    assert tr.finish_all() == [c] and tr.active == 0 and tr.counts.finished == 3


def test_an_idle_engine_parks_every_row_and_finishes_them_after_park_s():
    tr, clock = tracker(park_s=2.0)
    a, b = step(tr, A, B).requests
    assert tr.idle() == [] and tr.active == 2  # parked now
    clock.t += 2.0
    assert tr.idle() == [a, b] and tr.active == 0
    # a request that was only slow steps again: new, skipping all it held
    seen = step(tr, A + [4])
    assert seen.started == [0] and seen.requests[0].skip == 20


def test_two_requests_with_the_same_prompt_are_told_apart_by_their_tails():
    prompt = list(range(1, 30))
    x, y = prompt + [500], prompt + [600]
    tr, _ = tracker()
    p, q = step(tr, x, y).requests
    seen = step(tr, y + [601], x + [501])  # swapped rows
    assert seen.requests == [q, p] and seen.started == [] and tr.counts.moved == 2
    assert (p.n, q.n) == (31, 31)


def test_two_requests_with_the_same_tokens_are_interchangeable_and_each_finished_once():
    tr, clock = tracker(park_s=1.0)
    p, q = step(tr, A, A).requests
    assert p is not q
    seen = step(tr, A + [1])
    assert seen.requests in ([p], [q]) and seen.started == []
    clock.t += 1.0
    assert tr.finished() == [q if seen.requests == [p] else p]
    assert tr.finish_all() == seen.requests and tr.counts.finished == 2


def test_a_row_in_prefill_is_no_request_until_it_samples():
    tr, _ = tracker()
    seen = step(tr, A, sampled=[[]])
    assert seen.requests == [None] and seen.started == [] and tr.active == 0
    seen = step(tr, A + [1, 2], sampled=[[1, 2]])
    assert seen.started == [0] and seen.requests[0].prompt_len == 20


def test_a_short_request_is_known_by_all_its_tokens_when_moved():
    """A request shorter than ``check_tokens`` at its start is keyed by all of its tokens."""
    tr, _ = tracker()
    a, b = step(tr, [7, 8, 9], B).requests
    seen = step(tr, B + [1], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16])
    assert seen.requests == [b, a] and a.n == 10 and tr.counts.moved == 2


def test_only_the_last_remember_finished_requests_are_remembered():
    tr, clock = tracker(park_s=0.0, remember=1)
    step(tr, A)
    step(tr, B)  # a leaves
    step(tr, C)  # b leaves
    assert [r.n for r in tr.finished()] == [20, 20]
    seen = step(tr, A + [1], B + [2])
    assert [r.skip for r in seen.requests] == [0, 20]  # a forgotten, b remembered


# --------------------------------------------------------------------------------------------
# IdleWatch
# --------------------------------------------------------------------------------------------
def test_an_engine_is_idle_after_min_quiet_s_when_its_step_thread_used_no_cpu():
    clock, ticks = Clock(), [0]
    watch = IdleWatch(5.0, clock=clock, cpu_ticks=lambda tid: ticks[0])
    watch.stepped(busy=False)
    clock.t = 4.9
    assert not watch.idle(watch.thread_ran())
    clock.t = 5.0
    assert watch.thread_ran() is False and watch.idle(False)
    ticks[0] = 3  # a long prefill: the step thread is busy, no step comes
    assert watch.thread_ran() is True and not watch.idle(True)
    assert watch.thread_ran() is False


def test_slow_steps_lengthen_the_wait():
    """Four times the 90th percentile of the gaps between busy steps, when above
    ``min_quiet_s``; gaps after an empty batch do not count."""
    clock = Clock()
    watch = IdleWatch(1.0, clock=clock, cpu_ticks=lambda tid: None)
    for _ in range(5):
        clock.t += 3.0
        watch.stepped(busy=True)
    clock.t = 115.0
    watch.stepped(busy=False)  # the engine was empty: not a step's gap
    clock.t = 126.9
    assert not watch.idle(False)
    clock.t = 127.0
    assert watch.idle(False)


def test_the_cpu_of_the_thread_that_steps_is_read():
    seen = []
    watch = IdleWatch(1.0, cpu_ticks=lambda tid: seen.append(tid) or 1)
    t = threading.Thread(target=watch.stepped, args=(True,))
    t.start()
    t.join()
    watch.thread_ran()
    assert seen == [t.native_id]
    assert isinstance(thread_cpu_ticks(threading.get_native_id()), int)
    assert thread_cpu_ticks(None) is None and thread_cpu_ticks(1 << 30) is None
