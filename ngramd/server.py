"""The ``ngramd`` server: serves one n-gram table over ZeroMQ (sockets, dispatch, jobs).

Each op is declared once in ``wire/commands.py``; the server validates a request's header
fields, frames and limits by that declaration and runs the op's handler (``handlers.py``) where
the declaration says (``runs``).  One main thread owns the ROUTER socket and answers the fast
ops inline (ping, info, stats, draft, report): a draft costs microseconds, and a thread hop
would cost more than the work.  Ops that may take long go to worker threads so they never hold
a draft reply back:

* ``INGEST`` (``ingest``) -> one ingest thread, ``writefront.IngestFront`` (keeps the arrival
  order, drops repeated keys, answers ``busy`` past the backlog's bounds; the ack waits for
  durability of the log only, counting happens on the Table's own writer thread);
* ``POOL`` (``top``, ``lookup``: cold reads of every order) -> a small pool; ``POOL`` ops
  declared ``waits`` (``flush``, ``rebuild_hot``, scans) -> a wait pool of their own, so a
  lookup never queues behind a wait.  A wait is bounded by its ``wait_field`` (``wait_s``),
  counted from the request's arrival: the client sets it below its own timeout, so a
  request whose caller gave up stops costing a thread when the caller stopped listening.
  An op declared ``after_ingests`` (``flush``) first waits for the ingests received before
  it, so "ingest then flush" means what it says even when pipelined.

Workers hand finished replies back through a deque plus one byte on a wake pipe; the same pipe
carries signals (SIGTERM/SIGINT -> ``T``, SIGHUP -> ``H``), so shutdown and reload are messages
handled by the main loop: one code path, no work inside signal handlers.

Life cycle: open the table (replays the log), bind, ``READY=1``; on SIGTERM ``STOPPING=1``,
answer new requests ``unavailable``, let queued jobs finish (``drain_s``), close (what the
log holds and is not counted yet is counted at the next start).
The command line and logging are in ``service.py`` (``ngramd`` runs ``ngramd.service:main``),
the metrics endpoint in ``metrics.py``, the stall monitor in ``stats.py``.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import logging
import os
import signal
import socket
import stat
import threading
import time
import traceback
import uuid
from dataclasses import fields, replace
from pathlib import Path

import zmq

from .wire import protocol as P
from .wire.commands import COMMANDS, INGEST, INLINE, Command
from .config import DaemonConfig, ServerConfig
from .wire.curve import load_key_file
from .wire.errors import INTERNAL, TIMEOUT, UNAVAILABLE, NgramError, TooLarge
from .handlers import HANDLERS
from .stats import LatencyHistogram, StallMonitor
from .writefront import IngestFront, IngestJob

log = logging.getLogger("ngramd.server")

#: per-peer queue of received messages; with ``max_msg_bytes`` it bounds what one client can
#: make the daemon hold (clients that pipeline deeper are pushed back by ZeroMQ, not dropped)
RCVHWM = 128
#: threads of the wait pool (ops declared ``waits``: flush, rebuilds, scans).  A wait is
#: bounded by what its caller asked for (``wait_field``, from the client's timeout), so an
#: abandoned one frees its thread when its caller's time is up; 8 hold the waits of a
#: handful of clients at once while costing nothing idle
WAIT_WORKERS = 8


def _check_socket_dir(d: Path) -> None:
    """Refuse a socket directory that another user owns and others may write to (the default
    ``/tmp/ngramd-<uid>`` made beforehand by someone else): whoever can write there can replace
    the socket and answer this daemon's clients.  A sticky directory (``/tmp``) is fine: no
    one else can remove or rename what is ours in it."""
    st = d.stat()
    if st.st_uid != os.geteuid() and st.st_mode & 0o022 and not st.st_mode & 0o1000:
        raise NgramError(f"socket directory {d} belongs to uid {st.st_uid} and others can write "
                         f"to it; refusing to put a socket there (choose --runtime-dir)")


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


def watchdog_usec() -> int:
    """systemd's watchdog interval (µs) when it watches this process, else 0."""
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


