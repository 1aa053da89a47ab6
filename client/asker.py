"""``Asker``: pipelined draft asks on the asking thread's own socket, answered when it looks.

``NgramClient.draft_async`` hands each ask to the client's I/O thread: a write to its wake-up
pipe, and the I/O thread taking the GIL to send it (and again to deliver the reply).  A
generator that asks every engine step pays that hand-over inside its step: on a host whose cores
are busy the woken I/O thread waits for a core while holding up, or holding, the GIL, and the
drafting thread waits with it (a fifth of a batch-32 ``propose()`` beside two busy processes:
ARCHITECTURE §13).

An asker owns one DEALER socket (made with it, so it is connected before the first ask), used
only by the thread that asks (the caller serialises its
calls: a generator's step).  An ask is sent at once without blocking (libzmq's own threads carry
it; ``IMMEDIATE``: no live connection, no send); its reply waits in the socket until the asker
looks: ``collect`` (or a future's ``result``/``done``) reads every reply that has arrived,
without blocking unless asked to wait, and resolves the futures, whose callbacks then run on the
asking thread.  An ask unanswered within ``timeout_ms`` fails as the I/O thread's would
(``DaemonUnavailable`` when nothing at all was heard since it was sent, and then the socket is
replaced; else ``Timeout``); asks are never resent: a late draft is worth nothing.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from typing import Sequence

import zmq

from ngramd.wire import protocol as P
from ngramd.wire.commands import COMMANDS


#: How long the asker's first ask may wait for its socket, made this recently, to connect (a
#: caller asks right after making the asker, and libzmq connects on its own thread).  A socket
#: that replaced one after a silent timeout gets no grace: the daemon may be dead, and a
#: drafting thread must never wait on it; an ask it cannot send yet fails as not sent, and
#: the caller's link tells a dead daemon from a slow one.
CONNECT_GRACE_S = 0.1


class AskFuture(cf.Future):
    """A future resolved by its asker when looked at (``result``, ``done``, ``exception``)."""

    def __init__(self, asker: "Asker"):
        super().__init__()
        self._asker = asker

    def done(self) -> bool:
        if not super().done():
            self._asker.collect()
        return super().done()

    def result(self, timeout: float | None = None):
        if not super().done():
            self._asker.collect(timeout, until=self)
        return super().result(timeout=0)

    def exception(self, timeout: float | None = None):
        if not super().done():
            self._asker.collect(timeout, until=self)
        return super().exception(timeout=0)


class Asker:
    """Draft asks of one thread (module doc); made by ``NgramClient.asker``."""

    def __init__(self, client, timeout_ms: int | None, unavailable: type):
        # ``client`` is the NgramClient (its sockets, calls, reply rule and error wording);
        # ``unavailable`` its DaemonUnavailable: handed in, so this module does not import the
        # client's
        self._client, self._unavailable = client, unavailable
        self._timeout_ms = timeout_ms or client.timeout_ms
        self.timeout_s = self._timeout_ms / 1000
        # made now, so it is connected by the first ask (ZeroMQ lets a socket move to the
        # thread that then uses it alone); a new one after a silent timeout
        self._sock: zmq.Socket | None = None
        self._new_socket()
        self._grace_until = time.monotonic() + CONNECT_GRACE_S  # for the first socket only
        # id -> the client's ``_Call`` of each ask sent (its ``future`` an AskFuture), as the
        # client's ``_deliver`` takes them
        self._inflight: dict = {}
        self._heard_at = 0.0
        self._lock = threading.RLock()  # callers serialise; this keeps a misuse (or a
        # callback that looks at another ask) safe

    def draft_async(self, contexts: Sequence, max_len: int,
                    budget_us: float | None = None) -> AskFuture:
        """Future of ``NgramClient.draft``, sent now, resolved when looked at."""
        c, spec = self._client, COMMANDS["draft"]
        msg = spec.message(contexts, max_len, budget_us)
        call = c._new_call(spec.name, msg.fields, P.pack_batch(msg.seqs), post=spec.decode,
                           timeout_ms=self._timeout_ms, keys=msg.keys, future=AskFuture(self))
        fut = call.future
        with self._lock:
            # the client closes its askers after marking itself closed, so past this check the
            # socket is there (``_expire`` replaces it, only ``close`` removes it) unless this
            # asker was closed on its own: then it stays closed
            if c._closed or self._sock is None:
                raise self._unavailable("client is closed" if c._closed else "asker is closed")
            if self._inflight:  # earlier asks answered or late, even those nobody looks at
                self.collect()
            young = self._grace_until - time.monotonic()
            if young > 0:  # the first socket may still be connecting: wait for that only
                self._sock.poll(young * 1000 + 1, zmq.POLLOUT)
            try:
                self._sock.send_multipart(call.frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:  # IMMEDIATE: no live connection to queue it on
                fut.set_exception(c._no_reply(spec.name, int(call.timeout_s * 1000), 1, False,
                                              False))
                return fut
            now = time.monotonic()
            call.sent, call.sent_at, call.deadline = True, now, now + call.timeout_s
            self._inflight[call.id] = call
        return fut

    def collect(self, wait_s: float | None = 0.0, until: AskFuture | None = None) -> int:
        """Resolve the asks whose replies have arrived (waiting up to ``wait_s`` for ``until``'s,
        or for any when ``until`` is None and nothing has arrived) and fail those past their
        time; returns how many replies were read."""
        got, deadline = 0, time.monotonic() + max(wait_s or 0.0, 0.0)
        with self._lock:
            sock = self._sock
            if sock is None:
                return 0
            while True:
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._heard_at = time.monotonic()
                    # the client's reply rule; None: unreadable, or an ask already given up on
                    if self._client._deliver(frames, self._inflight) is not None:
                        got += 1
                left = deadline - time.monotonic()
                waiting = (until is not None and not cf.Future.done(until)) or (
                    until is None and not got)
                if not waiting or left <= 0 or not self._inflight:
                    break
                sock.poll(left * 1000 + 1, zmq.POLLIN)
            self._expire()
        return got

    def _expire(self) -> None:
        """Fail the asks past their time (as ``NgramClient._no_reply`` words it); a new socket
        when none of them heard anything since it was sent."""
        now = time.monotonic()
        late = [call for call in self._inflight.values() if call.deadline <= now]
        if not late:
            return
        silent = False
        for call in late:
            del self._inflight[call.id]
            heard = self._heard_at >= call.sent_at
            silent |= not heard
            call.future.set_exception(self._client._no_reply(
                call.op, int(call.timeout_s * 1000), 1, True, heard))
        if silent and self._sock is not None:
            self._sock.close(linger=0)
            self._new_socket()
            self._grace_until = 0.0  # no wait for this one (CONNECT_GRACE_S)

    def _new_socket(self) -> None:
        self._sock = self._client._new_socket()

    @property
    def pending(self) -> int:
        return len(self._inflight)

    def close(self) -> None:
        """Fail what is still asked and close the socket."""
        with self._lock:
            for call in self._inflight.values():
                if not cf.Future.done(call.future):
                    call.future.set_exception(self._unavailable("client closed"))
            self._inflight.clear()
            if self._sock is not None:
                self._sock.close(linger=0)
                self._sock = None
