"""SST files written by a helper process, so that the daemon's threads never wait for them.

Why a process of its own: rocksdict's ``SstFileWriter`` holds the GIL for the whole of every
call, and RocksDB's ``SstFileWriter`` does file I/O inside them: each 1 MiB it writes it asks
the kernel to drop the whole file from the page cache (``posix_fadvise(DONTNEED)``, its
``invalidate_page_cache`` default, which the C API cannot turn off).  The kernel then starts
writeback of the dirty pages, waits on pages already under writeback, and, when a page could
not be dropped, drains every CPU's LRU lists (``lru_add_drain_all``: it waits until a kernel
worker has run on each CPU).  Beside busy processes that wait is unbounded (seconds: the
kernel stacks and the stalls are in ARCHITECTURE §5.9 and bench/RESULTS.md), and with the GIL
held every thread of the daemon, the serving loop included, waited with it.  A helper process
has its own GIL: the daemon's writing thread waits on a pipe (GIL released) while the helper
writes.

The protocol, over the helper's stdin and stdout: a frame is a 4-byte big-endian length and a
msgpack map; a request's map may name ``sizes``, the byte lengths of raw payloads that follow
it.  Every request gets one reply frame: ``{"error": text}`` or the op's result.

* ``begin {stem, file_bytes, sync_bytes, compression, block_size_kb}``: a new set of files
  ``{stem}-{k}.sst``, a new one each ``file_bytes``; each ``sync_bytes`` written the current
  file is ``fdatasync``ed (the page cache then holds little of it dirty when ``finish``
  fsyncs it).
* ``put {prefix}`` + payloads ``ids`` (u64), ``bstart`` (i64, len + 1), ``blob``: one value
  per id, key ``prefix + id`` (u64 BE), value ``blob[bstart[i]:bstart[i + 1]]``; ids ascend.
  Replies ``{bytes}``, written so far.
* ``finish``: the last file is synced and finished; replies ``{files}``.
* ``abort``: the files are removed.

The helper ignores SIGINT, SIGTERM and SIGHUP (a terminal's Ctrl-C, a service manager's stop
and reload are the daemon's to act on) and exits when its stdin closes: when the daemon closes
it or is gone.  The parent side is ``SstHelper``; ``helpers`` keeps idle ones for reuse.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path

import msgpack
import numpy as np
from rocksdict import BlockBasedOptions, DBCompressionType, Options, SstFileWriter

COMPRESSION = {
    "zstd": DBCompressionType.zstd, "lz4": DBCompressionType.lz4,
    "none": DBCompressionType.none,
}
_LEN = struct.Struct(">I")
PIPE_BYTES = 1 << 20  # the request pipe's capacity (fewer, larger writes)


def file_options(compression: str, block_size_kb: int) -> Options:
    """What an SST file of pages is written with: the pages family's compression and block
    size (what else the family sets concerns reading and memtables, not the file)."""
    o = Options(raw_mode=True)
    bb = BlockBasedOptions()
    bb.set_block_size(block_size_kb << 10)
    o.set_block_based_table_factory(bb)
    o.set_compression_type(COMPRESSION[compression]())
    return o


# ---------------------------------------------------------------------------------------------
# the helper process
# ---------------------------------------------------------------------------------------------
class _Files:
    """The helper's state: the files of one ``begin``."""

    def __init__(self, stem: str, file_bytes: int, sync_bytes: int, compression: str,
                 block_size_kb: int):
        self.stem, self.file_bytes, self.sync_bytes = stem, file_bytes, sync_bytes
        self.options = file_options(compression, block_size_kb)
        self.files: list[str] = []
        self.sst = None
        self.in_file = self.unsynced = self.bytes = 0

    def put(self, prefix: bytes, ids: np.ndarray, bstart: np.ndarray, blob: bytes) -> None:
        bs = bstart.tolist()
        for i, pid in enumerate(ids.tolist()):
            if self.sst is None or self.in_file >= self.file_bytes:
                self._next_file()
            n = bs[i + 1] - bs[i]
            self.sst[prefix + pid.to_bytes(8, "big")] = blob[bs[i]:bs[i + 1]]
            self.in_file += n
            self.unsynced += n
            self.bytes += n
            if self.unsynced >= self.sync_bytes:
                self._sync()

    def _next_file(self) -> None:
        self._close_file()
        path = f"{self.stem}-{len(self.files)}.sst"
        sst = SstFileWriter(self.options)
        sst.open(path)
        self.sst = sst
        self.files.append(path)
        self.in_file = 0

    def _sync(self) -> None:
        self.unsynced = 0
        fd = os.open(self.files[-1], os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def _close_file(self) -> None:
        if self.sst is not None:
            self._sync()
            self.sst.finish()
            self.sst = None

    def finish(self) -> list[str]:
        self._close_file()
        return self.files

    def abort(self) -> None:
        self.sst = None
        for f in self.files:
            with contextlib.suppress(OSError):
                os.unlink(f)
        self.files = []


def _read_exact(f, n: int) -> bytes | None:
    buf = f.read(n)
    if len(buf) < n:
        return None
    return buf


def _serve(inp, out) -> None:
    files: _Files | None = None
    while True:
        head = _read_exact(inp, 4)
        if head is None:
            return
        req = msgpack.unpackb(_read_exact(inp, _LEN.unpack(head)[0]) or b"\xc0")
        payload = [_read_exact(inp, n) for n in req.get("sizes", ())]
        if any(p is None for p in payload):
            return
        try:
            op = req["op"]
            if op == "begin":
                if files is not None:
                    files.abort()
                files = _Files(req["stem"], req["file_bytes"], req["sync_bytes"],
                               req["compression"], req["block_size_kb"])
                reply = {}
            elif files is None:
                raise RuntimeError(f"{op} before begin")
            elif op == "put":
                ids = np.frombuffer(payload[0], np.uint64)
                files.put(req["prefix"], ids, np.frombuffer(payload[1], np.int64), payload[2])
                reply = {"bytes": files.bytes}
            elif op == "finish":
                reply, files = {"files": files.finish()}, None
            elif op == "abort":
                files.abort()
                reply, files = {}, None
            else:
                raise RuntimeError(f"unknown op {op!r}")
        except Exception as e:  # rocksdict raises bare Exception("IO error: ...")
            reply = {"error": str(e) or type(e).__name__}
        body = msgpack.packb(reply)
        out.write(_LEN.pack(len(body)) + body)
        out.flush()


def main() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # the reply channel carries frames only
    _serve(sys.stdin.buffer, out)


# ---------------------------------------------------------------------------------------------
# the daemon's side
# ---------------------------------------------------------------------------------------------
class HelperGone(Exception):
    """The helper process exited (or closed its pipes) during a request."""


class SstHelper:
    """One helper process, used by one writer at a time (``helpers.acquire``/``release``).
    ``call`` sends a request and waits for its reply without the GIL (pipe I/O); an error the
    helper met is raised as ``Exception(its text)`` (what rocksdict raises in-process, so
    ``runs.storage`` words it the same), a helper that died as ``HelperGone``."""

    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ngramd.cold.sstwriter"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, close_fds=True)
        with contextlib.suppress(OSError):  # F_SETPIPE_SZ; a smaller pipe works, slower
            import fcntl
            fcntl.fcntl(self.proc.stdin.fileno(), 1031, PIPE_BYTES)
        self.broken = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def call(self, req: dict, *payload) -> dict:
        if self.broken:
            raise HelperGone(f"the SST writer process {self.pid} is gone")
        views = [memoryview(p).cast("B") for p in payload]
        if views:
            req = {**req, "sizes": [v.nbytes for v in views]}
        body = msgpack.packb(req)
        try:
            w = self.proc.stdin
            w.write(_LEN.pack(len(body)) + body)
            for v in views:
                w.write(v)
            w.flush()
            head = _read_exact(self.proc.stdout, 4)
            reply = None if head is None else _read_exact(self.proc.stdout,
                                                          _LEN.unpack(head)[0])
        except (BrokenPipeError, ConnectionResetError, ValueError):
            reply = None
        if reply is None:
            self.broken = True
            rc = self.proc.poll()
            raise HelperGone(f"the SST writer process {self.pid} exited"
                             + (f" (code {rc})" if rc is not None else ""))
        out = msgpack.unpackb(reply)
        if "error" in out:
            raise Exception(out["error"])
        return out

    def close(self, timeout_s: float = 5.0) -> None:
        """Close its stdin (it exits at EOF) and reap it; kill it past ``timeout_s``."""
        self.broken = True
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(1.0)
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdout.close()


class Helpers:
    """Idle helper processes of this process, for reuse: a writer ``acquire``s one (a new one
    when none is idle: ~0.2 s to start) and ``release``s it when its run is finished or
    aborted; a helper that broke is closed instead.  Idle ones are closed at exit.  As many
    helpers live as writers ever ran at once (the spiller, the merger, a bulk load: 1-3),
    ~35 MB of RSS each when idle, plus the one request they hold while writing it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._idle: list[SstHelper] = []
        self._atexit = False

    def acquire(self) -> SstHelper:
        with self._lock:
            while self._idle:
                h = self._idle.pop()
                if h.proc.poll() is None:
                    return h
                h.close()
            if not self._atexit:
                atexit.register(self.close)
                self._atexit = True
        return SstHelper()

    def release(self, h: SstHelper) -> None:
        if h.broken or h.proc.poll() is not None:
            h.close()
            return
        with self._lock:
            self._idle.append(h)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for h in idle:
            h.close()


helpers = Helpers()


def remove_files(stem: str) -> None:
    """Remove the files of ``stem`` (a writer whose helper died cannot ask it to)."""
    d, name = os.path.split(stem)
    with contextlib.suppress(OSError):
        for f in Path(d).glob(f"{name}-*.sst"):
            with contextlib.suppress(OSError):
                f.unlink()


if __name__ == "__main__":
    main()
