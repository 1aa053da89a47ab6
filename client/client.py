"""``NgramClient``: talk to ``ngramd`` from any process (generators, tools, tests).

One background I/O thread owns the DEALER socket of the asynchronous API (ZeroMQ sockets are
not thread safe); ``*_async`` calls return a ``concurrent.futures.Future``, are pipelined and
matched to replies by id.  Synchronous idempotent calls (``ping``, ``info``, ``stats``,
``draft``, ``lookup``) skip the hop through that thread: each calling thread gets a DEALER socket
of its own and waits on it directly.  The hop (pipe wake-up, two GIL hand-overs, a future) cost
more than the whole daemon round trip on a busy 2-core machine.

Failure handling
----------------
* Each attempt has ``timeout_ms``.  Idempotent ops (everything but ``ingest`` and ``report``)
  are resent up to ``retries`` times on the same socket; ZeroMQ reconnects underneath
  (a restarted daemon is found again within ``RECONNECT_IVL``).
* ``IMMEDIATE`` is set, so a request is only queued on a live connection: when the daemon is
  down, nothing piles up to be delivered later.  A request that could not be sent before its
  deadline fails with ``DaemonUnavailable`` and was certainly not executed.
* When a call gives up without having heard anything from the daemon, the socket is closed
  (``LINGER=0``: stale requests are dropped, never delivered late) and a new one connects.
* **Ingest is never resent by the client.**  A resend after a lost ack would count the same
  tokens twice.  Each ingest carries a ``key`` (random unless the caller gives one); the daemon
  remembers recent keys and answers a repeated key with the first ack (``duplicate: True``)
  instead of ingesting again.  So on ``Timeout`` a caller that wants the data in resends with the
  *same* key.  The daemon's key memory does not survive its restart: a resend after a restart
  may count once more (bounded to that one batch; counts are statistics and verification makes
  every draft lossless anyway).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import itertools
import logging
import os
import threading
import time
import uuid
from typing import Callable, NamedTuple, Sequence

import numpy as np
import zmq

from ngramd import protocol as P
from ngramd.errors import TIMEOUT, UNAVAILABLE, IdentityMismatch, NgramError
from ngramd.identity import TableIdentity

log = logging.getLogger("ngram_client")

#: ops that legitimately take long (whole-log apply, hot rebuild, scans): their own timeout
SLOW_TIMEOUT_MS = 600_000


class DaemonError(NgramError):
    """The daemon answered with an error: ``code`` (stable, from ngramd.errors) and ``message``."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}", code)
        self.message = message


class Timeout(NgramError, TimeoutError):
    """No reply within the timeout (after the retries an idempotent op is allowed)."""

    code = TIMEOUT


class DaemonUnavailable(NgramError, ConnectionError):
    """The daemon could not be reached, is shutting down, or this client is closed."""

    code = UNAVAILABLE


class DraftResult(NamedTuple):
    """One context's draft: ``tokens`` (uint32), and per token the ``orders`` (uint8) and
    ``tiers`` (uint8: 0 local, 1 hot, 2 cold) that produced it and its ``conf`` (share)."""

    tokens: np.ndarray
    orders: np.ndarray
    tiers: np.ndarray
    conf: np.ndarray


class _Call:
    __slots__ = ("op", "id", "frames", "future", "post", "idempotent", "tries_left",
                 "timeout_s", "deadline", "sent", "sent_at")

    def __init__(self, op, req_id, frames, post, idempotent, tries, timeout_s):
        self.op, self.id, self.frames, self.post = op, req_id, frames, post
        self.future: cf.Future = cf.Future()
        self.idempotent, self.tries_left, self.timeout_s = idempotent, tries, timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.sent = False
        self.sent_at = 0.0


