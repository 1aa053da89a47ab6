"""Service plumbing of ``ngramd``: the command line (``main``), logging for journald, systemd
notifications and watchdog, the ipc socket path, malloc tuning, the metrics HTTP server and
the stall monitor.  ``server.py`` is the server itself (sockets, dispatch, jobs); the ops are
declared in ``commands.py``.

``import ngramd.service`` and ``ngramd --check-config`` load neither numba nor RocksDB: the
table and the server are imported only when a daemon starts (tested in tests/test_server.py).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import math
import os
import socket
import stat
import sys
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import zmq

from . import protocol as P
from .config import DaemonConfig, load_daemon_config, to_toml
from .errors import NgramError
from .stats import LatencyHistogram

log = logging.getLogger("ngramd.service")


# ---------------------------------------------------------------------------------------------
# metrics and stalls
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


def start_metrics(server, host: str, port: int) -> MetricsHTTPServer:
    """Prometheus endpoint on ``host:port`` for ``server`` (``ngramd.server.Server``):
    ``ngramd/metrics.py`` reads its counters at scrape time (counters, histograms in seconds,
    gauges; a fixed series set), served by ``MetricsHTTPServer``: a bounded number of
    connections, each with a timeout.  ``prometheus_client`` is imported here, not at module
    load: the offline tools and ``--check-config`` do not need it."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    from .metrics import make_registry

    registry = make_registry(server)

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
    httpd = MetricsHTTPServer((host, port), Handler)
    threading.Thread(target=httpd.serve_forever, name="ngramd-metrics", daemon=True).start()
    log.info("metrics on http://%s:%d/metrics", host, httpd.server_address[1])
    return httpd


class StallLog:
    """Log lines about stalls of ``threshold_ms`` or more, at most one per ``interval_s``.

    Under CPU contention a daemon's threads are kept from running several times a second, and a
    line per stall (120 lines in 7 minutes, issue 18) buries everything else in the journal.
    The first stall after a quiet ``interval_s`` is logged at once (an operator sees it when it
    happens); the ones that follow within the interval are summed into one line (how many, the
    longest, their total) written once the interval has passed.  ``add`` takes the time
    (``time.monotonic`` seconds) as an argument."""

    def __init__(self, threshold_ms: float = 50.0, interval_s: float = 60.0):
        self.threshold_ms = threshold_ms
        self.interval_s = interval_s
        self._last_line = -math.inf  # when the last line was written
        self._count = 0  # stalls since it, not yet logged
        self._longest_ms = self._total_ms = 0.0
        self.lines = 0  # counter: lines written

    def add(self, ms: float, now: float) -> None:
        """One wake-up that came ``ms`` late at ``now``."""
        due = now - self._last_line >= self.interval_s
        if ms >= self.threshold_ms:
            if due and not self._count:
                self._write(now, "a daemon thread was kept from running for %.0f ms", ms)
                return
            self._count += 1
            self._longest_ms = max(self._longest_ms, ms)
            self._total_ms += ms
        if due and self._count:
            self._write(now, "daemon threads were kept from running %d times for >= %.0f ms in "
                        "the last %.0f s (longest %.0f ms, %.1f s in all)", self._count,
                        self.threshold_ms, now - self._last_line, self._longest_ms,
                        self._total_ms / 1e3)
            self._count, self._longest_ms, self._total_ms = 0, 0.0, 0.0

    def _write(self, now: float, msg: str, *args) -> None:
        log.info(msg, *args)
        self._last_line = now
        self.lines += 1


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
    ~0.5 CPU-s per 90 s -- most of an idle daemon's CPU (measured with and without).

    ``clock`` (monotonic seconds) and ``sleep`` are the real ones unless a test passes its own
    and calls ``step`` instead of ``start``."""

    WINDOW_S = 120  # per-second maxima kept for ``recent_ms``

    def __init__(self, period_s: float = 0.01, idle_period_s: float = 0.25,
                 busy=lambda: True, *, clock=time.perf_counter, sleep=time.sleep):
        self.period_s = period_s
        self.idle_period_s = idle_period_s
        self.busy = busy
        self._clock, self._sleep = clock, sleep
        self.hist = LatencyHistogram()
        self.max_ms = 0.0
        self._seconds = collections.deque(maxlen=self.WINDOW_S)  # (unix second, max ms)
        self.log = StallLog()  # stalls of >= 50 ms: one line a minute at most
        self._thread = threading.Thread(target=self._run, name="ngramd-stall", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while True:
            self.step()

    def step(self) -> None:
        """One sleep of the monitor's loop, and the lateness of its wake-up."""
        try:
            period = self.period_s if self.busy() else self.idle_period_s
        except Exception:  # a closing table: measure at the fine period
            period = self.period_s
        t0 = self._clock()
        self._sleep(period)
        now = self._clock()
        late = (now - t0 - period) * 1e6
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
        self.log.add(ms, now)

    def summary(self) -> dict:
        s = self.hist.summary()
        return {"count": s["count"], "p50_us": s["p50_us"], "p99_us": s["p99_us"],
                "p999_us": s["p999_us"], "max_ms": round(self.max_ms, 3),
                # the longest stall of each of the last WINDOW_S seconds, oldest first
                "recent_ms": [[t, round(m, 2)] for t, m in list(self._seconds)]}