class Server:
    """Serves ``table`` on ``cfg.endpoints``.  ``serve()`` runs the main loop in the calling
    thread until ``stop()`` (or SIGTERM when ``install_signals()`` was called)."""

    def __init__(self, table, cfg: ServerConfig, *, reload=None, fleet=None):
        self.table = table
        self.cfg = cfg
        self.fleet = fleet  # ngramd.fleet.Fleet when [fleet] is enabled
        self.snapshot_dir: Path | None = None  # where `snapshot --to-dir` writes (service)
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
        self._stop_by = 0.0  # monotonic deadline of the drain a stop signal started
        # the ingest queue and its group-commit thread (writefront.IngestFront)
        self.ingests = IngestFront(table.writes, lambda: self.cfg, self._answer_ingest,
                                   _error_parts)
        self._pool = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="ngramd-slow")
        # ops that wait (flush, rebuilds, scans) on their own threads: a wait is mostly idle, and
        # the short pooled ops (lookup) must never queue behind it
        self._wait_pool = cf.ThreadPoolExecutor(max_workers=WAIT_WORKERS,
                                                thread_name_prefix="ngramd-wait")
        self._jobs: set = set()  # futures of slow jobs queued or running (main thread)
        self.stopping = threading.Event()  # set at shutdown: slow jobs stop waiting
        self._health_state = "ok"
        self._health_next = 0.0
        self._metrics = None  # metrics.MetricsHTTPServer when metrics_port is set
        self._old_handlers: dict = {}
        # server-side figures: requests per op, errors per code and per op, latency per op (µs)
        self.requests = collections.Counter()
        self.errors = collections.Counter()
        self.op_errors = collections.Counter()
        self.latency = collections.defaultdict(LatencyHistogram)
        self._last_request = time.monotonic()
        self.stall = StallMonitor(busy=self._is_busy,  # read by the metrics collector
                                  doing=lambda: self.table.activity())

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
                _check_socket_dir(path.parent)
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

        public, secret = load_key_file(self.cfg.curve_secret_key, "curve_secret_key",
                                       secret=True)
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
        """Prometheus endpoint on ``metrics_host:metrics_port`` (``metrics.start_metrics``)."""
        if self.cfg.metrics_port:
            from .metrics import start_metrics  # prometheus_client: only when metrics are on

            self._metrics = start_metrics(self, self.cfg.metrics_host, self.cfg.metrics_port)

    # ------------------------------------------------------------------ main loop
    def serve(self) -> None:
        """Run until stopped; then drain, flush and close the table and the sockets."""
        self.ingests.start()
        self.stall.start()
        poller = zmq.Poller()
        for sock in self._sockets:
            poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        wd_usec = watchdog_usec()
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
                        self._stop_by = drain_deadline
                        # waiting jobs (a flush behind a lag, a rebuild) answer `unavailable`
                        # now: the drain waits for quick jobs, never for them
                        self.stopping.set()
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
        """Once a second: tell systemd (``STATUS=``) when the table's health changes (a
        failing disk, a write path that recovered); ``Health`` logs the change, once."""
        if now < self._health_next:
            return
        self._health_next = now + 1.0
        h = self.table.health()
        if h["state"] != self._health_state:  # the change is logged once, by Health
            self._health_state = h["state"]
            if h["state"] == "ok":
                sd_notify("STATUS=serving " + " ".join(self.endpoints))
            else:
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
        """Stop in bounded time, ``drain_s`` from the signal plus closing: waiting jobs (a
        flush behind a log lag, a rebuild) are answered ``unavailable`` rather than waited
        for, every reply is sent before the socket closes, then the table closes
        (``Table.close``: a few seconds at most, whatever the backlog: the durable log keeps
        what was not counted, and the next start counts it).  The sockets are closed (the
        ipc file removed) whatever the table's closing met."""
        self.stopping.set()
        stop_by = self._stop_by or time.monotonic() + self.cfg.drain_s

        def left() -> float:
            return max(stop_by - time.monotonic(), 1.0)
        try:
            self.ingests.close(timeout=left())
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._wait_pool.shutdown(wait=False, cancel_futures=True)
            cf.wait(list(self._jobs), timeout=left())
            self._send_done()
            if self._metrics is not None:
                self._metrics.shutdown()
            if self.fleet is not None:  # what is not published yet waits in the log (the hold)
                self.fleet.stop()
            # no flush: counting a backlog first made a stop take as long as the backlog.  The
            # log is durable; the table writes what is counted already and leaves the rest to be
            # counted at the next start
            self.table.close()
        finally:
            self.close_sockets()
            for sig, old in self._old_handlers.items():  # a late signal must not write to a
                signal.signal(sig, old)                  # closed (and maybe reused) pipe fd
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
            spec = COMMANDS[op]  # decode_request refused ops that are not declared
            if spec.runs == INLINE:
                reply = self._reply(req.id, spec, self._execute(spec, self._args(spec, req)))
            else:
                self._submit(envelope, spec, req, t0)
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

    def _args(self, spec: Command, req: P.Request) -> dict:
        """The op's arguments, validated by its declaration: header fields, then the token
        batch (vocab size, ``max_batch``, ``max_tokens``) and the keys frame."""
        args = spec.parse(req.header) if spec.fields else {}
        if spec.batch:
            args["tokens"], args["offsets"] = req.batch(
                self.vocab_size, max_batch=self.cfg.max_batch, max_tokens=self.cfg.max_tokens)
        if spec.keys:
            args["keys"] = P.unpack_keys(req.frames, self.cfg.max_tokens)
        return args

    def _execute(self, spec: Command, args: dict) -> dict | None:
        """Run the op's handler (``handlers.py``) on this server."""
        return HANDLERS[spec.name](self, **args)

    @staticmethod
    def _reply(req_id, spec: Command, out: dict | None) -> list:
        """Frames of a handler's result: its fields, the declared ``arrays`` as the data frame
        (in declaration order)."""
        if not out:
            return P.encode_reply(req_id)
        arrays = {k: out.pop(k) for k in spec.arrays} if spec.arrays else None
        return P.encode_reply(req_id, out, arrays)

    def _submit(self, envelope: list, spec: Command, req: P.Request, t0: float) -> None:
        if self._pending >= self.cfg.max_pending:
            raise NgramError(f"busy: {self._pending} jobs queued (max_pending)", UNAVAILABLE)
        args = self._args(spec, req)
        self._pending += 1
        if spec.runs == INGEST:
            self.ingests.submit(IngestJob(envelope, req.id, args["key"], args["tokens"],
                                          args["offsets"], t0))
            return
        after = self.ingests.submitted if spec.after_ingests else None
        pool = self._wait_pool if spec.waits else self._pool
        fut = pool.submit(self._run_job, spec, envelope, req.id, args, after, t0)
        self._jobs.add(fut)
        fut.add_done_callback(self._jobs.discard)

    def _run_job(self, spec: Command, envelope, req_id, args: dict, after: int | None,
                 t0) -> None:
        """A pool job: for an ``after_ingests`` op, first wait until the ingests received
        before it are done (or the daemon stops)."""
        try:
            # a wait counts from the request's arrival: time queued is time its caller waited
            wait_s = args.get(spec.wait_field) if spec.wait_field else None
            deadline = None if wait_s is None else t0 + wait_s
            if after is not None:
                self.ingests.wait_finished(
                    after, self.stopping,
                    None if deadline is None else max(deadline - time.perf_counter(), 0))
            if deadline is not None:
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise NgramError(f"{spec.name}: {spec.wait_field} = {wait_s:g} s passed "
                                     "before it could start", TIMEOUT)
                args = {**args, spec.wait_field: left}
            reply, code = self._reply(req_id, spec, self._execute(spec, args)), None
        except Exception as e:
            reply, code = self._error_reply(req_id, spec.name, e)
        self._complete(envelope, reply, spec.name, t0, code)

    def _complete(self, envelope, reply, op, t0, code) -> None:
        """Worker side: queue a finished reply for the main thread (it owns the socket)."""
        self._done.append((envelope, reply, op, t0, code))
        self._wake(b"R")

    def _answer_ingest(self, job: IngestJob, reply: list, code: str | None) -> None:
        """The ingest thread's answer to ``job`` (``IngestFront``)."""
        self._complete(job.envelope, reply, "ingest", job.t0, code)

    def _send_done(self) -> None:
        while self._done:
            envelope, reply, op, t0, code = self._done.popleft()
            self._pending -= 1
            self._send(envelope, reply, op, t0, code)

    # ------------------------------------------------------------------ figures
    def stats(self) -> dict:
        """The table's figures plus the server's (requests, errors, latency per op)."""
        s = self.table.stats_dict()
        s["server"] = {
            "instance": self.instance, "uptime_s": round(time.time() - self.started, 1),
            "pending": self._pending,
            "backlog": {**self.ingests.backlog().as_dict(),
                        "busy": dict(self.ingests.busy_answers)},
            "requests": dict(self.requests), "errors": dict(self.errors),
            "op_errors": dict(self.op_errors),
            "latency": {op: h.summary() for op, h in list(self.latency.items())},
            "stall": self.stall.summary(),
        }
        s["fleet"] = self.fleet.stats() if self.fleet is not None else {"state": "off"}
        return s


# ---------------------------------------------------------------------------------------------
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
