"""Every use of the daemon (``ngramd``) by the generator, behind one small adapter.

:class:`DaemonLink` wraps the ZeroMQ client (``ngram_client.NgramClient``) and the shared-memory
hot tier (``ngramd.hotshm.HotReader``).  Its contract with the speculative loop is simple: **no call
raises and no call blocks longer than asked.**  When the client package is missing, the daemon
does not answer or dies mid-run, the link says so once in the log, drops to local-only drafting
and tries to reconnect at the start of a later request (every ``retry_s`` seconds).

Nothing here waits on the daemon: drafts are asked with ``draft_async`` and collected with
``poll(future, timeout_s)`` inside the caller's budget; ingest and report are fire-and-forget.

Only transport failures (``DaemonUnavailable``, ``Timeout``) and a table whose tokenizer differs
(``identity_mismatch``, found at connect from the fingerprint the link is given) take the link
down.  A request the daemon refuses (``bad_input`` and the like) is logged once per code and
counted in ``request_errors``; the link stays up, since the daemon is plainly there.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Future, wait
from typing import Any, Callable, Sequence

import numpy as np

log = logging.getLogger(__name__)

#: Consecutive timeouts after which the daemon counts as down (one slow reply is not an outage).
MAX_TIMEOUTS = 3
#: Error codes that mean the daemon cannot be used: not reachable, or a table whose identity
#: (tokenizer) differs from this generator's.  Any other code is a refused *request*.
LINK_DOWN_CODES = ("unavailable", "timeout", "identity_mismatch")


class DaemonLink:
    """The generator's view of one ngramd endpoint (or of none: ``endpoint=None``).

    ``timeout_ms`` bounds each client call (``info`` at connect is the only one we wait for);
    ``client_factory(endpoint, timeout_ms)`` replaces ``ngram_client.NgramClient`` in tests.
    """

    def __init__(self, endpoint: str | None, *, timeout_ms: int = 1000, retry_s: float = 30.0,
                 tokenizer_fingerprint: str | None = None,
                 client_factory: Callable[[str, int], Any] | None = None):
        self.endpoint = endpoint
        self.timeout_ms = timeout_ms
        self.retry_s = retry_s
        # the model tokenizer's fingerprint (ngramd.identity.hf_tokenizer_fingerprint): checked
        # against the table's at connect, before any token is sent (identity_mismatch: local only)
        self.fingerprint = tokenizer_fingerprint
        self._factory = client_factory
        self._client: Any = None
        self._hot: Any = None
        self._timeouts = 0
        self._next_try = 0.0
        self._next_hot_try = 0.0
        self._lock = threading.Lock()  # future callbacks run on the client's threads
        self._inflight: set[Future] = set()  # feedback not yet acknowledged
        self._said_down = False
        self.info: dict = {}
        self.failures = 0  # counter: every failed or timed-out daemon call
        self.request_errors: collections.Counter = collections.Counter()  # code -> refusals

    # -- life cycle ------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        """True while connected to a daemon that answers."""
        return self._client is not None

    def connect(self) -> bool:
        """Connect (or reconnect) and map the hot tier; returns :attr:`available`.

        Never raises: a missing client package, an absent daemon or a bad reply leave the link
        in local-only mode, logged once.
        """
        if self.endpoint is None:
            self._say_down("no daemon configured (--daemon ENDPOINT)")
            return False
        if self._client is not None:
            return True
        self._next_try = time.monotonic() + self.retry_s
        factory = self._factory
        if factory is None:
            try:
                import ngram_client
            except Exception as e:  # ImportError, or a broken install
                self._say_down(f"the ngram_client package does not import ({e})")
                return False

            def factory(ep, ms):
                return ngram_client.NgramClient(ep, timeout_ms=ms,
                                                tokenizer_fingerprint=self.fingerprint)

        client = None
        try:
            client = factory(self.endpoint, self.timeout_ms)
            info = client.info()
        except Exception as e:
            self.failures += 1
            if client is not None:
                _close_quietly(client)
            if getattr(e, "code", None) == "identity_mismatch":
                # no token is sent to a table of another tokenizer: local drafting only, one
                # warning (retried every retry_s, in case the daemon is restarted on another table)
                self._say_down(f"identity_mismatch: {e}; nothing is sent to it")
            else:
                self._say_down(f"{type(e).__name__}: {e}")
            return False
        self.info = dict(info) if isinstance(info, dict) else {}
        self._client = client
        self._timeouts = 0
        self._hot = self._open_hot()
        log.info("ngramd at %s connected%s", self.endpoint,
                 " (hot tier mapped)" if self._hot is not None else "")
        self._said_down = False
        return True

    @property
    def learn_prompts(self) -> bool:
        """Whether the table wants prompts fed back with outputs (``[table] learn_prompts``,
        from ``info``); False when the daemon does not say (older daemons, no daemon)."""
        return bool((self.info.get("feedback") or {}).get("learn_prompts", False))

    def maybe_reconnect(self) -> None:
        """Called between requests: retry a lost daemon or an unmapped hot tier every
        ``retry_s``; refresh the hot tier (remap a new generation)."""
        if self._client is None:
            if self.endpoint is not None and time.monotonic() >= self._next_try:
                self.connect()
            return
        if self._hot is None:
            if time.monotonic() >= self._next_hot_try:
                self._hot = self._open_hot()
            return
        try:
            self._hot.refresh()  # remaps when the daemon published a new generation
        except Exception as e:
            log.warning("hot tier refresh failed (%s); drafting without it", e)
            self._hot = None

    def close(self) -> None:
        client, hot, self._client, self._hot = self._client, self._hot, None, None
        for resource in (client, hot):
            if resource is not None:
                _close_quietly(resource)

    # -- drafting ----------------------------------------------------------------------------
    def hot_table(self):
        """The mapped hot tier (``.slots``, ``.max_probe``, ``.n_min``, ``.n_max``) or None."""
        return self._hot

    def draft_async(self, context: np.ndarray, max_len: int,
                    budget_us: float | None = None) -> Future | None:
        """Ask for a draft after ``context`` (uint32); None when the daemon is unavailable.

        ``budget_us`` bounds the daemon's time on cold reads before it answers from its hot
        tier (DESIGN §7)."""
        client = self._client
        if client is None:
            return None
        try:
            return client.draft_async([np.ascontiguousarray(context, np.uint32)], int(max_len),
                                      budget_us=budget_us)
        except Exception as e:
            self._failed(e, "draft")
            return None

    def poll(self, future: Future, timeout_s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                              np.ndarray] | None:
        """``(tokens, orders, tiers, conf)`` of a draft reply if it arrives within ``timeout_s``.

        Returns None when the reply is late (the future stays usable), failed or empty.
        """
        try:
            replies = future.result(timeout=max(timeout_s, 0.0))
        except Exception as e:
            if not future.done():  # no reply yet: late, not failed
                return None
            self._failed(e, "draft")  # the call itself failed (a client Timeout included)
            return None
        self._timeouts = 0
        if not replies:
            return None
        r = replies[0]
        try:
            return (np.asarray(r.tokens, np.int64), np.asarray(r.orders, np.int64),
                    np.asarray(r.tiers, np.int64), np.asarray(r.conf, np.float32))
        except Exception as e:  # a reply of the wrong shape is a bug on the other side
            self._failed(e, "draft")
            return None

    # -- feedback --------------------------------------------------------------------------
    def feedback(self, seqs: Sequence[np.ndarray], drafted: dict[int, int],
                 accepted: dict[int, int], keys: np.ndarray | None = None) -> None:
        """Ingest finished sequences and report per-order draft/accept counts and the keys of
        the hot entries drafted from (they rank the next hot generation); never waits."""
        client = self._client
        if client is None:
            return
        seqs = [np.ascontiguousarray(s, np.uint32) for s in seqs if len(s)]
        calls = []
        if seqs:
            calls.append(("ingest", lambda: client.ingest_async(seqs)))
        has_keys = keys is not None and len(keys)
        if drafted or has_keys:
            calls.append(("report", lambda: client.report_async(
                dict(drafted), dict(accepted),
                np.ascontiguousarray(keys, np.uint64) if has_keys else None)))
        for what, call in calls:
            try:
                fut = call()
            except Exception as e:
                self._failed(e, what)
                return
            with self._lock:
                self._inflight.add(fut)
            fut.add_done_callback(lambda f, w=what: self._on_done(f, w))

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait up to ``timeout_s`` for feedback still in flight (tests, shutdown); True when
        none is left.  Failures were already handled by the callbacks."""
        with self._lock:
            pending = list(self._inflight)
        done, not_done = wait(pending, timeout=timeout_s)
        return not not_done

    # -- failure handling ------------------------------------------------------------------
    def _on_done(self, fut: Future, what: str) -> None:
        with self._lock:
            self._inflight.discard(fut)
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            self._failed(exc, what)

    def _failed(self, exc: BaseException, what: str) -> None:
        """Count a failed call.  Only transport failures (unreachable, timed out) and an
        identity mismatch take the link down; a request the daemon refused (``bad_input``,
        ``too_large``, ``storage``, ...) shows the daemon is there and answering, so the
        link stays up and the code is logged once and counted in ``request_errors``."""
        code = getattr(exc, "code", None)
        if (isinstance(code, str) and code not in LINK_DOWN_CODES
                and not isinstance(exc, (TimeoutError, ConnectionError))):
            with self._lock:
                self.failures += 1
                self.request_errors[code] += 1
                first = self.request_errors[code] == 1
            if first:
                log.warning("ngramd refused a %s request (%s); the link stays up, further "
                            "'%s' refusals are counted, not logged", what, exc, code)
            return
        with self._lock:
            self.failures += 1
            if isinstance(exc, TimeoutError):  # ngram_client.Timeout is one too
                self._timeouts += 1
                if self._timeouts < MAX_TIMEOUTS:
                    log.debug("ngramd %s timed out (%d in a row)", what, self._timeouts)
                    return
            client, self._client, self._hot = self._client, None, None
            self._next_try = time.monotonic() + self.retry_s
        if client is not None:
            _close_quietly(client)
            self._said_down = False
        self._say_down(f"{what} failed: {type(exc).__name__}: {exc}")

    def _say_down(self, why: str) -> None:
        if not self._said_down:
            self._said_down = True
            where = f"ngramd at {self.endpoint}" if self.endpoint else "ngramd"
            if self.endpoint is None:
                log.info("%s: drafting from the request's own context only", why)
            else:
                log.warning("%s unavailable (%s): drafting from the request's own context only; "
                            "retrying every %.0f s", where, why, self.retry_s)

    def _open_hot(self):
        """Map the hot tier named by the daemon's ``info`` (same host only), or None."""
        self._next_hot_try = time.monotonic() + self.retry_s
        hot_info = self.info.get("hot")
        if not isinstance(hot_info, dict) or not hot_info.get("shm_dir") or not hot_info.get("table"):
            return None
        try:
            from ngramd.hotshm import HotReader
            from ngramd.identity import TableIdentity

            ident = self.info.get("identity")
            return HotReader(hot_info["shm_dir"], hot_info["table"],
                             identity=TableIdentity(**ident) if isinstance(ident, dict) else None)
        except Exception as e:  # not published yet, another host, permissions, identity
            log.info("hot tier %s/%s not mapped (%s); asking the daemon on local misses",
                     hot_info.get("shm_dir"), hot_info.get("table"), e)
            return None


def _close_quietly(resource: Any) -> None:
    try:
        resource.close()
    except Exception as e:
        log.debug("closing %s: %s", type(resource).__name__, e)
