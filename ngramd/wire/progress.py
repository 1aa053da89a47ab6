"""Saying what a command line tool waits for, once the wait has taken more than 2 s.

``ngram-client`` (flush, rebuild-hot, ping --wait, the end of an ingest) and the ``ngramd``
tools (snapshot, restore) block on one thing at a time: a reply, a thread.  A wait under
``AFTER_S`` shows nothing; a longer one shows a line on stderr with the time waited so far and
what the caller can say about the state (``status()``, e.g. the daemon's log lag), redrawn in
place each second on a terminal and repeated every ``EVERY_S`` otherwise (logs, CI), and one
last line with the total when it ends.  Results go to stdout, so a pipe is never disturbed.
"""

from __future__ import annotations

import concurrent.futures as cf
import sys
import time
from typing import Callable

#: waits shorter than this show nothing (s)
AFTER_S = 2.0
#: a line every this many seconds when stderr is not a terminal (s)
EVERY_S = 10.0


def wait(fut: cf.Future, what: str, status: Callable[[], str] | None = None, *,
         stream=None, clock: Callable[[], float] = time.monotonic, tick_s: float = 0.25):
    """``fut.result()``, showing ``what`` is awaited after ``AFTER_S`` (module doc).
    ``status()`` (optional, called about once a second; errors ignored) adds a few words.
    ``clock`` and ``tick_s`` (how often the future is looked at, s) are for tests."""
    stream = stream if stream is not None else sys.stderr
    tty = stream.isatty()
    t0 = clock()
    shown_at = None  # when the last line was written
    try:
        while True:
            try:
                return fut.result(timeout=tick_s)
            except cf.TimeoutError:
                pass
            now = clock()
            if now - t0 < AFTER_S or (shown_at is not None
                                      and now - shown_at < (1.0 if tty else EVERY_S)):
                continue
            line = f"{what}: waiting, {now - t0:.0f} s{_status(status)}"
            stream.write(f"\r{line}\x1b[K" if tty else line + "\n")
            stream.flush()
            shown_at = now
    finally:
        if shown_at is not None:
            stream.write(f"{chr(13) if tty else ''}{what}: {clock() - t0:.1f} s"
                         f"{chr(27) + '[K' if tty else ''}\n")
            stream.flush()


def run(fn: Callable, what: str, status: Callable[[], str] | None = None):
    """``fn()`` on a thread of its own, waited for with :func:`wait` (a blocking local step,
    such as unpacking a snapshot, with a progress line)."""
    with cf.ThreadPoolExecutor(1, thread_name_prefix="progress") as pool:
        return wait(pool.submit(fn), what, status)


def _status(status) -> str:
    if status is None:
        return ""
    try:
        text = status()
    except Exception:  # a status is a courtesy: the wait itself must not fail for it
        return ""
    return f"; {text}" if text else ""
