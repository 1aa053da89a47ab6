"""``NgramClient``: talk to ``ngramd`` from any process (generators, tools, tests).

One background I/O thread owns the DEALER socket of the asynchronous API (ZeroMQ sockets are
not thread safe); ``*_async`` calls return a ``concurrent.futures.Future``, are pipelined and
matched to replies by id.  Synchronous calls of idempotent ops (``ping``, ``info``,
``stats``, ``draft``, ``lookup``, ...) skip the hop through that thread: each calling thread
gets a DEALER socket of its own and waits on it directly.  The hop (pipe wake-up, two GIL
hand-overs, a future) cost more than the whole daemon round trip on a busy 2-core machine.

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
* A request above the daemon's ``max_msg_bytes`` raises ``TooLarge`` before it is sent: the
  daemon would answer ``too_large``, or, for a frame above twice the limit, libzmq would drop
  it unanswered and the caller would only see a timeout.  The limit comes from ``info``
  (asked once, lazily, the first time a frame over 64 KiB is sent: smaller frames are never
  dropped, so the daemon's own reply covers them).
* If the I/O thread dies (a bug), its pending and all later asynchronous calls fail with
  ``DaemonUnavailable`` instead of waiting forever; the error is logged once.

Methods
-------
Every op declared in ``ngramd.wire.commands`` is a method pair of ``NgramClient``, written out
so that IDEs and static tools see it: ``name(..., timeout_ms=None)`` waits for the value,
``name_async(...)`` returns a future of it; the parameters, docstring and value are the
declaration's (its ``message`` and ``decode``), and ``tests/test_client_ops.py`` fails when
they drift apart, when a declared op has no method pair, or a method no declaration.
``timeout_ms`` is per attempt (default: the op's own, else the client's).  Three add something
of the client's own: ``ping`` (the round trip), ``info`` (the identity check), ``ingest`` (a
warning when no tokenizer fingerprint was given, resends while the daemon is ``busy``).

Security
--------
On ``tcp://`` endpoints the client speaks CurveZMQ when given the daemon's public key
(``server_key``, or ``$NGRAM_SERVER_KEY``): a path to the ``server.key`` file ``ngramd keygen``
wrote.  ``client_key`` (or ``$NGRAM_CLIENT_KEY``) is this client's ``.key_secret`` file, needed
when the daemon admits only listed clients; without it a fresh key pair is made per client.
``ipc://`` endpoints are unencrypted (the socket file's permissions guard them) and ignore keys.
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
from typing import Callable, Sequence

import numpy as np
import zmq

from ngramd.wire import protocol as P
from ngramd.wire.commands import COMMANDS, SLOW_TIMEOUT_MS, Command, Draft, DraftResult
from ngramd.wire.curve import client_keys
from ngramd.wire.errors import (BUSY, TIMEOUT, UNAVAILABLE, BadInput, IdentityMismatch,
                               NgramError, TooLarge)
from ngramd.wire.identity import FINGERPRINT_VERSION

log = logging.getLogger("ngram_client")

#: endpoints already warned about a table without a tokenizer fingerprint (one warning a process)
_WARNED_UNRECORDED: set = set()
#: how long ``ingest`` keeps resending while the daemon answers ``busy`` (s)
BUSY_WAIT_S = 600.0

__all__ = ["NgramClient", "Draft", "DraftResult", "DaemonError", "DaemonUnavailable", "Timeout",
           "SLOW_TIMEOUT_MS", "check_endpoint"]


class DaemonError(NgramError):
    """The daemon answered with an error: ``code`` (stable, from ngramd.wire.errors) and
    ``message``."""

    def __init__(self, code: str, message: str, retry_ms: int | None = None):
        super().__init__(f"{code}: {message}", code)
        self.message = message
        self.retry_ms = retry_ms  # ``busy``: when the daemon expects a resend to succeed


class Timeout(NgramError, TimeoutError):
    """No reply within the timeout (after the retries an idempotent op is allowed)."""

    code = TIMEOUT


class DaemonUnavailable(NgramError, ConnectionError):
    """The daemon could not be reached, is shutting down, or this client is closed.

    ``sent`` tells the two kinds of "unreachable" apart: False when the request never left
    (no connection: nothing listens at the endpoint), True when it was sent and nothing at all
    came back (a daemon that is alive but kept from running looks like this)."""

    code = UNAVAILABLE

    def __init__(self, message: str, code: str | None = None, *, sent: bool = False):
        super().__init__(message, code)
        self.sent = sent


class _Call:
    __slots__ = ("op", "id", "frames", "future", "post", "idempotent", "tries_left",
                 "timeout_s", "deadline", "sent", "sent_at")

    def __init__(self, op, req_id, frames, post, idempotent, tries, timeout_s, future=None):
        self.op, self.id, self.frames, self.post = op, req_id, frames, post
        self.future: cf.Future = cf.Future() if future is None else future
        self.idempotent, self.tries_left, self.timeout_s = idempotent, tries, timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.sent = False
        self.sent_at = 0.0


class NgramClient:
    """A connection to one ``ngramd``.

    ``endpoint``: ``ipc://...`` or ``tcp://...`` (default: ``$NGRAMD_ENDPOINT`` or the daemon's
    default socket).  ``timeout_ms``: per attempt.  ``retries``: resends of idempotent ops.
    ``tokenizer_fingerprint``: the fingerprint of the tokenizer this process uses
    (``ngramd.wire.identity.tokenizer_fingerprint(path)``, or ``hf_tokenizer_fingerprint(tok)``
    for a loaded ``transformers`` tokenizer); when given, the constructor asks the daemon for its
    identity and raises ``IdentityMismatch`` if the table was built with another one, before
    any token is sent.  Every client that sends tokens should give it; an ingest without one is
    logged (once) as unchecked.
    ``server_key``/``client_key``: CurveZMQ key files for ``tcp://`` endpoints (module doc);
    default ``$NGRAM_SERVER_KEY``/``$NGRAM_CLIENT_KEY``.  A bad key file is a ``BadInput``.

    ``close()`` closes every socket of this client, those of other threads included: call it
    once the threads that use the client are done with it.
    """

    #: how long ``ingest`` keeps resending while the daemon answers ``busy`` (s)
    busy_wait_s = BUSY_WAIT_S

    def __init__(self, endpoint: str | None = None, timeout_ms: int = 1000, retries: int = 2, *,
                 tokenizer_fingerprint: str | None = None, context: zmq.Context | None = None,
                 server_key: str | None = None, client_key: str | None = None):
        self.endpoint = endpoint or os.environ.get("NGRAMD_ENDPOINT") or P.default_endpoint()
        check_endpoint(self.endpoint)  # a typo fails here, not in the I/O thread
        self._curve = client_keys(self.endpoint,
                                  server_key or os.environ.get("NGRAM_SERVER_KEY"),
                                  client_key or os.environ.get("NGRAM_CLIENT_KEY"))
        self.timeout_ms = int(timeout_ms)
        self.retries = int(retries)
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self._warned_unproven = False  # ingest without a fingerprint: warned once
        self._ctx = context or zmq.Context.instance()
        self._ids = itertools.count(1)
        self._outbox: collections.deque = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._closed = False
        self._io_error: str | None = None  # set when the I/O thread has ended (why)
        self._max_msg_bytes: int | None = None  # the daemon's limit, from its last ``info``
        self._local = threading.local()  # per calling thread: its own socket for sync calls
        self._sync_socks: dict[zmq.Socket, threading.Thread] = {}  # socket -> owner thread
        self._sync_lock = threading.Lock()
        self._askers: list = []  # Asker objects (``asker``), closed with the client
        self._thread = threading.Thread(target=self._io_loop, name="ngram-client-io", daemon=True)
        self._thread.start()
        if tokenizer_fingerprint:
            try:
                self.info()  # raises IdentityMismatch now rather than drafting junk later
            except BaseException:
                self.close()
                raise

    # ------------------------------------------------------------------ the declared ops
    # one method pair per op of ngramd.wire.commands, in declaration order (module doc); the
    # docstrings are the declarations' (tests/test_client_ops.py)
    def ping(self, *, timeout_ms: int | None = None) -> float:
        """Round trip in seconds."""
        t0 = time.perf_counter()
        self._call_sync("ping", timeout_ms=timeout_ms)
        return time.perf_counter() - t0

    def ping_async(self, *, timeout_ms: int | None = None) -> cf.Future:
        """Future of ``ping``'s answer: the daemon's instance id and health state."""
        return self._invoke(COMMANDS["ping"], (), {}, timeout_ms, sync=False)

    def info(self, *, timeout_ms: int | None = None) -> dict:
        """Identity, hot segment (``hot: {shm_dir, table, generation}``), orders, limits.
        Raises ``IdentityMismatch`` if the table's tokenizer is not this client's."""
        return self._call_sync("info", post=self._check_identity, timeout_ms=timeout_ms)

    def info_async(self, *, timeout_ms: int | None = None) -> cf.Future:
        """Future of ``info``."""
        return self._call("info", post=self._check_identity, timeout_ms=timeout_ms)

    def stats(self, *, timeout_ms: int | None = None) -> dict:
        """The table's figures plus the server's (requests, errors, latency per op)."""
        return self._invoke(COMMANDS["stats"], (), {}, timeout_ms, sync=True)

    def stats_async(self, *, timeout_ms: int | None = None) -> cf.Future:
        """Future of ``stats``."""
        return self._invoke(COMMANDS["stats"], (), {}, timeout_ms, sync=False)

    def draft(self, contexts: Sequence, max_len: int, budget_us: float | None = None, *,
              timeout_ms: int | None = None) -> list[Draft]:
        """Draft up to ``max_len`` tokens after each context (uint32 arrays or int sequences, most
        recent last); ``budget_us`` bounds the daemon's time on cold reads (µs) before it answers
        from the hot tier alone."""
        return self._invoke(COMMANDS["draft"], (contexts, max_len, budget_us), {}, timeout_ms,
                            sync=True)

    def draft_async(self, contexts: Sequence, max_len: int, budget_us: float | None = None, *,
                    timeout_ms: int | None = None) -> cf.Future:
        """Future of ``draft``."""
        return self._invoke(COMMANDS["draft"], (contexts, max_len, budget_us), {}, timeout_ms,
                            sync=False)

    def asker(self, timeout_ms: int | None = None) -> "Asker":
        """Draft asks on the calling thread's own socket, resolved when looked at, never
        through the I/O thread (``ngram_client.asker``: a generator asking every engine step);
        closed with the client."""
        from .asker import Asker

        a = Asker(self, timeout_ms, DaemonUnavailable)
        with self._sync_lock:
            self._askers.append(a)
        return a

    def lookup(self, contexts: Sequence, *, timeout_ms: int | None = None) -> dict:
        """Top-3 candidates of every order: ``tok, cnt`` (B, n_max+1, 3) uint32, ``total``
        (B, n_max+1) uint32 (0 = absent), ``tier`` (B, n_max+1) uint8 (1 hot, 2 cold, 255 none).
        Cold reads of every order: a tool's op, so it runs on a worker and never holds drafts
        back (``Table.lookup`` bounds it)."""
        return self._invoke(COMMANDS["lookup"], (contexts,), {}, timeout_ms, sync=True)

    def lookup_async(self, contexts: Sequence, *, timeout_ms: int | None = None) -> cf.Future:
        """Future of ``lookup``."""
        return self._invoke(COMMANDS["lookup"], (contexts,), {}, timeout_ms, sync=False)

    def ingest_async(self, seqs: Sequence, key: str | None = None, *,
                     timeout_ms: int | None = None) -> cf.Future:
        """Future of ``ingest``.  Sent once (see the module doc); resend with the same ``key``."""
        if not self.tokenizer_fingerprint and not self._warned_unproven:
            self._warned_unproven = True  # once per client: tests and tools ingest ids too
            log.warning("ingest without tokenizer_fingerprint: nothing checks that these ids "
                        "come from the table's tokenizer (NgramClient(tokenizer_fingerprint="
                        "ngramd.wire.identity.tokenizer_fingerprint(PATH)))")
        return self._invoke(COMMANDS["ingest"], (seqs, key), {}, timeout_ms, sync=False)

    def ingest(self, seqs: Sequence, key: str | None = None, *,
               timeout_ms: int | None = None) -> tuple[int, int]:
        """Append sequences to the table; returns ``(first_seq, last_seq)`` once durable.
        While the daemon answers ``busy`` (its ingest log's backlog is over its bound), waits
        the reply's ``retry_ms`` and resends with the same key, for up to ``self.busy_wait_s``
        (0: never): nothing is lost, nothing counted twice."""
        key = key or uuid.uuid4().hex
        deadline = time.monotonic() + self.busy_wait_s
        while True:
            try:
                return self.ingest_async(seqs, key, timeout_ms=timeout_ms).result()
            except DaemonError as e:
                wait = busy_retry_s(e)
                if wait is None or time.monotonic() + wait > deadline:
                    raise
                time.sleep(wait)

    def report(self, drafted: dict, accepted: dict, keys: np.ndarray | None = None,
               policy: dict | None = None, *, timeout_ms: int | None = None) -> None:
        """Per-order counts of drafted and accepted tokens (for stats), the draft-length policy's
        figures since the previous report (``POLICY_FIGURES``; for stats), and optionally the
        kernel keys of the hot entries drafted from (they rank the next hot generation)."""
        return self._invoke(COMMANDS["report"], (drafted, accepted, keys, policy), {},
                            timeout_ms, sync=True)

    def report_async(self, drafted: dict, accepted: dict, keys: np.ndarray | None = None,
                     policy: dict | None = None, *,
                     timeout_ms: int | None = None) -> cf.Future:
        """Future of ``report``."""
        return self._invoke(COMMANDS["report"], (drafted, accepted, keys, policy), {},
                            timeout_ms, sync=False)

    def top(self, order: int, n: int = 20, *, timeout_ms: int | None = None) -> list:
        """The ``n`` most frequent contexts of ``order``: list of (key, total, tok, cnt); the table
        stores contexts as their 64-bit keys (``ngramd.kernels.hashing.key_hash``)."""
        return self._invoke(COMMANDS["top"], (order, n), {}, timeout_ms, sync=True)

    def top_async(self, order: int, n: int = 20, *, timeout_ms: int | None = None) -> cf.Future:
        """Future of ``top``."""
        return self._invoke(COMMANDS["top"], (order, n), {}, timeout_ms, sync=False)

    def rebuild_hot(self, full: bool = False, *, timeout_ms: int | None = None) -> int:
        """Build and publish a new hot generation now; the value is its number."""
        return self._invoke(COMMANDS["rebuild_hot"], (full,), {}, timeout_ms, sync=True)

    def rebuild_hot_async(self, full: bool = False, *,
                          timeout_ms: int | None = None) -> cf.Future:
        """Future of ``rebuild_hot``."""
        return self._invoke(COMMANDS["rebuild_hot"], (full,), {}, timeout_ms, sync=False)

    def flush(self, wait_s: float | None = None, *, timeout_ms: int | None = None) -> int:
        """Wait until everything ingested so far is counted; the value is the applied log seq.
        Ordered after the ingests the daemon received before it, even when pipelined.  Answers
        within ``wait_s``: ``storage`` as soon as counting cannot go on (a failing disk),
        ``timeout`` at the deadline (the default is below the client's own wait)."""
        return self._invoke(COMMANDS["flush"], (wait_s,), {}, timeout_ms, sync=True)

    def flush_async(self, wait_s: float | None = None, *,
                    timeout_ms: int | None = None) -> cf.Future:
        """Future of ``flush``."""
        return self._invoke(COMMANDS["flush"], (wait_s,), {}, timeout_ms, sync=False)

    def checksum(self, *, timeout_ms: int | None = None) -> dict:
        """Digests of the table's content that do not depend on how it was written: ``totals``
        (every context's key, order and total) and ``digest`` (with its candidates), ``rows``,
        ``capped_rows`` (``ColdStore.checksum``).  Hosts of a fleet that counted the same records
        agree; flush first to include what is still in the log."""
        return self._invoke(COMMANDS["checksum"], (), {}, timeout_ms, sync=True)

    def checksum_async(self, *, timeout_ms: int | None = None) -> cf.Future:
        """Future of ``checksum``."""
        return self._invoke(COMMANDS["checksum"], (), {}, timeout_ms, sync=False)

    def snapshot(self, to_dir: bool = False, *, timeout_ms: int | None = None) -> dict:
        """A consistent snapshot of the table (``ngramd/fleet.py``): to the fleet's JetStream
        object store, or with ``to_dir`` to ``[fleet] snapshot_dir``; the value is its manifest
        (``name``, ``bytes``, ``stream_seq``, ``applied``, ``stored``, ...)."""
        return self._invoke(COMMANDS["snapshot"], (to_dir,), {}, timeout_ms, sync=True)

    def snapshot_async(self, to_dir: bool = False, *,
                       timeout_ms: int | None = None) -> cf.Future:
        """Future of ``snapshot``."""
        return self._invoke(COMMANDS["snapshot"], (to_dir,), {}, timeout_ms, sync=False)

    def hot_curve(self, seqs: Sequence, max_mb: float | None = None, points: int = 8,
                  prompt_tokens: int = 64, max_len: int = 8, *,
                  timeout_ms: int | None = None) -> dict:
        """Drafting quality against the hot tier's size (``ngramd/hot/curve.py``): the sequences
        sent are replayed from token ``prompt_tokens`` on, ``max_len`` a step, against ``points``
        budgets halving from ``max_mb`` (at most 8x the hot budget: ``Table.hot_curve``).  The
        value: per budget, AL with the request-local table first and with the hot tier alone,
        acceptance and hit rates per order; ``recommended``: the smallest with 97% of the largest
        one's AL."""
        return self._invoke(COMMANDS["hot_curve"],
                            (seqs, max_mb, points, prompt_tokens, max_len), {}, timeout_ms,
                            sync=True)

    def hot_curve_async(self, seqs: Sequence, max_mb: float | None = None, points: int = 8,
                        prompt_tokens: int = 64, max_len: int = 8, *,
                        timeout_ms: int | None = None) -> cf.Future:
        """Future of ``hot_curve``."""
        return self._invoke(COMMANDS["hot_curve"],
                            (seqs, max_mb, points, prompt_tokens, max_len), {}, timeout_ms,
                            sync=False)

    def save_policy(self, key: str, state: bytes, *, timeout_ms: int | None = None) -> dict:
        """Store a generator's draft-length-policy state, opaque bytes of at most
        ``MAX_POLICY_STATE_BYTES``, under ``key`` (printable ASCII, at most
        ``MAX_POLICY_KEY_BYTES``: e.g. ``cpu:/models/qwen3-0.6b``), replacing the one stored there;
        a restarted generator starts from it (``load_policy``).  Durable in the table's RocksDB: it
        survives a restart and rides checkpoints and snapshots.  At most ``MAX_POLICY_STATES`` keys
        a table.  The value: ``key``, ``bytes`` (the state's size) and ``states`` (the keys stored
        now)."""
        return self._invoke(COMMANDS["save_policy"], (key, state), {}, timeout_ms, sync=True)

    def save_policy_async(self, key: str, state: bytes, *,
                          timeout_ms: int | None = None) -> cf.Future:
        """Future of ``save_policy``."""
        return self._invoke(COMMANDS["save_policy"], (key, state), {}, timeout_ms, sync=False)

    def load_policy(self, key: str, *, timeout_ms: int | None = None) -> dict:
        """The draft-length-policy state ``save_policy`` stored under ``key``: ``state`` (bytes)
        and ``saved_at`` (unix seconds), both None when none is stored there."""
        return self._invoke(COMMANDS["load_policy"], (key,), {}, timeout_ms, sync=True)

    def load_policy_async(self, key: str, *, timeout_ms: int | None = None) -> cf.Future:
        """Future of ``load_policy``."""
        return self._invoke(COMMANDS["load_policy"], (key,), {}, timeout_ms, sync=False)

    # ------------------------------------------------------------------ the connection
    def close(self) -> None:
        """Fail what is still pending with ``DaemonUnavailable``, stop the I/O thread."""
        if self._closed:
            return
        self._closed = True
        self._wake()
        self._thread.join(timeout=5)
        with self._sync_lock:
            for sock in self._sync_socks:  # other threads' too (see the class doc)
                sock.close(linger=0)
            self._sync_socks.clear()
            askers, self._askers = self._askers, []
        for a in askers:
            a.close()
        if self._thread.is_alive():  # not woken in 5 s: its poll still holds the pipe's fd
            log.warning("client I/O thread still running 5 s after close; its wake-up pipe "
                        "is left open")
            return
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ plumbing
    def _invoke(self, spec: Command, args: tuple, kw: dict, timeout_ms: int | None,
                sync: bool):
        """One call of a declared op: its message from the arguments, its value by its
        ``decode``.  Token ids only need to fit uint32 here: the daemon checks them against
        the vocab size."""
        msg = spec.message(*args, **kw)
        batch = P.pack_batch(msg.seqs) if spec.batch else None
        timeout_ms = timeout_ms or spec.timeout_ms
        if spec.wait_field and (msg.fields or {}).get(spec.wait_field) is None:
            msg = msg._replace(fields={**(msg.fields or {}),
                                       spec.wait_field: _server_wait_s(timeout_ms)})
        if sync and not spec.after_ingests:
            return self._call_sync(spec.name, msg.fields, batch, post=spec.decode,
                                   keys=msg.keys, timeout_ms=timeout_ms)
        # an ``after_ingests`` op (flush) leaves on the I/O thread's socket, behind the ingests
        # sent before it: on another socket it could reach the daemon first
        fut = self._call(spec.name, msg.fields, batch, post=spec.decode, keys=msg.keys,
                         timeout_ms=timeout_ms)
        return fut.result() if sync else fut

    def _call(self, op: str, fields: dict | None = None, batch=None, *,
              post: Callable = lambda r: r, timeout_ms: int | None = None,
              keys: np.ndarray | None = None) -> cf.Future:
        call = self._new_call(op, fields, batch, post=post, timeout_ms=timeout_ms, keys=keys)
        self._outbox.append(call)
        if self._io_error is not None:  # the I/O thread is gone: nobody would send it
            self._fail_outbox()
        else:
            self._wake()
        return call.future

    def _new_call(self, op: str, fields: dict | None = None, batch=None, *,
                  post: Callable = lambda r: r, timeout_ms: int | None = None,
                  keys: np.ndarray | None = None, future: cf.Future | None = None) -> _Call:
        """A call of ``op``, encoded and size-checked, not yet sent (by the I/O thread, or by
        an ``Asker``, which gives its own ``future``); its reply goes to ``_deliver``."""
        if self._closed:
            raise DaemonUnavailable("client is closed")
        req_id = next(self._ids)
        idem = op in P.IDEMPOTENT
        frames = P.encode_request(op, req_id, fields, batch, keys)
        self._check_size(op, frames)
        return _Call(op, req_id, frames, post, idem, self.retries if idem else 0,
                     (timeout_ms or self.timeout_ms) / 1000, future)

    def _fail_outbox(self) -> None:
        err = DaemonUnavailable(self._io_error or "client closed")
        while True:
            try:
                call = self._outbox.popleft()  # atomic: each call is failed by one thread
            except IndexError:
                return
            if not call.future.done():
                call.future.set_exception(err)

    def _check_size(self, op: str, frames: list) -> None:
        """Raise ``TooLarge`` for a request above the daemon's ``max_msg_bytes`` (module doc).
        The limit is learnt from ``info`` (one try) only when a frame is over 64 KiB:
        libzmq drops frames above 2 x max_msg_bytes + 64 KiB, so smaller ones always get the
        daemon's own answer."""
        sizes = [f.nbytes if isinstance(f, np.ndarray) else len(f) for f in frames]
        if self._max_msg_bytes is None and max(sizes) > P.MAX_HEADER_BYTES:
            try:
                self._call_sync("info", post=self._check_identity, tries=1)
            except (DaemonUnavailable, Timeout, DaemonError) as e:
                log.debug("could not learn the daemon's max_msg_bytes (%s); sending unchecked", e)
        limit = self._max_msg_bytes
        if limit is not None and sum(sizes) > limit:
            raise TooLarge(f"{op}: request of {sum(sizes)} bytes exceeds the daemon's "
                           f"max_msg_bytes of {limit}; send it in smaller batches")

    def _call_sync(self, op: str, fields: dict | None = None, batch=None, *,
                   post: Callable = lambda r: r, timeout_ms: int | None = None,
                   tries: int | None = None, keys: np.ndarray | None = None):
        """An idempotent call on the calling thread's own socket (same retry and failure rules
        as the I/O thread: resend up to ``retries`` times, a fresh socket after a silent
        attempt so a late reply can never be taken for a later request's)."""
        if op not in P.IDEMPOTENT:
            return self._call(op, fields, batch, post=post, timeout_ms=timeout_ms,
                              keys=keys).result()
        if self._closed:
            raise DaemonUnavailable("client is closed")
        timeout_s = (timeout_ms or self.timeout_ms) / 1000
        sent = heard = False
        tries = tries or self.retries + 1
        for attempt in range(tries):
            req_id = next(self._ids)
            frames = P.encode_request(op, req_id, fields, batch, keys)
            if attempt == 0:
                self._check_size(op, frames)  # may itself call info on this thread's socket
                sock = getattr(self._local, "sock", None) or self._thread_socket()
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
        raise self._no_reply(op, int(timeout_s * 1000), tries, sent, heard)

    def _thread_socket(self, replace: zmq.Socket | None = None) -> zmq.Socket:
        """A new socket for the calling thread.  Sockets of threads that have ended are closed
        here (their owner is done, so another thread may close them): a client shared by
        short-lived threads keeps about one socket per live thread, not one per thread ever."""
        with self._sync_lock:
            if replace is not None:
                self._sync_socks.pop(replace, None)
                replace.close(linger=0)
            if self._closed:
                raise DaemonUnavailable("client is closed")
            for old, owner in list(self._sync_socks.items()):
                if not owner.is_alive():
                    del self._sync_socks[old]
                    old.close(linger=0)
            sock = self._new_socket()
            self._sync_socks[sock] = threading.current_thread()
        self._local.sock = sock
        return sock

    def _hint(self) -> str:
        """What to check when a tcp connection never completes (a CURVE handshake that fails
        looks the same as no daemon to ZeroMQ)."""
        if not self.endpoint.startswith("tcp://"):
            return ""
        if self._curve:
            return " (CURVE: is the server key the daemon's, and is this client's key authorized?)"
        return " (a daemon with CURVE keys needs --server-key / NGRAM_SERVER_KEY)"

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
            old = ident.get("fingerprint_version", 1) != FINGERPRINT_VERSION
            raise IdentityMismatch(
                f"tokenizer mismatch: table {info.get('hot', {}).get('table', '?')!r} was built "
                f"with tokenizer fingerprint {theirs[:16]}..., this client uses {mine[:16]}...: "
                f"token ids would mean different things"
                + (" (the daemon records an older kind of fingerprint: upgrade it)" if old else ""))
        if mine and not theirs and self.endpoint not in _WARNED_UNRECORDED:
            _WARNED_UNRECORDED.add(self.endpoint)  # once per process, not once per info call
            log.warning("the table records no tokenizer fingerprint; cannot check identity")
        limit = info.get("server", {}).get("limits", {}).get("max_msg_bytes")
        if isinstance(limit, int):
            self._max_msg_bytes = limit
        return info

    # ------------------------------------------------------------------ I/O thread
    def _new_socket(self) -> zmq.Socket:
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)  # closing never waits for, or later delivers, stale requests
        s.setsockopt(zmq.IMMEDIATE, 1)  # queue only on live connections (see the module doc)
        s.setsockopt(zmq.RECONNECT_IVL, 100)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if self._curve:
            s.curve_serverkey, s.curve_publickey, s.curve_secretkey = self._curve
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
        except Exception as e:  # a bug here must not leave callers waiting forever
            log.exception("client I/O thread failed; asynchronous calls of this client fail "
                          "from now on")
            self._io_error = f"client I/O thread failed ({type(e).__name__}: {e})"
        finally:
            if self._io_error is None:
                self._io_error = "client closed"
            err = DaemonUnavailable(self._io_error)
            for call in list(unsent) + list(inflight.values()):
                if not call.future.done():
                    call.future.set_exception(err)
            self._fail_outbox()  # after _io_error is set: later calls fail themselves
            sock.close(linger=0)

    def _deliver(self, frames, inflight: dict) -> _Call | None:
        """Resolve the call of ``inflight`` (id -> ``_Call``) that ``frames`` answers, taking it
        out; the call, or None for a reply nobody waits for (the I/O thread's and every
        ``Asker``'s replies)."""
        try:
            reply = P.decode_reply(frames)
        except NgramError as e:
            log.warning("dropping an unreadable reply: %s", e)
            return None
        call = inflight.pop(reply.id, None)
        if call is None:  # a late answer to an attempt we already resent or gave up on
            return None
        try:
            call.future.set_result(_result(reply, call.post))
        except Exception as e:  # an error reply, or post-processing (identity check) raising
            call.future.set_exception(e)
        return call

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
        tries = self.retries + 1 if call.idempotent else 1
        return self._no_reply(call.op, int(call.timeout_s * 1000), tries, call.sent, heard,
                              call.idempotent)

    def _no_reply(self, op: str, ms: int, tries: int, sent: bool, heard: bool,
                  idempotent: bool = True) -> NgramError:
        """The error of a call given up on after ``tries`` attempts of ``ms`` each (both
        paths, the calling thread's and the I/O thread's): ``sent``, whether one attempt went
        out; ``heard``, whether the daemon said anything meanwhile (alive but slow)."""
        if not sent:
            return DaemonUnavailable(f"{op}: no connection to {self.endpoint} in {tries} "
                                     f"tries of {ms} ms; the request was not sent{self._hint()}")
        if not idempotent:
            return Timeout(f"{op}: sent to {self.endpoint} but not acknowledged within "
                           f"{ms} ms; it may or may not have been applied and was not resent "
                           f"(resend with the same key to be safe)")
        if not heard:
            return DaemonUnavailable(f"{op}: no answer from {self.endpoint} after "
                                     f"{tries} tries of {ms} ms", sent=True)
        return Timeout(f"{op}: no reply within {ms} ms after {tries} tries")


def check_endpoint(endpoint) -> None:
    """Raise ``BadInput`` unless ``endpoint`` is ``ipc://PATH``, ``tcp://HOST:PORT`` or
    ``inproc://NAME``.  Checked before any socket exists: libzmq would reject it inside the I/O
    thread, where the caller would only see every later call fail."""
    if not isinstance(endpoint, str):
        raise BadInput(f"endpoint must be a string, got {type(endpoint).__name__}")
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("ipc", "tcp", "inproc"):
        raise BadInput(f"bad endpoint {endpoint!r}: expected ipc://PATH or tcp://HOST:PORT")
    if not rest:
        raise BadInput(f"bad endpoint {endpoint!r}: nothing after {scheme}://")
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise BadInput(f"bad endpoint {endpoint!r}: expected tcp://HOST:PORT with a port "
                           f"1..65535")


# ---------------------------------------------------------------------------------------------
# reply post-processing (runs on the I/O thread; arrays are read-only views of the frames)
# ---------------------------------------------------------------------------------------------
def _server_wait_s(timeout_ms: int) -> float:
    """How long the daemon may wait for a caller that waits ``timeout_ms``: a tenth less (at
    most 1 s less), so the answer (``timeout`` at worst) arrives while the caller still
    listens, and a caller that gave up costs the daemon no longer than it waited itself."""
    t = timeout_ms / 1000
    return max(0.001, t - min(1.0, 0.1 * t))


def busy_retry_s(e: BaseException) -> float | None:
    """Seconds to wait before resending after ``e`` when it is the daemon's ``busy`` (its
    ``retry_ms``, at least 10 ms), else None."""
    if getattr(e, "code", None) != BUSY:
        return None
    return max(getattr(e, "retry_ms", None) or 100, 10) / 1000


def _result(reply: P.Reply, post: Callable):
    """The value of a reply, or the exception its error code maps to."""
    if not reply.ok:
        code, msg = str(reply.fields.get("code")), str(reply.fields.get("msg"))
        retry = reply.fields.get("retry_ms")
        retry = int(retry) if isinstance(retry, int) and 0 <= retry <= 600_000 else None
        raise DaemonUnavailable(msg) if code == UNAVAILABLE else DaemonError(code, msg, retry)
    return post(reply)


def _fields(r: P.Reply) -> dict:
    r.fields.pop("ok", None)
    r.fields.pop("v", None)
    r.fields.pop("id", None)
    return r.fields