class NgramClient:
    """A connection to one ``ngramd``.

    ``endpoint``: ``ipc://...`` or ``tcp://...`` (default: ``$NGRAMD_ENDPOINT`` or the daemon's
    default socket).  ``timeout_ms``: per attempt.  ``retries``: resends of idempotent ops.
    ``tokenizer_fingerprint``: sha256 of the tokenizer this process uses
    (``ngramd.identity.tokenizer_fingerprint``); when given, the constructor asks the daemon
    for its identity and raises ``IdentityMismatch`` if the table was built with another one.
    """

    def __init__(self, endpoint: str | None = None, timeout_ms: int = 1000, retries: int = 2, *,
                 tokenizer_fingerprint: str | None = None, context: zmq.Context | None = None):
        self.endpoint = endpoint or os.environ.get("NGRAMD_ENDPOINT") or P.default_endpoint()
        self.timeout_ms = int(timeout_ms)
        self.retries = int(retries)
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self._ctx = context or zmq.Context.instance()
        self._ids = itertools.count(1)
        self._outbox: collections.deque = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._closed = False
        self._local = threading.local()  # per calling thread: its own socket for sync calls
        self._sync_socks: list = []
        self._sync_lock = threading.Lock()
        self._thread = threading.Thread(target=self._io_loop, name="ngram-client-io", daemon=True)
        self._thread.start()
        if tokenizer_fingerprint:
            try:
                self.info()  # raises IdentityMismatch now rather than drafting junk later
            except BaseException:
                self.close()
                raise

    # ------------------------------------------------------------------ public API
    def ping(self) -> float:
        """Round trip in seconds."""
        t0 = time.perf_counter()
        self._call_sync("ping")
        return time.perf_counter() - t0

    def info(self) -> dict:
        """Identity, hot segment (``hot: {shm_dir, table, generation}``), orders, limits."""
        return self._call_sync("info", post=self._check_identity)

    def stats(self) -> dict:
        return self._call_sync("stats", post=_fields)

    def draft_async(self, contexts: Sequence, max_len: int,
                    budget_us: float | None = None) -> cf.Future:
        """Future of ``draft``; contexts are uint32 arrays (or int sequences), most recent last."""
        fields = {"max_len": int(max_len)}
        if budget_us is not None:
            fields["budget_us"] = float(budget_us)
        return self._call("draft", fields, self._pack(contexts), post=_draft_results)

    def draft(self, contexts: Sequence, max_len: int,
              budget_us: float | None = None) -> list[DraftResult]:
        """Draft up to ``max_len`` tokens after each context; ``budget_us`` bounds the daemon's
        time on cold reads (µs) before it answers from the hot tier alone."""
        fields = {"max_len": int(max_len)}
        if budget_us is not None:
            fields["budget_us"] = float(budget_us)
        return self._call_sync("draft", fields, self._pack(contexts), post=_draft_results)

    def lookup_async(self, contexts: Sequence) -> cf.Future:
        return self._call("lookup", None, self._pack(contexts), post=_arrays)

    def lookup(self, contexts: Sequence) -> dict:
        """Top-3 candidates of every order: ``tok, cnt`` (B, n_max+1, 3) uint32, ``total``
        (B, n_max+1) uint32 (0 = absent), ``tier`` (B, n_max+1) uint8 (1 hot, 2 cold, 255 none)."""
        return self._call_sync("lookup", None, self._pack(contexts), post=_arrays)

    def ingest_async(self, seqs: Sequence, key: str | None = None) -> cf.Future:
        """Future of ``ingest``.  Sent once (see the module doc); resend with the same ``key``."""
        key = key or uuid.uuid4().hex
        return self._call("ingest", {"key": key}, self._pack(seqs), post=_ingest_ack)

    def ingest(self, seqs: Sequence, key: str | None = None) -> tuple[int, int]:
        """Append sequences to the table; returns ``(first_seq, last_seq)`` once durable."""
        return self.ingest_async(seqs, key).result()

    def report_async(self, drafted: dict, accepted: dict,
                     keys: np.ndarray | None = None) -> cf.Future:
        fields = {"drafted": {int(k): int(v) for k, v in drafted.items()},
                  "accepted": {int(k): int(v) for k, v in accepted.items()}}
        return self._call("report", fields, post=lambda r: None, keys=keys)

    def report(self, drafted: dict, accepted: dict, keys: np.ndarray | None = None) -> None:
        """Per-order counts of drafted and accepted tokens (for stats), and optionally the
        kernel keys of the hot entries drafted from (they rank the next hot generation)."""
        self.report_async(drafted, accepted, keys).result()

    def rebuild_hot(self, full: bool = False, timeout_ms: int = SLOW_TIMEOUT_MS) -> int:
        """Build and publish a new hot generation now; returns its number."""
        return self._call("rebuild_hot", {"full": bool(full)}, timeout_ms=timeout_ms,
                          post=lambda r: int(r.fields["generation"])).result()

    def flush(self, timeout_ms: int = SLOW_TIMEOUT_MS) -> int:
        """Wait until everything ingested so far is counted; returns the applied log seq."""
        return self._call("flush", timeout_ms=timeout_ms,
                          post=lambda r: int(r.fields["applied"])).result()

    def top(self, order: int, n: int = 20, timeout_ms: int = SLOW_TIMEOUT_MS) -> list:
        """The ``n`` most frequent contexts of ``order``: list of (key, total, tok, cnt); the
        table stores contexts as their 64-bit keys (``ngramd.kernels.key_hash``)."""
        return self._call("top", {"order": int(order), "n": int(n)}, timeout_ms=timeout_ms,
                          post=_top_rows).result()

    def attach_hot(self):
        """Map the daemon's current hot generation read-only, to draft in-process (µs) and ask
        the daemon only on a miss.  Needs the same host and read access to the shm dir."""
        from ngramd.hot import HotReader

        info = self.info()
        hot = info["hot"]
        return HotReader(hot["shm_dir"], hot["table"],
                         identity=TableIdentity(**info["identity"]))

    def close(self) -> None:
        """Fail what is still pending with ``DaemonUnavailable``, stop the I/O thread."""
        if self._closed:
            return
        self._closed = True
        self._wake()
        self._thread.join(timeout=5)
        with self._sync_lock:
            for sock in self._sync_socks:
                sock.close(linger=0)
            self._sync_socks.clear()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ plumbing
    @staticmethod
    def _pack(seqs):
        # ids only need to fit uint32 here: the daemon checks them against the vocab size
        return P.pack_batch(seqs)

    def _call(self, op: str, fields: dict | None = None, batch=None, *,
              post: Callable = lambda r: r, timeout_ms: int | None = None,
              keys: np.ndarray | None = None) -> cf.Future:
        if self._closed:
            raise DaemonUnavailable("client is closed")
        req_id = next(self._ids)
        idem = op in P.IDEMPOTENT
        call = _Call(op, req_id, P.encode_request(op, req_id, fields, batch, keys), post, idem,
                     self.retries if idem else 0, (timeout_ms or self.timeout_ms) / 1000)
        self._outbox.append(call)
        self._wake()
        return call.future

    def _call_sync(self, op: str, fields: dict | None = None, batch=None, *,
                   post: Callable = lambda r: r, timeout_ms: int | None = None):
        """An idempotent call on the calling thread's own socket (same retry and failure rules
        as the I/O thread: resend up to ``retries`` times, a fresh socket after a silent
        attempt so a late reply can never be taken for a later request's)."""
        if op not in P.IDEMPOTENT:
            return self._call(op, fields, batch, post=post, timeout_ms=timeout_ms).result()
        if self._closed:
            raise DaemonUnavailable("client is closed")
        timeout_s = (timeout_ms or self.timeout_ms) / 1000
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = self._thread_socket()
        sent = heard = False
        for _ in range(self.retries + 1):
            req_id = next(self._ids)
            frames = P.encode_request(op, req_id, fields, batch)
            if sock.poll(timeout_s * 1000, zmq.POLLOUT):  # IMMEDIATE: writable once connected
                sock.send_multipart(frames, copy=False)
                sent = True
                deadline = time.monotonic() + timeout_s  # the reply gets a full attempt's time
                while (left := deadline - time.monotonic()) > 0 and sock.poll(left * 1000 + 1):
                    try:
                        reply = P.decode_reply(sock.recv_multipart(copy=False))
                    except NgramError as e:
                        log.warning("dropping an unreadable reply: %s", e)
                        continue
                    heard = True
                    if reply.id == req_id:
                        return _result(reply, post)
                    # else: a late reply to an earlier attempt on this socket
            sock = self._thread_socket(replace=sock)
        ms = int(timeout_s * 1000)
        if not sent:
            raise DaemonUnavailable(f"{op}: no connection to {self.endpoint} in "
                                    f"{self.retries + 1} tries of {ms} ms; the request was not sent")
        if not heard:
            raise DaemonUnavailable(f"{op}: no answer from {self.endpoint} after "
                                    f"{self.retries + 1} tries of {ms} ms")
        raise Timeout(f"{op}: no reply within {ms} ms after {self.retries + 1} tries")

    def _thread_socket(self, replace: zmq.Socket | None = None) -> zmq.Socket:
        with self._sync_lock:
            if replace is not None:
                self._sync_socks.remove(replace)
                replace.close(linger=0)
            if self._closed:
                raise DaemonUnavailable("client is closed")
            sock = self._new_socket()
            self._sync_socks.append(sock)
        self._local.sock = sock
        return sock

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # full pipe: the I/O thread is awake anyway

    def _check_identity(self, reply: P.Reply) -> dict:
        info = _fields(reply)
        ident = info.get("identity", {})
        theirs = ident.get("tokenizer", "")
        mine = self.tokenizer_fingerprint
        if mine and theirs and mine != theirs:
            raise IdentityMismatch(
                f"tokenizer mismatch: table {info.get('hot', {}).get('table', '?')!r} was built "
                f"with tokenizer sha256 {theirs[:16]}..., this client uses {mine[:16]}...: "
                f"token ids would mean different things")
        if mine and not theirs:
            log.warning("the table records no tokenizer fingerprint; cannot check identity")
        return info

    # ------------------------------------------------------------------ I/O thread
    def _new_socket(self) -> zmq.Socket:
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)  # closing never waits for, or later delivers, stale requests
        s.setsockopt(zmq.IMMEDIATE, 1)  # queue only on live connections (see the module doc)
        s.setsockopt(zmq.RECONNECT_IVL, 100)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        s.connect(self.endpoint)
        return s

    def _io_loop(self) -> None:
        sock = self._new_socket()
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        unsent: collections.deque = collections.deque()  # calls waiting for a live connection
        inflight: dict[int, _Call] = {}
        last_heard = 0.0  # monotonic time of the last reply from the daemon
        try:
            while not self._closed:
                while self._outbox:
                    unsent.append(self._outbox.popleft())
                while unsent:  # send in order until the connection pushes back
                    call = unsent[0]
                    try:
                        sock.send_multipart(call.frames, zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    unsent.popleft()
                    call.sent, call.sent_at = True, time.monotonic()
                    inflight[call.id] = call
                now = time.monotonic()
                deadlines = [c.deadline for c in unsent] + [c.deadline for c in inflight.values()]
                timeout = max(0, int((min(deadlines) - now) * 1000) + 1) if deadlines else None
                poller.register(sock, zmq.POLLIN | (zmq.POLLOUT if unsent else 0))
                events = dict(poller.poll(timeout))
                if self._wake_r in events:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                if events.get(sock, 0) & zmq.POLLIN:
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        last_heard = time.monotonic()
                        self._deliver(frames, inflight)
                if deadlines:
                    sock = self._expire(sock, poller, unsent, inflight, last_heard)
        except Exception:  # a bug here must not leave callers waiting forever
            log.exception("client I/O thread failed")
        finally:
            err = DaemonUnavailable("client closed")
            for call in list(unsent) + list(inflight.values()) + list(self._outbox):
                if not call.future.done():
                    call.future.set_exception(err)
            sock.close(linger=0)

    def _deliver(self, frames, inflight: dict) -> None:
        try:
            reply = P.decode_reply(frames)
        except NgramError as e:
            log.warning("dropping an unreadable reply: %s", e)
            return
        call = inflight.pop(reply.id, None)
        if call is None:  # a late answer to an attempt we already resent or gave up on
            return
        try:
            call.future.set_result(_result(reply, call.post))
        except Exception as e:  # an error reply, or post-processing (identity check) raising
            call.future.set_exception(e)

    def _expire(self, sock, poller, unsent, inflight, last_heard):
        """Resend or fail calls past their deadline; may replace the socket (returned)."""
        now = time.monotonic()
        reconnect = False
        for q in (unsent, None):
            calls = list(q) if q is not None else list(inflight.values())
            for call in calls:
                if call.deadline > now:
                    continue
                if call.tries_left > 0:  # idempotent: another attempt
                    call.tries_left -= 1
                    call.deadline = now + call.timeout_s
                    if call.sent:
                        inflight.pop(call.id, None)
                        call.sent = False
                        unsent.append(call)
                    continue
                if call.sent:
                    inflight.pop(call.id, None)
                else:
                    unsent.remove(call)
                heard = last_heard >= call.sent_at if call.sent else False
                call.future.set_exception(self._give_up(call, heard))
                reconnect |= not heard
        if reconnect:
            log.debug("no answer from %s: reconnecting", self.endpoint)
            poller.unregister(sock)
            sock.close(linger=0)
            sock = self._new_socket()
            for call in list(inflight.values()):  # their replies cannot reach the new socket
                inflight.pop(call.id)
                if call.idempotent:
                    call.sent = False
                    unsent.appendleft(call)
                else:
                    call.future.set_exception(self._give_up(call, True))
        return sock

    def _give_up(self, call: _Call, heard: bool) -> NgramError:
        ms = int(call.timeout_s * 1000)
        if not call.sent:
            tries = self.retries + 1 if call.idempotent else 1
            return DaemonUnavailable(f"{call.op}: no connection to {self.endpoint} in {tries} "
                                     f"tries of {ms} ms; the request was not sent")
        if not call.idempotent:
            return Timeout(f"{call.op}: sent to {self.endpoint} but not acknowledged within "
                           f"{ms} ms; it may or may not have been applied and was not resent "
                           f"(resend with the same key to be safe)")
        if not heard:
            return DaemonUnavailable(f"{call.op}: no answer from {self.endpoint} after "
                                     f"{self.retries + 1} tries of {ms} ms")
        return Timeout(f"{call.op}: no reply within {ms} ms after {self.retries + 1} tries")


# ---------------------------------------------------------------------------------------------
# reply post-processing (runs on the I/O thread; arrays are read-only views of the frames)
# ---------------------------------------------------------------------------------------------
def _result(reply: P.Reply, post: Callable):
    """The value of a reply, or the exception its error code maps to."""
    if not reply.ok:
        code, msg = str(reply.fields.get("code")), str(reply.fields.get("msg"))
        raise DaemonUnavailable(msg) if code == UNAVAILABLE else DaemonError(code, msg)
    return post(reply)


def _fields(r: P.Reply) -> dict:
    r.fields.pop("ok", None)
    r.fields.pop("v", None)
    r.fields.pop("id", None)
    return r.fields


def _arrays(r: P.Reply) -> dict:
    return r.arrays


def _ingest_ack(r: P.Reply) -> tuple[int, int]:
    return int(r.fields["first_seq"]), int(r.fields["last_seq"])


def _draft_results(r: P.Reply) -> list[DraftResult]:
    a = r.arrays
    return [DraftResult(a["tok"][i, :n], a["order"][i, :n], a["tier"][i, :n], a["conf"][i, :n])
            for i, n in enumerate(a["length"].tolist())]


def _top_rows(r: P.Reply) -> list:
    a = r.arrays
    return [(int(a["key"][i]), int(a["total"][i]), a["tok"][i], a["cnt"][i])
            for i in range(len(a["total"]))]
