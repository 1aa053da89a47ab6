"""Every use of the daemon (``ngramd``) by a generator, behind one small adapter.

:class:`DaemonLink` wraps the ZeroMQ client (``ngram_client.NgramClient``) and the shared-memory
hot tier (``ngramd.hot.shm.HotReader``).  Its contract with the speculative loop (ours, and vLLM's
proposer): **no call raises and no call blocks longer than asked.**

The two halves fail apart:

* **In-process tiers never depend on the link.**  The hot and recent tiers are read from shared
  memory; once mapped they stay mapped while the daemon is slow, restarting or gone (the segments
  outlive it), and :meth:`refresh` remaps a newer generation whenever one is published.
* **The link** (asks for drafts from the whole table, feedback) has a state:
  ``up``; ``down`` (refused connections, or no answer of any kind for ``silence_s``); ``refused``
  (the table records another tokenizer: permanent, one warning that says what to do); ``off`` (no
  endpoint, or no client package).  A timed-out ask is a *late answer*, not a dead daemon: it
  counts towards ``silence_s`` and nothing else.  While down, a background thread probes the
  daemon with ``info`` (short timeouts, backoff to at most ``retry_s``), so the link is up again
  within about a second of the daemon answering, not at the next request after a fixed
  backoff (ARCHITECTURE §8.6: link drops on a busy host before this design).

**Feedback** (the outputs a generator hands back, and per-order acceptance reports) goes through
a bounded queue that the same thread drains, so :meth:`feedback` never waits:

* each ingest batch carries a key chosen once; a batch whose ack did not come (timeout,
  ``storage``, daemon draining) is resent with the *same* key, and the daemon answers a repeated
  key with the first ack, so a resend is never counted twice (a resend after a daemon *restart*
  may count once more: its key memory does not survive restarts);
* while the link is down, feedback waits in the queue (at most ``feedback_max_tokens`` tokens);
  past that the oldest sequences are dropped, counted and logged (once, then once a minute);
* a sequence longer than the daemon's ``max_tokens`` is sent in pieces (n-grams across a cut are
  lost; nothing is counted twice);
* reports are summed while they wait and sent once; a report that fails is dropped and counted
  (it adds counts: a blind resend could count twice);
* feedback never changes the link's state;
* the draft-length policy's state (:meth:`save_policy`) goes out after the feedback queued
  before it, the newest only; :meth:`load_policy` is the one call that waits for an answer (at
  a generator's start: a late answer is tried again for up to ``silence_s``, as a daemon busy
  at start answers late).

The counters (:meth:`stats`) say what happened: drafts asked and answered, link drops, feedback
sent, resent, refused and dropped.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any, Callable, Sequence

import numpy as np

from ngramd.wire.commands import Draft

log = logging.getLogger(__name__)

#: Error codes of a daemon's answer that mean it cannot be used now (it is shutting down).
UNREACHABLE_CODES = ("unavailable",)
#: Error codes of a refused ingest that a resend (same key) may cure: the disk, a drain, a stall.
RETRY_CODES = ("storage", "unavailable", "timeout", "busy")
#: Seconds between "feedback dropped" log lines.
DROP_LOG_S = 60.0


class DaemonLink:
    """The generator's view of one ngramd endpoint (or of none: ``endpoint=None``).

    ``timeout_ms`` bounds each client call; ``probe_ms`` bounds a reconnect probe; ``retry_s`` is
    the longest wait between probes while the daemon is down; ``silence_s`` is how long the
    daemon may leave every ask unanswered before the link counts as down; ``recheck_s`` is
    how often an up link checks that the daemon still serves this table (and the longest that
    feedback goes out unchecked).  ``client_options``
    go to ``ngram_client.NgramClient`` (``server_key``, ``client_key``); ``client_factory(
    endpoint, timeout_ms)`` replaces it in tests (with what the link uses of a client:
    ``asker()``, ``info``, ``ingest_async``, ``report_async``, ``close``; ``load_policy`` and
    ``save_policy_async`` where a test keeps a policy state).
    """

    def __init__(self, endpoint: str | None, *, timeout_ms: int = 1000, probe_ms: int = 250,
                 retry_s: float = 0.5, silence_s: float = 10.0, recheck_s: float = 2.0,
                 feedback_max_tokens: int = 4 << 20,
                 tokenizer_fingerprint: str | None = None,
                 client_options: dict | None = None,
                 client_factory: Callable[[str, int], Any] | None = None):
        self.endpoint = endpoint
        self.timeout_ms = int(timeout_ms)
        self.probe_ms = int(probe_ms)
        self.retry_s = float(retry_s)
        self.silence_s = float(silence_s)
        self.recheck_s = float(recheck_s)
        self._checked_at = 0.0  # the last info (identity) check
        self.feedback_max_tokens = int(feedback_max_tokens)
        # the model tokenizer's fingerprint (ngramd.wire.identity.hf_tokenizer_fingerprint): checked
        # against the table's at connect, before any token is sent
        self.fingerprint = tokenizer_fingerprint
        self._factory = client_factory
        self._client_options = dict(client_options or {})  # NgramClient(server_key=...)
        self._client: Any = None
        # what asks go through: the client's ``asker()`` (the drafting thread's own socket, no
        # hand-over to the client's I/O thread inside a step)
        self._asker: Any = None
        self.state = "off" if endpoint is None else "connecting"
        self._why = "no daemon configured" if endpoint is None else "not connected yet"
        self.info: dict = {}
        self._lock = threading.Condition()
        self._silent_since: float | None = None  # the oldest ask unanswered since a reply
        self._down_since = 0.0
        self._said_off = False
        self._check_refused: str | None = None  # an ask not sent: does anything listen?
        self._closed = False
        self._thread: threading.Thread | None = None
        # the hot tier: mapped by the drafting thread (HotReader is not thread-safe); the link
        # thread only says where it is (``_hot_want``)
        self._hot: Any = None
        self._hot_at: tuple | None = None  # (shm_dir, table) of the mapped reader
        self._hot_want: tuple | None = None  # (shm_dir, table, identity dict) from info
        self._next_hot_try = 0.0
        # feedback
        self._queue: collections.deque = collections.deque()  # uint32 arrays to ingest
        self._queued_tokens = 0
        self._batch: tuple | None = None  # (key, seqs, tokens) sent and not yet acknowledged
        self._drafted: collections.Counter = collections.Counter()
        self._accepted: collections.Counter = collections.Counter()
        self._policy: dict[str, float] = {}  # draft-length policy figures, summed until sent
        self._keys: list[np.ndarray] = []
        # the draft-length policy's state to keep in the table: (key, bytes), newest only
        self._policy_state: tuple[str, bytes] | None = None
        self._sending = False  # a report or a policy state sent, its ack awaited
        self._next_drop_log = 0.0
        self.counters: collections.Counter = collections.Counter()
        self.request_errors: collections.Counter = collections.Counter()  # code -> refusals

    # -- life cycle ------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        """True while the daemon answers (asks for drafts go out)."""
        return self.state == "up"

    @property
    def failures(self) -> int:
        """Failed or timed-out daemon calls (asks and probes)."""
        return self.counters["failures"]

    def connect(self) -> bool:
        """Try the daemon once now (waiting at most ``timeout_ms``) and start the link's thread,
        which keeps probing while it is down and drains the feedback queue.  Returns
        :attr:`available`.  Never raises; an absent daemon is logged once."""
        if self.state in ("off", "refused"):
            if self.endpoint is None and not self._said_off:
                self._said_off = True
                log.info("no daemon configured (--daemon ENDPOINT): drafting from the "
                         "request's own context only")
            return False
        if self.state != "up":
            self._probe(self.timeout_ms)
        self._start_thread()
        self.refresh()
        return self.available

    def refresh(self) -> None:
        """Called by the drafting thread between requests (or once per engine step): map the
        hot tier where the daemon says it is, remap a newly published generation.  Cheap (a
        load from the mapped control file) unless something changed; never blocks on the
        daemon."""
        if self.state == "refused" and self._hot is not None:
            _close_quietly(self._hot)  # a table of another tokenizer: no shared tier either
            self._hot = self._hot_at = None
        want = self._hot_want
        if want is not None and (self._hot is None or self._hot_at != want[:2]):
            if time.monotonic() >= self._next_hot_try:
                self._open_hot(want)
            if self._hot_at != want[:2]:
                return
        if self._hot is not None:
            try:
                self._hot.refresh()  # remaps when the daemon published a new generation
            except Exception as e:
                log.warning("hot tier refresh failed (%s); drafting without it", e)
                _close_quietly(self._hot)
                self._hot, self._hot_at = None, None

    @property
    def learn_prompts(self) -> bool:
        """Whether the table wants prompts fed back with outputs (``[table] learn_prompts``,
        from ``info``); False when the daemon does not say (older daemons, no daemon)."""
        return bool((self.info.get("feedback") or {}).get("learn_prompts", False))

    def close(self) -> None:
        """Stop the link's thread and close the client and the hot tier (feedback still queued
        is dropped and counted: call :meth:`flush` first to wait for it)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(2 * self.timeout_ms / 1e3, 1.0))
        with self._lock:
            lost = len(self._queue) + (len(self._batch[1]) if self._batch else 0)
            if lost:
                self.counters["feedback_lost_at_close"] += lost
                log.warning("closing the ngramd link with %d feedback sequences not "
                            "acknowledged: they are not in the table", lost)
            self._queue.clear()
            self._batch = None
            client, self._client, self._asker = self._client, None, None
        for resource in (client, self._hot):
            if resource is not None:
                _close_quietly(resource)
        self._hot = self._hot_at = None

    # -- drafting ----------------------------------------------------------------------------
    def hot_table(self):
        """The mapped hot tier (a ``HotReader``: drafters take its ``.tiers``) or None; it
        stays mapped while the link is down."""
        return self._hot

    def draft_async(self, context: np.ndarray | list, max_len: int,
                    budget_us: float | None = None) -> Future | None:
        """Ask for a draft after ``context`` (uint32), or one after each of a list of contexts
        in one message (``poll(future, t, index)`` takes each answer); None unless the link is
        up.  ``budget_us`` bounds the daemon's time on cold reads before it answers from its
        hot tier (ARCHITECTURE §7)."""
        asker = self._asker
        if asker is None or self.state != "up":
            return None
        contexts = context if isinstance(context, list) else [context]
        try:
            fut = asker.draft_async([np.ascontiguousarray(c, np.uint32) for c in contexts],
                                    int(max_len), budget_us=budget_us)
        except Exception as e:
            self._failed(e, "draft")
            return None
        self.counters["asked"] += 1
        if self._silent_since is None:
            self._silent_since = time.monotonic()
        fut.add_done_callback(self._ask_done)  # seen even when the drafter moved on
        return fut

    def _ask_done(self, fut: Future) -> None:
        """Every ask's outcome, on the client's thread: an answer, or a failure."""
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            self._failed(exc, "draft")
        else:
            self._heard()
            self.counters["answered"] += 1

    def poll(self, future: Future, timeout_s: float, index: int = 0) -> Draft | None:
        """The ``index``-th draft of a reply (a ``Draft``) if it arrives within ``timeout_s``.

        Returns None when the reply is late (the future stays usable), failed or empty.  What
        an answer or a failure says about the daemon is recorded when it arrives (``_ask_done``).
        """
        try:
            replies = future.result(timeout=max(timeout_s, 0.0))
        except Exception:  # late (the future stays usable), or failed (seen by _ask_done)
            return None
        if len(replies) <= index:
            return None
        r = replies[index]
        try:
            return Draft(np.asarray(r.tokens), np.asarray(r.orders), np.asarray(r.tiers),
                         np.asarray(r.conf, np.float32))
        except Exception as e:  # a reply of the wrong shape is a bug on the other side
            self._failed(e, "draft")
            return None

    # -- feedback ----------------------------------------------------------------------------
    def feedback(self, seqs: Sequence[np.ndarray], drafted: dict[int, int],
                 accepted: dict[int, int], keys: np.ndarray | None = None,
                 policy: dict[str, float] | None = None) -> None:
        """Queue finished sequences for ingest, and per-order draft/accept counts with the keys
        of the hot entries drafted from (they rank the next hot generation) and the
        draft-length policy's figures since the last call (``DraftLengthPolicy.figures``).
        Never waits."""
        seqs = [np.ascontiguousarray(s, np.uint32) for s in seqs if len(s)]
        has_keys = keys is not None and len(keys)
        with self._lock:
            if self.state in ("off", "refused"):
                self.counters["feedback_not_sent"] += len(seqs)
                return
            for s in seqs:
                self._queue.append(s)
                self._queued_tokens += s.shape[0]
            self.counters["feedback_queued"] += len(seqs)
            self._drafted.update({int(k): int(v) for k, v in drafted.items()})
            self._accepted.update({int(k): int(v) for k, v in accepted.items()})
            for k, v in (policy or {}).items():
                self._policy[k] = self._policy.get(k, 0.0) + float(v)
            if has_keys:
                self._keys.append(np.ascontiguousarray(keys, np.uint64))
            self._drop_overflow()
            self._lock.notify_all()
        self._start_thread()

    # -- the draft-length policy's state, kept in the table -------------------------------------
    def load_policy(self, key: str) -> tuple[bytes | None, float | None]:
        """The policy state the table keeps under ``key`` and when it was saved (unix s), or
        (None, None): nothing kept, or the daemon down, refusing or silent (logged).

        A late answer is not a failure: a daemon still busy at a generator's start (counting
        its corpus on a loaded host) answers after a second or more, and one try of
        ``timeout_ms`` logged "cannot load" for a daemon that answered 0.3 s later (issue
        52).  So the load is tried again, ``timeout_ms`` a try, for up to ``silence_s``: the
        patience the link gives any ask before it counts the daemon down.  Never raises."""
        client = self._client
        if not self.available or client is None:
            return None, None
        t0 = time.monotonic()
        tries = 0
        while True:
            tries += 1
            try:
                got = client.load_policy(key, timeout_ms=self.timeout_ms)
                break
            except Exception as e:
                waited = time.monotonic() - t0
                if _late(e, self.endpoint) and waited < self.silence_s and not self._closed:
                    self.counters["policy_loads_late"] += 1
                    self._sleep(0.1)
                    continue
                self.counters["policy_loads_failed"] += 1
                log.warning("cannot load the draft-length policy's state %r from ngramd after "
                            "%d tries in %.1f s (%s): starting from the priors", key, tries,
                            waited, e)
                return None, None
        self._heard()
        state = got.get("state") if isinstance(got, dict) else None
        return (state, got.get("saved_at")) if isinstance(state, bytes) else (None, None)

    def save_policy(self, key: str, state: bytes) -> None:
        """Keep ``state`` in the table under ``key`` (``ngramd``'s ``save_policy``), sent by
        the link's thread after the feedback queued before it; a newer state replaces one not
        sent yet, and one refused is counted and logged once, not resent.  Never waits."""
        with self._lock:
            if self.state in ("off", "refused"):
                return
            self._policy_state = (key, bytes(state))
            self._lock.notify_all()
        self._start_thread()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait up to ``timeout_s`` until every queued sequence is acknowledged and every report
        sent (tests, shutdown); True when nothing is left."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._pending_feedback():
                left = deadline - time.monotonic()
                if left <= 0 or self._closed or self.state in ("off", "refused"):
                    return not self._pending_feedback()
                self._lock.wait(min(left, 0.05))
        return True

    def stats(self) -> dict:
        """State and counters: what the link did (asks, answers, drops, feedback)."""
        with self._lock:
            batch = self._batch
            return {"state": self.state, "why": self._why,
                    # not acknowledged yet: queued, or sent and waiting for the daemon's ack
                    "queued_seqs": len(self._queue) + (len(batch[1]) if batch else 0),
                    "queued_tokens": self._queued_tokens + (batch[2] if batch else 0),
                    **self.counters, "request_errors": dict(self.request_errors)}

    def _pending_feedback(self) -> bool:
        return bool(self._queue or self._batch or self._drafted or self._keys
                    or self._policy or self._policy_state is not None or self._sending)

    def _drop_overflow(self) -> None:
        """Keep the queue within ``feedback_max_tokens``: the oldest sequences go first."""
        dropped = tokens = 0
        while self._queued_tokens > self.feedback_max_tokens and self._queue:
            s = self._queue.popleft()
            self._queued_tokens -= s.shape[0]
            dropped += 1
            tokens += s.shape[0]
        if not dropped:
            return
        self.counters["feedback_dropped"] += dropped
        self.counters["feedback_dropped_tokens"] += tokens
        now = time.monotonic()
        if now >= self._next_drop_log:
            self._next_drop_log = now + DROP_LOG_S
            log.warning("feedback queue full (%d tokens; ngramd %s: %s): %d sequences (%d "
                        "tokens) dropped so far, oldest first", self.feedback_max_tokens,
                        self.state, self._why, self.counters["feedback_dropped"],
                        self.counters["feedback_dropped_tokens"])

    # -- the link's thread: probes while down, sends feedback while up -------------------------
    def _start_thread(self) -> None:
        with self._lock:
            if self._thread is not None or self._closed or self.state in ("off", "refused"):
                return
            self._thread = threading.Thread(target=self._run, name="ngram-link", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        backoff = 0.05
        while True:
            with self._lock:
                if self._closed or self.state in ("off", "refused"):
                    return
                up = self.state == "up"
                why, self._check_refused = self._check_refused, None
                due = time.monotonic() - self._checked_at >= self.recheck_s
                if up and why is None and not due and not self._pending_feedback():
                    self._lock.wait(min(1.0, self.recheck_s))
                    continue
            if up and why is not None:
                from ngramd.wire.protocol import connect_refusal  # lazy, as ngram_client

                refused = connect_refusal(self.endpoint)
                if refused:
                    self._set_state("down", f"{why}; {refused}")
                    continue
            if up and due:  # the same daemon, the same table?
                self._probe(self.probe_ms, recheck=True)
                continue
            if not up:
                if not self._probe(self.probe_ms):
                    self._sleep(backoff)
                    backoff = min(backoff * 2, max(self.retry_s, 0.05))
                continue
            backoff = 0.05
            try:
                self._send_feedback()
            except Exception:  # a bug here must not end the thread and strand the queue
                log.exception("feedback sender failed; retrying")
                self._sleep(1.0)

    def _sleep(self, seconds: float) -> None:
        with self._lock:
            if not self._closed:
                self._lock.wait(seconds)

    def _probe(self, timeout_ms: int, recheck: bool = False) -> bool:
        """Ask the daemon for ``info`` (the identity check included); True when it answered
        and the link is up.  ``recheck``: the link is up and this is the periodic check
        (every ``recheck_s``, and before feedback goes out after a quiet spell) that the
        daemon is still the one of this table: a daemon restarted on another table at the
        same endpoint is refused before anything is sent to it; a check that fails is a late
        answer (the asks' silence rule decides), not a dead daemon."""
        client = self._client
        self._checked_at = time.monotonic()
        try:
            if client is None:
                client = self._make_client()
                self._set_client(client)
            info = client.info(timeout_ms=timeout_ms)
        except Exception as e:
            self.counters["failures"] += 1
            code = getattr(e, "code", None)
            if code == "identity_mismatch":
                self._refuse(e)
            elif isinstance(e, ImportError):
                self._set_state("off", f"the ngram_client package does not import ({e})")
            elif recheck:
                self.counters["late"] += 1
            else:
                self._set_state("down", f"{type(e).__name__}: {e}")
            return False
        self.info = dict(info) if isinstance(info, dict) else {}
        hot = self.info.get("hot")
        if isinstance(hot, dict) and hot.get("shm_dir") and hot.get("table"):
            self._hot_want = (str(hot["shm_dir"]), str(hot["table"]), self.info.get("identity"))
        self._heard()
        self._set_state("up", "answering")
        return True

    def _make_client(self):
        if self._factory is not None:
            return self._factory(self.endpoint, self.timeout_ms)
        import ngram_client  # ImportError: the link is off (logged by _probe)

        # no resends: a late draft is not worth a second copy of the ask, and a probe that
        # failed is repeated by the probe loop anyway
        client = ngram_client.NgramClient(self.endpoint, timeout_ms=self.timeout_ms, retries=0,
                                          **self._client_options)
        client.tokenizer_fingerprint = self.fingerprint  # checked by every info(), not here
        return client

    def _set_client(self, client) -> None:
        self._asker = client.asker()
        self._client = client

    def _send_feedback(self) -> None:
        client = self._client
        if time.monotonic() - self._checked_at >= self.recheck_s:
            if not self._probe(self.probe_ms, recheck=True):
                self._sleep(0.1)
                return
        with self._lock:
            if self._batch is None and self._queue:
                self._batch = self._next_batch()
            batch = self._batch
            report = None
            if batch is None and (self._drafted or self._keys or self._policy):
                keys = np.concatenate(self._keys) if self._keys else None
                report = (dict(self._drafted), dict(self._accepted), keys, self._policy)
                self._drafted, self._accepted, self._keys = (collections.Counter(),
                                                             collections.Counter(), [])
                self._policy = {}
            save = None
            if batch is None and report is None and self._policy_state is not None:
                save, self._policy_state = self._policy_state, None
            self._sending = report is not None or save is not None
        if batch is not None:
            self._send_batch(client, batch)
        elif save is not None:
            self._send_once(lambda: client.save_policy_async(*save), "save_policy",
                            "policy_saves", "policy_saves_failed")
        elif report is not None:
            self._send_once(lambda: client.report_async(*report), "report", "reports_sent",
                            "reports_dropped")

    def _send_once(self, call: Callable[[], Future], what: str, sent: str, lost: str) -> None:
        """Send a report or a policy state (``call``) and wait for its ack; one that fails is
        counted (``lost``) and not resent (a report adds counts: a blind resend could count
        twice; a policy state is replaced by the next one)."""
        try:
            call().result(timeout=self.timeout_ms / 1e3 + 1.0)
            self.counters[sent] += 1
        except Exception as e:
            self.counters[lost] += 1
            self._refused_request(e, what)
        with self._lock:
            self._sending = False
            self._lock.notify_all()

    def _next_batch(self) -> tuple:
        """Sequences from the head of the queue that fit one ingest (the daemon's limits)."""
        limits = (self.info.get("server") or {}).get("limits") or {}
        max_seqs = int(limits.get("max_batch") or 4096)
        max_tokens = int(limits.get("max_tokens") or 0) or (
            int(limits.get("max_msg_bytes") or 64 << 20) // 8)
        seqs, tokens = [], 0
        while self._queue and len(seqs) < max_seqs:
            s = self._queue[0]
            if s.shape[0] > max_tokens:  # a very long request: in pieces
                self._queue.popleft()
                self._queue.extendleft(reversed([s[i:i + max_tokens] for i in
                                                 range(0, s.shape[0], max_tokens)]))
                self.counters["feedback_split"] += 1
                continue
            if seqs and tokens + s.shape[0] > max_tokens:
                break
            seqs.append(self._queue.popleft())
            tokens += s.shape[0]
        self._queued_tokens -= tokens
        return uuid.uuid4().hex, seqs, tokens

    def _send_batch(self, client, batch: tuple) -> None:
        key, seqs, tokens = batch
        try:
            client.ingest_async(seqs, key=key).result(timeout=2 * self.timeout_ms / 1e3 + 1.0)
        except Exception as e:
            code = getattr(e, "code", None)
            if isinstance(e, TimeoutError) or code in RETRY_CODES or isinstance(
                    e, ConnectionError):
                self.counters["feedback_resent"] += 1  # same key: counted once by the daemon
                log.debug("feedback batch %s not acknowledged (%s); resending", key, e)
                self._sleep(max(getattr(e, "retry_ms", None) or 200, 10) / 1000)  # busy: its hint
                return
            self.counters["feedback_refused"] += len(seqs)
            self._refused_request(e, "ingest")
            if code == "identity_mismatch":
                self._refuse(e)
        else:
            self._heard()
            self.counters["feedback_sent"] += len(seqs)
            self.counters["feedback_sent_tokens"] += tokens
        with self._lock:
            self._batch = None
            self._lock.notify_all()

    # -- state -------------------------------------------------------------------------------
    def _heard(self) -> None:
        self._silent_since = None

    def _failed(self, exc: BaseException, what: str) -> None:
        """A failed ask.  An ask that could not be sent (nothing listens) takes the link down at
        once; one sent and not answered is a late answer, and takes it down only after
        ``silence_s`` without any answer; a request the daemon refused (``bad_input`` ...) shows
        it is there, so the link stays up."""
        self.counters["failures"] += 1
        code = getattr(exc, "code", None)
        if code == "identity_mismatch":
            self._refuse(exc)
        elif code in UNREACHABLE_CODES and not isinstance(exc, ConnectionError):
            self._set_state("down", f"{what}: the daemon said {exc}")  # e.g. shutting down
        elif isinstance(exc, (TimeoutError, ConnectionError)) or code == "timeout":
            # late.  Not even sent: a dead daemon, or one alive but kept from running (ZeroMQ
            # cannot finish its handshake either way): the link's thread tells them apart
            self.counters["late"] += 1
            since = self._silent_since
            silent = time.monotonic() - since if since is not None else 0.0
            if silent >= self.silence_s:
                self._set_state("down", f"no answer for {silent:.1f} s")
            elif isinstance(exc, ConnectionError) and not getattr(exc, "sent", False):
                with self._lock:
                    self._check_refused = f"{what} failed: {exc}"
                    self._lock.notify_all()
        else:
            self._refused_request(exc, what)

    def _refused_request(self, exc: BaseException, what: str) -> None:
        code = getattr(exc, "code", None) or type(exc).__name__
        with self._lock:
            self.request_errors[code] += 1
            first = self.request_errors[code] == 1
        if first:
            log.warning("ngramd refused a %s request (%s); the link stays up, further "
                        "'%s' refusals are counted, not logged", what, exc, code)

    def _refuse(self, exc: BaseException) -> None:
        self._set_state("refused", f"identity_mismatch: {exc}")

    def _set_state(self, state: str, why: str) -> None:
        with self._lock:
            old, self.state, self._why = self.state, state, why
            if state == old:
                return
            if state == "down":
                self._down_since = time.monotonic()
                self.counters["link_drops" if old == "up" else "connect_failures"] += 1
            self._lock.notify_all()
            queued = len(self._queue)
        where = f"ngramd at {self.endpoint}"
        if state == "up":
            if old == "down":
                log.info("%s answering again after %.1f s; %d feedback sequences queued meanwhile",
                         where, time.monotonic() - self._down_since, queued)
            else:
                log.info("%s connected%s", where,
                         " (hot tier in shared memory)" if self._hot_want else "")
        elif state == "down":
            log.warning("%s unavailable (%s): drafting from the in-process tiers (request, and "
                        "the hot and recent tiers if mapped); feedback is queued; probing at "
                        "least every %.1f s", where, why, self.retry_s)
        elif state == "refused":
            log.warning("%s refused: %s. Nothing is sent to it and it is not asked again; "
                        "drafting from the request's own context (and no shared tier). To "
                        "draft from a shared table, run a daemon whose table records this "
                        "model's tokenizer (ngramd --tokenizer MODEL_DIR_OR_TOKENIZER_JSON) "
                        "and point this generator at it", where, why)
            self._hot_want = None  # the drafting thread unmaps it (refresh)
        elif state == "off":
            log.info("%s: %s: drafting from the request's own context only", where, why)

    def _open_hot(self, want: tuple) -> None:
        """Map the hot tier at ``want`` (same host only); on failure retry in a second."""
        self._next_hot_try = time.monotonic() + 1.0
        shm_dir, table, ident = want
        try:
            from ngramd.hot.shm import HotReader
            from ngramd.wire.identity import TableIdentity

            reader = HotReader(shm_dir, table, identity=TableIdentity(**ident)
                               if isinstance(ident, dict) else None)
        except Exception as e:  # not published yet, another host, permissions, identity
            log.info("hot tier %s/%s not mapped (%s); retrying", shm_dir, table, e)
            return
        if self._hot is not None:
            _close_quietly(self._hot)
        self._hot, self._hot_at = reader, want[:2]


def _late(exc: BaseException, endpoint: str) -> bool:
    """True when a call failed for want of an answer in time: sent and not answered, or not
    sent while something accepts connections at ``endpoint`` (a daemon alive but kept from
    running: the handshake waits for it) -- a busy daemon, not a refusal or none there."""
    if isinstance(exc, ConnectionError):
        if getattr(exc, "sent", False):
            return True
        from ngramd.wire.protocol import connect_refusal  # lazy, as ngram_client

        return connect_refusal(endpoint) is None
    return isinstance(exc, TimeoutError) or getattr(exc, "code", None) == "timeout"


def _close_quietly(resource: Any) -> None:
    try:
        resource.close()
    except Exception as e:
        log.debug("closing %s: %s", type(resource).__name__, e)