#: (op, exception type) -> [monotonic time of the last logged traceback, errors since]
# ---------------------------------------------------------------------------------------------
# systemd and the ipc socket
# ---------------------------------------------------------------------------------------------
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
        "tools for a stopped table: 'ngramd warm FILES' (bulk-count a corpus), 'ngramd compact', "
        "'ngramd restore SNAPSHOT', 'ngramd clear-hot' (remove its hot tier from shared "
        "memory); 'ngramd snapshot [--to-dir]' snapshots a running daemon's table; "
        "'ngramd keygen DIR' writes a CurveZMQ key pair for tcp endpoints.",
        epilog="Flags override the config file; --set overrides anything, e.g. "
               "--set table.hot_budget_mb=256 --set 'server.endpoints=[\"tcp://127.0.0.1:5555\"]'")
    ap.add_argument("-c", "--config", help="TOML file with [table], [table.cold], [server], [fleet]")
    ap.add_argument("--check-config", action="store_true",
                    help="check that the config and the files it names (tokenizer, CURVE keys, "
                         "fleet credentials) are usable, print the effective config (TOML) and "
                         "exit")
    ap.add_argument("--name", help="table name (socket and shm names follow it)")
    ap.add_argument("--data-dir", help="RocksDB parent directory")
    ap.add_argument("--shm-dir", help="directory of the hot tier's shared-memory segments")
    ap.add_argument("--runtime-dir", help="directory of the default ipc socket (default: "
                    "$RUNTIME_DIRECTORY, /run/ngramd for root, else $XDG_RUNTIME_DIR/ngramd)")
    ap.add_argument("--endpoint", action="append", help="bind this endpoint (repeatable)")
    ap.add_argument("--tokenizer", metavar="MODEL",
                    help="the tokenizer the table records: a tokenizer.json, a model directory "
                         "or a .gguf file (its tokenizer is extracted); default: the packaged "
                         "Qwen3 tokenizer; \"none\" records none")
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


