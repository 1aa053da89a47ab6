"""``ngram-client ingest``: files tokenized and streamed to the daemon, resumably, and the
flush that waits until the daemon has counted them (``ingest --flush``, ``flush``).

Progress is kept per table (:class:`IngestState`, a file under :func:`state_dir`); groups of
blocks are tokenized together (:func:`_ingest_groups`) and sent with a few requests in flight
(:class:`_IngestSender`), only acknowledged offsets being recorded.  What is text is decided
by ``ngramd.wire.corpus``, the rule ``ngramd warm`` follows too.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

from ngramd.wire import progress
from ngramd.wire.corpus import IDS_SUFFIX, collect, load_ids
from ngramd.wire.corpus import text_blocks as _blocks
from ngramd.wire.errors import NgramError

from .client import DaemonError, DaemonUnavailable, NgramClient, Timeout, busy_retry_s

#: the command line's logger: the warnings of ``ngram-client ingest`` read as they always have
log = logging.getLogger("ngram_client.cli")

STATE_VERSION = 2  # 2: keyed by table; 1 (./.ngram-ingest.json, any table) is ignored


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
# flush: waiting for the counts
# ---------------------------------------------------------------------------------------------
#: a flush that has not answered after this long shows the daemon counting (s)
FLUSH_QUIET_S = 2.0


def flush_with_progress(c: NgramClient, progress: bool = True) -> int:
    """``c.flush()``; past ``FLUSH_QUIET_S`` without an answer, a progress bar on stderr shows
    the daemon counting its log (records counted of those waiting, from ``stats`` once a
    second) instead of minutes of silence after an ingest's own bar reached 100%."""
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
