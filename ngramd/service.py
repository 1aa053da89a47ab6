"""The ``ngramd`` command line (``main``): the config, logging for journald, malloc tuning,
and starting a daemon -- the table, the fleet and the server, put together here.
``server.py`` is the server itself (sockets, dispatch, jobs, systemd notify and watchdog, the
ipc socket path); the ops are declared in ``wire/commands.py`` and handled in
``handlers.py``; the metrics HTTP server is in ``metrics.py``, the stall monitor in
``stats.py``; the offline subcommands (``ngramd warm``, ...) are ``tools.py``.

``import ngramd.service`` and ``ngramd --check-config`` load neither numba nor RocksDB: the
table and the server are imported only when a daemon starts (tested in tests/test_server.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import zmq

from .config import DaemonConfig, load_daemon_config, resolve, to_toml
from .wire.errors import BadInput, NgramError

log = logging.getLogger("ngramd.service")


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
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
    the setting and the file -- the data directory (a directory, or a path where one can be
    made), the tokenizer (its fingerprint is computed, so a GGUF file's tokenizer is
    extracted), the CURVE secret key and the authorized-keys directory, and the ``[fleet]``
    credentials.  Returns what was checked, one line each (printed as comments)."""
    from .wire.curve import load_key_file
    from .wire.identity import resolve_tokenizer, tokenizer_fingerprint

    from .tools import not_a_directory

    notes = []
    blocked = not_a_directory(Path(cfg.table.data_dir) / cfg.table.name)
    if blocked is not None:
        raise NgramError(f"[table] data_dir {cfg.table.data_dir!r}: {blocked} is a file; it "
                         f"must be a directory, or a path where one can be created")
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
    os.umask(0o007)  # sockets, segments and files: owner and group only (ARCHITECTURE §10)
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
    from .tools import private_data_dir

    log.info("opening table %r in %s", cfg.table.name, cfg.table.data_dir)
    try:  # before numba and RocksDB load: a refused directory is said at once
        private_data_dir(cfg.table.data_dir, cfg.table.name)
    except BadInput as e:  # a setting to change, as a bad config (exit 2)
        log.error("cannot prepare the data directory: %s", e)
        return 2
    except (OSError, NgramError) as e:
        log.error("cannot prepare the data directory: %s", e)
        return 1
    fleet = None
    try:
        table = open_table(cfg)
    except NgramError as e:
        log.error("cannot open the table: %s", e)
        return 1
    if not cfg.fleet.enabled and table.cold.log.ilog.hold is not None:
        log.warning("[fleet] is off: records this host had not published yet will not be; "
                    "the ingest log is released as usual again")
        table.cold.log.ilog.set_hold(None)
    if cfg.fleet.enabled:
        from .fleet import Fleet, load_host_id

        fleet = Fleet(cfg.fleet, table, load_host_id(cfg.fleet, cfg.table.data_dir,
                                                     cfg.table.name), cfg.table.data_dir)
        fleet.start()  # in the background: a NATS outage never holds the table back
    from .server import Server

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


def open_table(cfg: DaemonConfig):
    """The daemon's table (a ``Table``): a new fleet host's bootstrap first, then the hot tier
    (with shared memory empty, the table's image is published before numba and RocksDB load,
    ~0.3 s quiet and twice that on a busy host, and generators that map the table draft from
    it meanwhile), then the table itself.  Raises ``NgramError``."""
    if cfg.fleet.enabled:
        from .fleet import bootstrap, check_credentials

        check_credentials(cfg.fleet)
        bootstrap(cfg)  # a new host: the fleet's newest snapshot becomes its table
    from .config import table_identity_of
    from .hot.image import start_publisher

    started = start_publisher(cfg.table, table_identity_of(cfg.table))
    from .table import Table  # late: --check-config needs neither RocksDB nor numba

    return Table(cfg.table, started=started)


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
