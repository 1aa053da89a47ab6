"""``ngramd``: the daemon that serves one n-gram table over ZeroMQ.

One main thread owns the ROUTER socket and answers the fast ops inline (ping, info, stats,
draft, report): a draft costs microseconds, and a thread hop would cost more than the
work.  Ops that may take long go to worker threads so they never hold a draft reply back:

* ``ingest`` -> one ingest thread (keeps the arrival order; the ack waits for durability of the
  log only, counting happens on the Table's own writer thread);
* ``flush``, ``rebuild_hot``, ``top``, ``lookup`` (cold reads of every order) -> a small
  pool.  A ``flush`` first waits for the ingests received before it, so "ingest then flush"
  means what it says even when pipelined.

Workers hand finished replies back through a deque plus one byte on a wake pipe; the same pipe
carries signals (SIGTERM/SIGINT -> ``T``, SIGHUP -> ``H``), so shutdown and reload are messages
handled by the main loop: one code path, no work inside signal handlers.

Life cycle: open the table (replays the log), bind, ``READY=1``; on SIGTERM ``STOPPING=1``,
answer new requests ``unavailable``, let queued jobs finish (``drain_s``), flush, close.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import json
import logging
import os
import signal
import socket
import stat
import sys
import threading
import time
import traceback
import uuid
from dataclasses import fields, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import zmq

from . import protocol as P
from .config import DaemonConfig, ServerConfig, load_daemon_config, to_toml
from .errors import INTERNAL, UNAVAILABLE, BadInput, NgramError, TooLarge
from .constants import EMPTY_TOKEN, MAX_ORDER
from .stats import LatencyHistogram

log = logging.getLogger("ngramd.server")

#: per-peer queue of received messages; with ``max_msg_bytes`` it bounds what one client can
#: make the daemon hold (clients that pipeline deeper are pushed back by ZeroMQ, not dropped)
RCVHWM = 128
_MAX_KEY_BYTES = 256


class Server:
    """Serves ``table`` on ``cfg.endpoints``.  ``serve()`` runs the main loop in the calling
    thread until ``stop()`` (or SIGTERM when ``install_signals()`` was called)."""

    def __init__(self, table, cfg: ServerConfig, *, reload=None):
        self.table = table
        self.cfg = cfg
        self._reload_fn = reload  # () -> ServerConfig, for SIGHUP
        self.vocab_size = table.identity.vocab_size
        self.instance = uuid.uuid4().hex[:12]  # lets clients notice a restart
        self.started = time.time()
        self.ctx = zmq.Context.instance()
        self.router = self._new_router()  # ipc, inproc and (insecure) tcp endpoints
        # every ROUTER the main loop polls: ``router``, then the CURVE one if tcp has keys
        self._sockets: list[zmq.Socket] = [self.router]
        self._auth = None  # ZAP handler thread when curve_authorized_dir is set
        self._set_maxmsgsize()
        self.endpoints: list[str] = []
        self._ipc_paths: list[tuple[Path, int, int]] = []  # (path, st_dev, st_ino) we bound
        # wake pipe: worker replies and signals; non-blocking so a signal handler never blocks
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._done: collections.deque = collections.deque()
        self._pending = 0
        self._draining = False
        self._ingest_q: collections.deque = collections.deque()
        self._ingest_cv = threading.Condition()
        self._ingest_submitted = 0  # main thread only
        self._ingest_finished = 0  # guarded by _ingest_cv
        self._dedup: collections.OrderedDict = collections.OrderedDict()  # ingest thread only
        self._ingest_thread = threading.Thread(target=self._ingest_loop, name="ngramd-ingest",
                                               daemon=True)
        self._pool = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="ngramd-slow")
        self._jobs: set = set()  # futures of slow jobs queued or running (main thread)
        self._stopping = threading.Event()  # set at shutdown: slow jobs stop waiting
        self._health_state = "ok"
        self._health_next = 0.0
        self._metrics: ThreadingHTTPServer | None = None
        self._old_handlers: dict = {}
        # server-side figures: requests per op, errors per code and per op, latency per op (µs)
        self.requests = collections.Counter()
        self.errors = collections.Counter()
        self.op_errors = collections.Counter()
        self.latency = collections.defaultdict(LatencyHistogram)
        self._last_request = time.monotonic()
        self.stall = StallMonitor(busy=self._is_busy)  # read by the metrics collector
        self._inline = {"ping": self._op_ping, "info": self._op_info, "stats": self._op_stats,
                        "draft": self._op_draft, "report": self._op_report}

    # ------------------------------------------------------------------ setup
    def bind(self) -> list[str]:
        """Bind every configured endpoint; returns the bound endpoints (``tcp://...:*`` resolved).

        ipc: an existing path is taken over only when it is a stale socket (``claim_ipc_path``);
        libzmq itself would unlink whatever is there, a live daemon's socket included.

        tcp with ``curve_secret_key``: bound on a second ROUTER that is a CURVE server.
        ZeroMQ sets the security mechanism per socket, and ipc clients (this host, trusted by
        the socket file's permissions) must keep working without keys; the main loop polls
        both sockets and answers on the one a request came from."""
        for ep in self.cfg.endpoints:  # loopback-only and keys-or-insecure: checked in config
            sock = self.router
            if ep.startswith("ipc://"):
                path = Path(ep[len("ipc://"):])
                path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
                claim_ipc_path(path)
            elif ep.startswith("tcp://") and self.cfg.curve_secret_key:
                sock = self._sockets[1] if len(self._sockets) > 1 else self._curve_router()
            sock.bind(ep)
            bound = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
            if ep.startswith("ipc://"):
                os.chmod(path, self.cfg.socket_mode)  # umask made it 0660 already; be explicit
                st = os.stat(path)
                self._ipc_paths.append((path, st.st_dev, st.st_ino))
            self.endpoints.append(bound)
            log.info("listening on %s%s", bound, " (CURVE)" if sock is not self.router else "")
        return self.endpoints

    def close_sockets(self) -> None:
        """Close the sockets and remove the ipc socket files this daemon bound -- only those
        still the very files it bound (same device and inode): a path another daemon or an
        operator has taken over since is left alone.  A crash leaves the files; the next
        bind finds them stale."""
        for sock in self._sockets:
            sock.close()
        if self._auth is not None:
            self._auth.stop()
        for path, dev, ino in self._ipc_paths:
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if (st.st_dev, st.st_ino) == (dev, ino):
                path.unlink(missing_ok=True)
            else:
                log.warning("%s was replaced while we served it; leaving it in place", path)
        self._ipc_paths.clear()

    def _new_router(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 500)  # at close: give last replies 0.5 s to leave
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        sock.setsockopt(zmq.IPV6, 1)  # tcp://[::1]:port works; IPv4 is unaffected
        return sock

    def _curve_router(self) -> zmq.Socket:
        """The CURVE server ROUTER for tcp endpoints.  Clients must know the server's public
        key; with ``curve_authorized_dir`` a ZAP handler (pyzmq's ThreadAuthenticator) admits
        only the client public certificates found there at start, otherwise any client key
        is accepted (CURVE_ALLOW_ANY: encryption plus server authentication only)."""
        import zmq.auth

        key_path = self.cfg.curve_secret_key
        try:
            public, secret = zmq.auth.load_certificate(key_path)
        except (OSError, ValueError) as e:
            raise NgramError(f"curve_secret_key {key_path}: {e}") from None
        if secret is None:
            raise NgramError(f"curve_secret_key {key_path} holds no secret key (give the "
                             f".key_secret file that `ngramd keygen` wrote)")
        if os.stat(key_path).st_mode & 0o007:
            log.warning("curve_secret_key %s is readable by others: chmod 600 it", key_path)
        allowed = self.cfg.curve_authorized_dir
        if allowed:
            from zmq.auth.thread import ThreadAuthenticator

            if not os.path.isdir(allowed):
                raise NgramError(f"curve_authorized_dir {allowed} is not a directory")
            self._auth = ThreadAuthenticator(self.ctx, log=logging.getLogger("ngramd.auth"))
            self._auth.start()
            self._auth.configure_curve(domain="*", location=allowed)
            n = len(zmq.auth.load_certificates(allowed))
            log.info("CURVE: %d authorized client key(s) in %s", n, allowed)
        sock = self._new_router()
        sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True
        self._sockets.append(sock)
        self._set_maxmsgsize()
        return sock

    def install_signals(self) -> None:
        """SIGTERM/SIGINT -> drain and stop; SIGHUP -> reload limits and log level."""
        def handler(signum, _frame):
            self._wake(b"H" if signum == signal.SIGHUP else b"T")
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self._old_handlers[s] = signal.signal(s, handler)

    def start_metrics(self) -> None:
        """Prometheus endpoint on ``metrics_host:metrics_port``: ``ngramd/metrics.py`` reads
        the counters at scrape time (counters, histograms in seconds, gauges; a fixed series
        set), served by ``MetricsHTTPServer``: a bounded number of connections, each with a
        timeout.  ``prometheus_client`` is imported here, not at module load: the offline
        tools and ``--check-config`` do not need it."""
        if not self.cfg.metrics_port:
            return
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        from .metrics import make_registry

        registry = make_registry(self)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                try:
                    body = generate_latest(registry)
                except Exception:
                    log.exception("metrics: collecting stats failed")
                    self.send_error(500)
                    return
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt, *args):
                log.debug("metrics: " + fmt, *args)

        Handler.timeout = MetricsHTTPServer.timeout_s  # socket timeout: idle peers are dropped
        host = self.cfg.metrics_host
        self._metrics = MetricsHTTPServer((host, self.cfg.metrics_port), Handler)
        threading.Thread(target=self._metrics.serve_forever, name="ngramd-metrics",
                         daemon=True).start()
        log.info("metrics on http://%s:%d/metrics", host, self._metrics.server_address[1])

    # ------------------------------------------------------------------ main loop
    def serve(self) -> None:
        """Run until stopped; then drain, flush and close the table and the sockets."""
        self._ingest_thread.start()
        self.stall.start()
        poller = zmq.Poller()
        for sock in self._sockets:
            poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        wd_usec = _watchdog_usec()
        wd_period = wd_usec / 2e6 if wd_usec else None
        wd_next = time.monotonic()
        drain_deadline = None
        sd_notify("READY=1\nSTATUS=serving " + " ".join(self.endpoints))
        while True:
            now = time.monotonic()
            if wd_period and now >= wd_next:
                sd_notify("WATCHDOG=1")  # from the main loop: a stuck loop stops the pings
                wd_next = now + wd_period
            self._check_health(now)
            if self._draining:
                if self._pending == 0:
                    break
                if now >= drain_deadline:
                    log.warning("drain: %d jobs still running after %.1f s; closing anyway",
                                self._pending, self.cfg.drain_s)
                    break
            timeout = 1000 if not wd_period else max(1, int((wd_next - now) * 1000))
            events = dict(poller.poll(timeout))
            if self._wake_r in events:
                for flag in os.read(self._wake_r, 4096):
                    if flag == ord("T") and not self._draining:
                        self._draining = True
                        drain_deadline = time.monotonic() + self.cfg.drain_s
                        sd_notify("STOPPING=1")
                        log.info("stopping: draining %d in-flight jobs", self._pending)
                    elif flag == ord("H"):
                        self.reload()
                self._send_done()
            for sock in self._sockets:
                if sock not in events:
                    continue
                # bounded batch per wake so completions and signals are never starved
                for _ in range(256):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(frames, sock)
        self._shutdown()

    def _check_health(self, now: float) -> None:
        """Once a second: tell systemd (``STATUS=``) and the log when the table's health
        changes (a failing disk, a write path that recovered)."""
        if now < self._health_next:
            return
        self._health_next = now + 1.0
        h = self.table.health()
        if h["state"] != self._health_state:
            self._health_state = h["state"]
            if h["state"] == "ok":
                log.info("health: ok")
                sd_notify("STATUS=serving " + " ".join(self.endpoints))
            else:
                log.warning("health: degraded: %s", h["reason"])
                sd_notify(f"STATUS=degraded: {h['reason'][:200]}")

    def stop(self) -> None:
        """Ask the main loop to drain and stop (thread- and signal-safe)."""
        self._wake(b"T")

    def _wake(self, flag: bytes) -> None:
        try:
            os.write(self._wake_w, flag)
        except BlockingIOError:
            pass  # the pipe is full, so the main loop is awake already
        except OSError:
            pass  # closed at shutdown: nothing left to wake

    def _shutdown(self) -> None:
        """Stop in bounded time: waiting jobs (a flush behind a log lag, a rebuild) are
        answered ``unavailable`` rather than waited for, every reply is sent before the socket
        closes, then the table flushes for at most ``drain_s`` and closes (the durable log
        keeps whatever was not counted)."""
        self._stopping.set()
        with self._ingest_cv:
            self._ingest_q.append(None)
            self._ingest_cv.notify_all()
        self._ingest_thread.join(timeout=max(self.cfg.drain_s, 1.0))
        self._pool.shutdown(wait=False, cancel_futures=True)
        cf.wait(list(self._jobs), timeout=max(self.cfg.drain_s, 1.0))
        self._send_done()
        if self._metrics is not None:
            self._metrics.shutdown()
        try:
            applied = self.table.flush(timeout_s=max(self.cfg.drain_s, 1.0))
            log.info("flushed: ingest log applied up to seq %d", applied)
        except Exception as e:  # the log is durable: a restart replays what was not applied
            log.warning("flush at shutdown incomplete (%s); the log is replayed on start", e)
        self.table.close()
        self.close_sockets()
        for sig, old in self._old_handlers.items():  # a late signal must not write to a closed
            signal.signal(sig, old)                  # (and maybe reused) pipe fd
        os.close(self._wake_r)
        os.close(self._wake_w)
        log.info("stopped")

    def reload(self) -> None:
        """SIGHUP: apply new limits and log level; say what needs a restart."""
        if self._reload_fn is None:
            return
        try:
            new = self._reload_fn()
        except Exception as e:
            log.error("reload failed, keeping the current config: %s", e)
            return
        if isinstance(new, DaemonConfig):  # the [table] section is fixed while running
            old_t, new_t = self.table.config, new.table
            moved = [f.name for f in fields(old_t) if getattr(old_t, f.name)
                     != getattr(new_t, f.name)]
            if moved:
                log.warning("reload: [table] %s changed: a table setting needs a restart; "
                            "keeping the running values", ", ".join(moved))
            new = new.server
        fixed = ("endpoints", "runtime_dir", "socket_mode", "allow_remote", "metrics_port",
                 "metrics_host", "curve_secret_key", "curve_authorized_dir", "insecure")
        changed = [k for k in fixed if getattr(new, k) != getattr(self.cfg, k)]
        if changed:
            log.warning("reload: %s need a restart; keeping the current values", ", ".join(changed))
            new = replace(new, **{k: getattr(self.cfg, k) for k in changed})
        self.cfg = new
        logging.getLogger().setLevel(new.log_level.upper())
        self._set_maxmsgsize()
        log.info("reloaded: log_level=%s max_msg_bytes=%d max_batch=%d max_tokens=%d",
                 new.log_level, new.max_msg_bytes, new.max_batch, new.max_tokens)

    def _set_maxmsgsize(self) -> None:
        # libzmq drops (and disconnects) frames above this before we ever see them; between
        # max_msg_bytes and this hard cap the client gets a ``too_large`` reply instead
        for sock in self._sockets:
            sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.cfg.max_msg_bytes + P.MAX_HEADER_BYTES)

    # ------------------------------------------------------------------ dispatch
    def _is_busy(self) -> bool:
        """Requests in the last 2 s, or background work in the table (see StallMonitor)."""
        return time.monotonic() - self._last_request < 2.0 or self.table.busy()

    def _handle(self, frames: list, sock: zmq.Socket | None = None) -> None:
        t0 = time.perf_counter()
        self._last_request = time.monotonic()
        envelope, body = P.split_envelope(frames)
        envelope = [sock or self.router, *envelope]  # the reply leaves on the socket it came by
        req_id, op, code = None, "?", None
        try:
            req = P.decode_request(body)
            req_id, op = req.id, req.op
            size = sum(len(f) for f in body)
            if size > self.cfg.max_msg_bytes:
                raise TooLarge(f"message of {size} bytes exceeds max_msg_bytes "
                               f"{self.cfg.max_msg_bytes}")
            if self._draining:
                raise NgramError("daemon is shutting down", UNAVAILABLE)
            handler = self._inline.get(op)
            if handler is not None:
                reply = handler(req)
            else:
                self._submit(envelope, req, t0)
                return
        except Exception as e:
            req_id = getattr(e, "req_id", None) if req_id is None else req_id
            reply, code = self._error_reply(req_id, op, e)
        self._send(envelope, reply, op, t0, code)

    def _send(self, envelope: list, reply: list, op: str, t0: float, code: str | None) -> None:
        sock, *route = envelope  # [socket, routing id, (b"" for REQ)]: see _handle
        try:
            sock.send_multipart(route + reply, copy=False)
        except zmq.ZMQError as e:  # peer gone or HWM reached: ROUTER drops, we log
            log.debug("reply to %s dropped: %s", op, e)
        self.requests[op] += 1
        if code is not None:
            self.errors[code] += 1
            self.op_errors[op] += 1
        self.latency[op].add((time.perf_counter() - t0) * 1e6)

    def _error_reply(self, req_id, op: str, exc: Exception) -> tuple[list, str]:
        code, msg = _error_parts(op, exc)
        return P.encode_error(req_id, code, msg), code

    def _submit(self, envelope: list, req: P.Request, t0: float) -> None:
        if self._pending >= self.cfg.max_pending:
            raise NgramError(f"busy: {self._pending} jobs queued (max_pending)", UNAVAILABLE)
        if req.op == "ingest":
            tokens, offsets = self._batch(req)
            key = req.header.get("key")
            if key is not None and not (isinstance(key, (str, bytes))
                                        and len(key) <= _MAX_KEY_BYTES):
                raise BadInput(f"ingest key must be a string of at most {_MAX_KEY_BYTES} bytes")
            self._pending += 1
            self._ingest_submitted += 1
            with self._ingest_cv:
                self._ingest_q.append((envelope, req.id, key, tokens, offsets, t0))
                self._ingest_cv.notify()
            return
        job = {"flush": self._job_flush, "rebuild_hot": self._job_rebuild,
               "lookup": self._job_lookup,
               "top": self._job_top}[req.op]
        args = self._check_slow(req)
        self._pending += 1
        fut = self._pool.submit(self._run_job, job, envelope, req, args, t0)
        self._jobs.add(fut)
        fut.add_done_callback(self._jobs.discard)

    def _run_job(self, job, envelope, req, args, t0) -> None:
        try:
            reply, code = job(req.id, *args), None
        except Exception as e:
            reply, code = self._error_reply(req.id, req.op, e)
        self._complete(envelope, reply, req.op, t0, code)

    def _complete(self, envelope, reply, op, t0, code) -> None:
        """Worker side: queue a finished reply for the main thread (it owns the socket)."""
        self._done.append((envelope, reply, op, t0, code))
        self._wake(b"R")

    def _send_done(self) -> None:
        while self._done:
            envelope, reply, op, t0, code = self._done.popleft()
            self._pending -= 1
            self._send(envelope, reply, op, t0, code)

    # ------------------------------------------------------------------ inline ops
    def _batch(self, req: P.Request):
        return req.batch(self.vocab_size, max_batch=self.cfg.max_batch,
                         max_tokens=self.cfg.max_tokens)

    def _op_ping(self, req):
        return P.encode_reply(req.id, {"instance": self.instance,
                                       "health": self.table.health()["state"]})

    def _op_info(self, req):
        info = self.table.info()
        info["health"] = self.table.health()
        info["server"] = {
            "protocol": P.PROTOCOL_VERSION, "instance": self.instance, "pid": os.getpid(),
            "endpoints": self.endpoints, "ops": sorted(P.OPS),
            "limits": {k: getattr(self.cfg, k) for k in
                       ("max_msg_bytes", "max_batch", "max_tokens", "max_pending")},
        }
        return P.encode_reply(req.id, info)

    def _op_stats(self, req):
        return P.encode_reply(req.id, self.stats())

    def _op_draft(self, req):
        tokens, offsets = self._batch(req)
        h = req.header
        max_len = _int_field(h, "max_len", 1, 1 << 16)
        budget = h.get("budget_us")
        if budget is not None and (not isinstance(budget, (int, float)) or isinstance(budget, bool)
                                   or not 0 <= budget < 1e9):
            raise BadInput("budget_us must be a number of microseconds >= 0")
        out = self.table.draft(tokens, offsets, max_len, budget)
        return P.encode_reply(req.id, None, out)

    def _job_lookup(self, req_id, tokens, offsets):
        """Every order of every context, cold reads included: a tool's op (the CLI, tests),
        so it runs on a worker and never holds drafts back (``Table.lookup`` bounds it)."""
        return P.encode_reply(req_id, None, self.table.lookup(tokens, offsets))

    def _op_report(self, req):
        drafted = _order_counts(req.header.get("drafted", {}), "drafted")
        accepted = _order_counts(req.header.get("accepted", {}), "accepted")
        keys = P.unpack_keys(req.frames, self.cfg.max_tokens)
        self.table.report(drafted, accepted, keys)
        return P.encode_reply(req.id)

    def stats(self) -> dict:
        """The table's figures plus the server's (requests, errors, latency per op)."""
        s = self.table.stats_dict()
        s["server"] = {
            "instance": self.instance, "uptime_s": round(time.time() - self.started, 1),
            "pending": self._pending,
            "requests": dict(self.requests), "errors": dict(self.errors),
            "op_errors": dict(self.op_errors),
            "latency": {op: h.summary() for op, h in list(self.latency.items())},
            "stall": self.stall.summary(),
        }
        return s

    # ------------------------------------------------------------------ worker ops
    def _check_slow(self, req) -> tuple:
        h = req.header
        if req.op == "flush":
            return (self._ingest_submitted,)
        if req.op == "lookup":
            return self._batch(req)
        if req.op == "rebuild_hot":
            return (bool(h.get("full", False)),)
        return (_int_field(h, "order", 1, MAX_ORDER), _int_field(h, "n", 1, 100_000))

    def _ingest_loop(self) -> None:
        """The one ingest thread: takes every queued ingest (up to ``max_tokens``), drops
        repeated keys, appends the rest to the durable log in ONE write (group commit: one WAL
        sync for many clients) and acknowledges each with its own range of log seqs."""
        while True:
            with self._ingest_cv:
                while not self._ingest_q:
                    self._ingest_cv.wait()
                jobs, n_tok = [], 0
                while self._ingest_q and self._ingest_q[0] is not None and (
                        not jobs or n_tok + self._ingest_q[0][3].size <= self.cfg.max_tokens):
                    jobs.append(self._ingest_q.popleft())
                    n_tok += jobs[-1][3].size
                stop = not jobs
            if stop:
                return
            self._ingest_group(jobs)
            with self._ingest_cv:
                self._ingest_finished += len(jobs)
                self._ingest_cv.notify_all()

    def _ingest_group(self, jobs: list) -> None:
        acks: dict[int, tuple[int, int]] = {}  # job index -> (first_seq, last_seq)
        dup_of: dict[int, int] = {}  # job index -> index of the job with the same key
        fresh, by_key = [], {}
        for i, (_, _, key, _, _, _) in enumerate(jobs):
            if key is not None and key in self._dedup:
                acks[i] = self._dedup[key]
            elif key is not None and key in by_key:
                dup_of[i] = by_key[key]
            else:
                fresh.append(i)
                if key is not None:
                    by_key[key] = i
        error = None
        by_index = set(fresh)
        if fresh:
            try:
                if len(fresh) == 1:
                    tokens, offsets = jobs[fresh[0]][3], jobs[fresh[0]][4]
                else:  # concatenate; each job's offsets shift by the tokens before it
                    sizes = [jobs[i][3].size for i in fresh]
                    tokens = np.concatenate([jobs[i][3] for i in fresh])
                    offsets = np.concatenate([np.zeros(1, np.int64)] + [
                        jobs[i][4][1:] + base for i, base in zip(fresh, np.cumsum([0] + sizes))])
                first, _ = (int(x) for x in self.table.ingest(tokens, offsets))
                for i in fresh:  # the log numbers records contiguously within one write
                    n_rec = int(self.table.records_per_sequence(jobs[i][4]).sum())
                    acks[i] = (first, first + n_rec - 1)
                    first += n_rec
                    if jobs[i][2] is not None:
                        self._dedup[jobs[i][2]] = acks[i]
                while len(self._dedup) > self.cfg.dedup_keys:
                    self._dedup.popitem(last=False)
            except Exception as e:  # one write: none of the group is durable
                error = _error_parts("ingest", e)
        for i, (envelope, req_id, _, _, _, t0) in enumerate(jobs):
            src = dup_of.get(i, i)
            if error is not None and src in by_index:
                reply, code = P.encode_error(req_id, *error), error[0]
            else:
                a, b = acks[src]
                dup = i in dup_of or i not in by_index
                reply, code = P.encode_reply(req_id, {"first_seq": a, "last_seq": b,
                                                      "duplicate": dup}), None
            self._complete(envelope, reply, "ingest", t0, code)

    def _job_flush(self, req_id, ingest_target: int):
        with self._ingest_cv:  # ingests received before this flush are part of it
            self._ingest_cv.wait_for(lambda: self._ingest_finished >= ingest_target
                                     or self._stopping.is_set())
        if self._stopping.is_set():
            raise NgramError("daemon is shutting down", UNAVAILABLE)
        return P.encode_reply(req_id, {"applied": int(self.table.flush(abort=self._stopping))})

    def _job_rebuild(self, req_id, full: bool):
        gen = self.table.rebuild_hot(full=full, abort=self._stopping)
        return P.encode_reply(req_id, {"generation": int(gen)})

    def _job_top(self, req_id, order: int, n: int):
        rows = self.table.top(order, n)
        k = max((len(r[2]) for r in rows), default=0)
        tok = np.full((len(rows), k), EMPTY_TOKEN, np.uint32)
        cnt = np.zeros((len(rows), k), np.uint32)
        for i, (_key, _total, t, c) in enumerate(rows):
            tok[i, :len(t)] = t
            cnt[i, :len(c)] = c
        key = np.array([r[0] for r in rows], np.uint64)
        total = np.array([r[1] for r in rows], np.uint64)
        return P.encode_reply(req_id, {"order": order},
                              {"key": key, "total": total, "tok": tok, "cnt": cnt})


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
class MetricsHTTPServer(ThreadingHTTPServer):
    """An HTTP server for one scraper, not for the world: at most ``max_connections``
    connections are handled at once (a thread each) and a connection beyond that is closed at
    once; each handled connection gets ``timeout_s`` per socket read or write.

    ThreadingHTTPServer alone starts a thread per connection and waits forever for a request:
    2,000 idle connections gave the daemon 2,011 threads and +50 MiB.  Now idle peers hold at
    most ``max_connections`` threads for ``timeout_s`` each; a scrape sends its request at once
    and takes milliseconds."""

    daemon_threads = True
    block_on_close = False  # shutdown() never waits for a slow peer
    max_connections = 8
    timeout_s = 5.0

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._slots = threading.BoundedSemaphore(self.max_connections)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            log.debug("metrics: %d connections busy; closing one from %s",
                      self.max_connections, client_address)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # starts the handler thread
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class StallMonitor:
    """How long a Python thread of the daemon can be kept from running (DESIGN §9: <= 20 ms).

    A daemon thread sleeps in a loop and records by how much each wake-up came late: the time
    it waited for the GIL (a long write or fsync that holds it) or for a CPU.  That is the
    stall every other thread of the process (the serving loop included) sees.

    The lateness of one wake-up does not depend on how long the sleep was, but a stall that
    starts and ends inside one sleep goes unseen: ``period_s`` (10 ms) catches every stall of
    10 ms or more, and is used while ``busy()`` says the daemon works (requests in the last
    seconds, a write, spill, merge or rebuild).  An idle daemon sleeps ``idle_period_s``
    (250 ms): a timer wake-up costs ~60 µs of CPU on this project's VM, so 100 a second were
    ~0.5 CPU-s per 90 s -- most of an idle daemon's CPU (measured with and without)."""

    WINDOW_S = 120  # per-second maxima kept for ``recent_ms``

    def __init__(self, period_s: float = 0.01, idle_period_s: float = 0.25,
                 busy=lambda: True):
        self.period_s = period_s
        self.idle_period_s = idle_period_s
        self.busy = busy
        self.hist = LatencyHistogram()
        self.max_ms = 0.0
        self._seconds = collections.deque(maxlen=self.WINDOW_S)  # (unix second, max ms)
        self._thread = threading.Thread(target=self._run, name="ngramd-stall", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                period = self.period_s if self.busy() else self.idle_period_s
            except Exception:  # a closing table: measure at the fine period
                period = self.period_s
            t0 = time.perf_counter()
            time.sleep(period)
            late = (time.perf_counter() - t0 - period) * 1e6
            self.hist.add(max(late, 0.0))
            ms = late / 1e3
            if ms > self.max_ms:
                self.max_ms = ms
            sec = int(time.time())
            if self._seconds and self._seconds[-1][0] == sec:
                if ms > self._seconds[-1][1]:
                    self._seconds[-1] = (sec, ms)
            else:
                self._seconds.append((sec, ms))
            if late > 50_000:
                log.info("a daemon thread was kept from running for %.0f ms", ms)

    def summary(self) -> dict:
        s = self.hist.summary()
        return {"count": s["count"], "p50_us": s["p50_us"], "p99_us": s["p99_us"],
                "p999_us": s["p999_us"], "max_ms": round(self.max_ms, 3),
                # the longest stall of each of the last WINDOW_S seconds, oldest first
                "recent_ms": [[t, round(m, 2)] for t, m in list(self._seconds)]}


#: (op, exception type) -> [monotonic time of the last logged traceback, errors since]
_INTERNAL_LOGGED: dict = {}
INTERNAL_LOG_EVERY_S = 60.0


def _error_parts(op: str, exc: Exception) -> tuple[str, str]:
    """(code, message) for any exception: ours carry their code; anything else is a bug
    (``internal``) -- either way the daemon keeps serving.

    A bug's traceback is logged once per (op, exception type) and minute, with the number of
    repeats since: a client that can trigger one must not be able to fill the disk with logs
    (one traceback is ~400 bytes; a 13-byte message could trigger it)."""
    if isinstance(exc, NgramError):
        return exc.code, str(exc)
    key = (str(op)[:32], type(exc).__name__)
    now = time.monotonic()
    seen = _INTERNAL_LOGGED.get(key)
    if seen is None or now - seen[0] >= INTERNAL_LOG_EVERY_S:
        if len(_INTERNAL_LOGGED) > 1024:
            _INTERNAL_LOGGED.clear()
        repeats = f" ({seen[1]} more since the last report)" if seen and seen[1] else ""
        _INTERNAL_LOGGED[key] = [now, 0]
        log.error("op %s failed unexpectedly%s:\n%s", op, repeats,
                  "".join(traceback.format_exception(exc)).rstrip())
    else:
        seen[1] += 1
    return INTERNAL, f"internal error in {op}: {type(exc).__name__} (see the daemon log)"


def _int_field(h: dict, name: str, lo: int, hi: int) -> int:
    v = h.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise BadInput(f"{name} must be an integer in {lo}..{hi}, got {v!r}"[:200])
    return v


def _order_counts(m, what: str) -> dict[int, int]:
    """Validate a report map {order: count} (keys may arrive as ints or digit strings)."""
    if not isinstance(m, dict) or len(m) > MAX_ORDER + 1:
        raise BadInput(f"{what} must be a map of at most {MAX_ORDER + 1} orders")
    out = {}
    for k, v in m.items():
        if isinstance(k, bool) or not (isinstance(k, int) or isinstance(k, (str, bytes))
                                       and k.isascii() and k.isdigit() and len(k) <= 3):
            raise BadInput(f"{what}: order {str(k)[:20]!r} is not an integer")
        n = int(k)
        if not 0 <= n <= MAX_ORDER or not isinstance(v, int) or isinstance(v, bool) \
                or not 0 <= v < 1 << 48:
            raise BadInput(f"{what}: bad entry {n}: {str(v)[:20]}")
        out[n] = v
    return out


def claim_ipc_path(path: Path, probe_s: float = 0.3) -> None:
    """Make ``path`` free for an ipc bind, or raise ``NgramError`` saying why it is not.

    Nothing there: fine.  Not a socket: refused (a file an operator or another program put
    there is never deleted for us).  A socket something accepts connections on within
    ``probe_s``: refused, another daemon serves it.  A socket that refuses connections: stale,
    left by a crash; removed.  (Two daemons starting within the same few milliseconds on one
    stale path can still race; the one that binds last wins.)"""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise NgramError(f"{path} exists and is not a socket; refusing to replace it "
                         f"(remove it or choose another endpoint)")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
        s.settimeout(probe_s)
        try:
            s.connect(str(path))
        except ConnectionRefusedError:
            log.info("removing the stale socket %s (nothing listens on it)", path)
            path.unlink(missing_ok=True)
            return
        except OSError as e:  # a full backlog (timeout), no permission, ...: not ours to take
            raise NgramError(f"{path}: cannot tell whether another ngramd serves it ({e}); "
                             f"refusing to replace it") from None
    raise NgramError(f"another ngramd is serving on {path}; refusing to take its socket")


def _watchdog_usec() -> int:
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return 0
    try:
        return int(usec)
    except ValueError:
        return 0


def sd_notify(state: str) -> bool:
    """Send ``state`` to systemd's notify socket (no dependency: it is one datagram).

    Returns False (and does nothing) when not started by systemd with ``Type=notify``.
    """
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr[0] == "@":
        addr = "\0" + addr[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(state.encode())
        return True
    except OSError as e:
        log.warning("sd_notify(%s) failed: %s", state.split("\n")[0], e)
        return False


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
def resolve(cfg: DaemonConfig) -> DaemonConfig:
    """Fill in what defaults to the environment: runtime dir and the ipc endpoint."""
    s = cfg.server
    rd = s.runtime_dir or P.default_runtime_dir()
    eps = s.endpoints or (P.default_endpoint(cfg.table.name, rd),)
    return replace(cfg, server=replace(s, runtime_dir=rd, endpoints=eps))


class _JournalFormatter(logging.Formatter):
    """journald stream format: ``<priority>`` on every line, no timestamp (journald adds one)."""

    _PRIO = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3,
             logging.CRITICAL: 2}

    def format(self, record):
        prio = self._PRIO.get(record.levelno, 6)
        return "\n".join(f"<{prio}>{line}" for line in super().format(record).splitlines())


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if os.environ.get("JOURNAL_STREAM"):
        handler.setFormatter(_JournalFormatter("%(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="ngramd", description="Serve one Flash Nest n-gram table over ZeroMQ.  Offline "
        "tools for a stopped table: `ngramd warm FILES` (bulk-count a corpus), `ngramd compact`; "
        "`ngramd keygen DIR` writes a CurveZMQ key pair for tcp endpoints.",
        epilog="Flags override the config file; --set overrides anything, e.g. "
               "--set table.hot_budget_mb=256 --set 'server.endpoints=[\"tcp://127.0.0.1:5555\"]'")
    ap.add_argument("-c", "--config", help="TOML file with [table], [table.cold], [server]")
    ap.add_argument("--check-config", action="store_true",
                    help="print the effective config (TOML) and exit")
    ap.add_argument("--name", help="table name (socket and shm names follow it)")
    ap.add_argument("--data-dir", help="RocksDB parent directory")
    ap.add_argument("--shm-dir", help="directory of the hot tier's shared-memory segments")
    ap.add_argument("--runtime-dir", help="directory of the default ipc socket")
    ap.add_argument("--endpoint", action="append", help="bind this endpoint (repeatable)")
    ap.add_argument("--tokenizer", help="tokenizer.json (or its directory) the table records "
                    "(default: the packaged Qwen3 tokenizer; \"none\" records none)")
    ap.add_argument("--log-level")
    ap.add_argument("--metrics-port", type=int)
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    return ap


def _overrides(args) -> tuple:
    flags = {"table.name": args.name, "table.data_dir": args.data_dir,
             "table.shm_dir": args.shm_dir, "table.tokenizer": args.tokenizer,
             "server.runtime_dir": args.runtime_dir, "server.endpoints": args.endpoint,
             "server.log_level": args.log_level, "server.metrics_port": args.metrics_port}
    # JSON spells strings, ints and lists of strings exactly as TOML does
    return tuple(f"{k}={json.dumps(v)}" for k, v in flags.items() if v is not None) \
        + tuple(args.set)


def tune_malloc() -> bool:
    """Give large freed blocks back to the kernel (glibc only; returns whether it applied).

    glibc raises its mmap threshold after the first large free (up to 32 MiB) and keeps
    smaller blocks in per-thread arenas: the daemon's background threads allocate many
    10-100 MiB arrays (slices, hot builds), and RSS stayed at its peak (1.9-2.1 GB after one
    bulk ingest, measured).  A fixed 1 MiB threshold maps every large array on its own and
    unmaps it on free, so RSS follows what is live.  The cost, a page fault per 4 KiB on first
    touch, falls on background work."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
        ok = libc.mallopt(M_MMAP_THRESHOLD, 1 << 20) == 1
        libc.mallopt(M_TRIM_THRESHOLD, 8 << 20)
        libc.mallopt(M_ARENA_MAX, 2)
        return ok
    except (OSError, AttributeError):
        return False


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("warm", "compact", "keygen"):  # offline tools
        from .tools import main as tools_main

        os.umask(0o007)
        return tools_main(argv)
    args = _parser().parse_args(argv)
    os.umask(0o007)  # sockets, segments and files: owner and group only (DESIGN §10)
    sets = _overrides(args)
    try:
        cfg = resolve(load_daemon_config(args.config, sets))
    except (NgramError, ValueError, TypeError) as e:
        print(f"ngramd: bad config: {e}", file=sys.stderr)
        return 2
    if args.check_config:
        sys.stdout.write(to_toml(cfg))
        return 0
    setup_logging(cfg.server.log_level)
    tune_malloc()
    # a Python thread that wants the GIL waits at most this long for one running pure-Python
    # code (5 ms by default): the serving loop should not wait on a background thread's loop
    sys.setswitchinterval(0.001)
    from .table import Table  # late: --check-config needs neither RocksDB nor numba
    from .tools import private_data_dir

    log.info("opening table %r in %s", cfg.table.name, cfg.table.data_dir)
    try:
        private_data_dir(cfg.table.data_dir, cfg.table.name)
    except OSError as e:
        log.error("cannot prepare the data directory: %s", e)
        return 1
    try:
        table = Table(cfg.table)
    except NgramError as e:
        log.error("cannot open the table: %s", e)
        return 1
    server = Server(table, cfg.server,
                    reload=lambda: resolve(load_daemon_config(args.config, sets)))
    try:
        server.install_signals()
        server.bind()
        server.start_metrics()
    except (NgramError, zmq.ZMQError, OSError) as e:
        log.error("cannot listen: %s", e)
        server.close_sockets()
        table.close()
        return 1
    server.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