def check_files(cfg: DaemonConfig) -> list[str]:
    """``--check-config``: the files the config names exist and load, or ``NgramError`` naming
    the setting and the file -- the tokenizer (its fingerprint is computed, so a GGUF file's
    tokenizer is extracted), the CURVE secret key and the authorized-keys directory, and the
    ``[fleet]`` credentials.  Returns what was checked, one line each (printed as comments)."""
    from .curve import load_key_file
    from .identity import resolve_tokenizer, tokenizer_fingerprint

    notes = []
    try:
        p = resolve_tokenizer(cfg.table.tokenizer)
    except NgramError as e:
        raise NgramError(f"[table] tokenizer: {e}") from None
    if p is not None:
        notes.append(f"[table] tokenizer {p}: fingerprint {tokenizer_fingerprint(p)}")
    s = cfg.server
    if s.curve_secret_key:
        load_key_file(s.curve_secret_key, "[server] curve_secret_key", secret=True)
        notes.append(f"[server] curve_secret_key {s.curve_secret_key}: a secret key")
    if s.curve_authorized_dir:
        if not os.path.isdir(s.curve_authorized_dir):
            raise NgramError(f"[server] curve_authorized_dir {s.curve_authorized_dir}: no such "
                             f"directory")
        notes.append(f"[server] curve_authorized_dir {s.curve_authorized_dir}: a directory")
    if cfg.fleet.enabled:
        from .fleet import check_credentials  # NATS is imported lazily, not here

        check_credentials(cfg.fleet)
        notes.append("[fleet] credentials readable")
    return notes


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
    if argv and argv[0] in ("warm", "compact", "keygen", "snapshot", "restore", "clear-hot"):
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
        try:
            notes = check_files(cfg)
        except NgramError as e:
            print(f"ngramd: bad config: {e}", file=sys.stderr)
            return 2
        sys.stdout.write(to_toml(cfg) + "".join(f"# {n}\n" for n in notes))
        return 0
    setup_logging(cfg.server.log_level)
    tune_malloc()
    # a Python thread that wants the GIL waits at most this long for one running pure-Python
    # code (5 ms by default): the serving loop should not wait on a background thread's loop
    sys.setswitchinterval(0.001)
    from .server import Server  # server.py imports this module's plumbing
    from .table import Table  # late: --check-config needs neither RocksDB nor numba
    from .tools import private_data_dir

    log.info("opening table %r in %s", cfg.table.name, cfg.table.data_dir)
    try:
        private_data_dir(cfg.table.data_dir, cfg.table.name)
    except OSError as e:
        log.error("cannot prepare the data directory: %s", e)
        return 1
    fleet = None
    try:
        if cfg.fleet.enabled:
            from .fleet import bootstrap, check_credentials

            check_credentials(cfg.fleet)
            bootstrap(cfg)  # a new host: the fleet's newest snapshot becomes its table
        table = Table(cfg.table)
    except NgramError as e:
        log.error("cannot open the table: %s", e)
        return 1
    if not cfg.fleet.enabled and table.cold.log_hold is not None:
        log.warning("[fleet] is off: records this host had not published yet will not be; "
                    "the ingest log is released as usual again")
        table.cold.hold_log(None)
    if cfg.fleet.enabled:
        from .fleet import Fleet, load_host_id

        fleet = Fleet(cfg.fleet, table, load_host_id(cfg.fleet, cfg.table.data_dir,
                                                     cfg.table.name), cfg.table.data_dir)
        fleet.start()  # in the background: a NATS outage never holds the table back
    server = Server(table, cfg.server, fleet=fleet,
                    reload=lambda: resolve(load_daemon_config(args.config, sets)))
    server.snapshot_dir = Path(cfg.fleet.snapshot_dir or Path(cfg.table.data_dir) / "snapshots")
    try:
        server.install_signals()
        server.bind()
        server.start_metrics()
    except (NgramError, zmq.ZMQError, OSError) as e:
        log.error("cannot listen: %s", e)
        server.close_sockets()
        if fleet is not None:
            fleet.stop()
        table.close()
        return 1
    server.serve()
    say_hot_kept(cfg.table.shm_dir, cfg.table.name)
    return 0


def say_hot_kept(shm_dir: str, name: str) -> None:
    """At a clean exit, say what is left in shared memory and how to remove it: the hot
    generation stays published on purpose (generators keep drafting from it, and a restarted
    daemon serves at once), so a daemon stopped for good leaves it behind (72-133 MB seen)."""
    d = Path(shm_dir)
    try:
        kept = [p for p in d.iterdir() if p.name.startswith(f"{name}.")]
        size = sum(p.stat().st_size for p in kept)
    except OSError:
        return
    if kept:
        log.info("kept the hot tier of %r in %s (%d files, %.0f MiB) so that generators keep "
                 "drafting and a restart serves at once; once the table is retired, remove it "
                 "with: ngramd clear-hot --name %s --shm-dir %s", name, d, len(kept),
                 size / 2**20, name, d)


if __name__ == "__main__":
    sys.exit(main())
