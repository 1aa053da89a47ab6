"""Offline maintenance of a stopped table (``ngramd warm``, ``ngramd compact``), key pairs for
CurveZMQ (``ngramd keygen``) and the data directory's permissions.

``ngramd warm [-c CONFIG] [--set ...] FILES/DIRS...`` counts a corpus straight into the cold
tier (``ColdStore.bulk_load``: one new run, all or nothing, both cores, memory bounded by
``--mem-mb``), then ranks the table and writes its hot image (``ngramd.hot.image``; not with
``--no-hot-image``), so the daemon's first start serves a full hot tier at once.  Text files are tokenized with the table's tokenizer (``[table] tokenizer`` or
``--tokenizer``; its fingerprint must match the one the table records) in parallel batches;
``.npy`` files are taken as token ids already (one 1-D integer array = one sequence).  Which
files are counted is ``ngramd.wire.corpus``'s rule, the same as ``ngram-client ingest``'s: files
that are not UTF-8 text are refused by name when named (``--skip-bad`` skips them) and
skipped, in one summary line, when found in a directory.

``ngramd compact`` merges every run into one (fewest reads, exact entry counts) and reclaims
the space of merged-away pages.

Both need the table's RocksDB lock: stop the daemon first (a running ngramd is reported).

``ngramd snapshot [--to-dir]`` asks the running daemon for a consistent snapshot of its table
(``ngramd/fleet.py``): to the fleet's JetStream object store, or to ``[fleet] snapshot_dir``.
``ngramd restore FILE`` unpacks such a file as the config's table, which must not exist yet
(a fleet host with ``bootstrap = true`` does this itself from the object store).  A snapshot
carries the table's hot image, so the restored daemon serves a full hot tier at once.

``ngramd clear-hot`` removes a stopped table's hot tier from shared memory (a daemon leaves it
published at exit, on purpose: generators keep drafting and a restart serves at once).

``ngramd keygen DIR [--name NAME]`` writes ``DIR/NAME.key`` (public) and ``DIR/NAME.key_secret``
(mode 600) in pyzmq's certificate format: ``server`` for the daemon's ``curve_secret_key``,
any other name for a client (its ``.key`` goes into ``curve_authorized_dir``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

from .config import load_daemon_config, resolve
from .wire.errors import TIMEOUT, UNAVAILABLE, BadInput, NgramError, StorageError

log = logging.getLogger("ngramd.tools")

#: bytes of text per tokenizer batch (encode_batch runs on all cores)
TEXT_BATCH_BYTES = 8 << 20
#: longest piece of a file tokenized as one sequence (as ``ngram-client ingest --block-bytes``):
#: a big file is split at newlines so that its blocks tokenize in parallel and show progress
TEXT_BLOCK_BYTES = 4 << 20


def read_corpus(files: list[Path], tokenizer, vocab_size: int, progress: bool = True
                ) -> tuple[np.ndarray, np.ndarray, dict]:
    """Token ids of every file as ``(tokens, offsets, info)``; the files are those
    ``ngramd.wire.corpus.collect`` kept: UTF-8 text, read in blocks of ``TEXT_BLOCK_BYTES`` cut at
    newlines (``corpus.text_blocks``, as ``ngram-client ingest`` reads them: one sequence a
    block), or ``.npy`` token ids (one sequence a file).  The progress bar counts bytes."""
    from tqdm import tqdm

    from .wire.corpus import IDS_SUFFIX, load_ids, text_blocks

    seqs: list[np.ndarray] = []
    info = {"files": 0, "skipped_empty": 0, "text_bytes": 0, "tokenize_s": 0.0}
    texts: list[str] = []
    pending = 0
    bar = tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True,
               disable=not progress, file=sys.stderr, desc="read")

    def flush_texts():
        nonlocal texts, pending
        if texts:
            t0 = time.perf_counter()
            for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
                seqs.append(np.asarray(enc.ids, np.uint32))
            info["tokenize_s"] += time.perf_counter() - t0
            bar.update(pending)
        texts, pending = [], 0

    for f in files:
        info["files"] += 1
        if f.suffix == IDS_SUFFIX:
            seqs.append(load_ids(f, vocab_size))
            bar.update(f.stat().st_size)
            continue
        if tokenizer is None:
            raise SystemExit("ngramd warm: text files need a tokenizer ([table] tokenizer or "
                             "--tokenizer)")
        start = 0
        for end, text in text_blocks(f, 0, TEXT_BLOCK_BYTES):
            texts.append(text)
            info["text_bytes"] += end - start
            pending += end - start
            start = end
            if pending >= TEXT_BATCH_BYTES:
                flush_texts()
    flush_texts()
    bar.close()
    n_seqs = len(seqs)
    seqs = [s for s in seqs if s.size >= 2]
    info["skipped_empty"] = n_seqs - len(seqs)
    offsets = np.zeros(len(seqs) + 1, np.int64)
    np.cumsum([s.size for s in seqs], out=offsets[1:])
    tokens = np.concatenate(seqs) if seqs else np.zeros(0, np.uint32)
    return tokens, offsets, info


def private_data_dir(data_dir: str, name: str) -> Path:
    """Create the table's directory ``<data_dir>/<name>``; make it and ``data_dir`` 0700.

    ngramd runs with umask 007 so that its group (generators) can read the shared-memory
    segments and use the ipc socket; directories made under that umask are 0770, and any
    group member could then delete or replace RocksDB files.  Nothing in the data dir is for
    the group.  ``data_dir`` is meant to be ngramd's own (the unit's StateDirectory); one
    owned by another user is left as it is, with a warning.  A directory that holds a model
    is refused before anything is made or changed in it (``refuse_foreign_dir``)."""
    root = Path(data_dir)
    path = root / name
    where = f"--data-dir / [table] data_dir {str(data_dir)!r}"
    must = "it must be a directory, or a path where one can be created"
    blocked = not_a_directory(path)
    if blocked is not None:
        what = (f"{blocked} (where table {name!r} goes) is a file" if blocked == path
                else f"{blocked} is a file, not a directory")
        raise BadInput(f"{where}: {what}; {must}")
    refuse_foreign_dir(root, path, name)
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise NgramError(f"{where}: cannot create {path}: {e.strerror or e}; {must}, by the "
                         f"user ngramd runs as") from None
    for d in (root, path):
        try:
            os.chmod(d, 0o700)
        except PermissionError:
            log.warning("cannot make %s owner-only (owned by uid %d): group members may be "
                        "able to change table files", d, d.stat().st_uid)
    return path


def not_a_directory(path: Path) -> Path | None:
    """The first of ``path`` and its parents that exists, when it is not a directory (a
    regular file, say: nothing can be made under it); None otherwise."""
    for p in (path, *path.parents):
        if p.exists():
            return None if p.is_dir() else p
    return None


# files that say a directory is a model's (a Hugging Face checkpoint, an exported one, a GGUF
# file's folder), never a table's: a README once put a table and an exported model both at
# var/smollm2, and RocksDB's CURRENT, LOCK and MANIFEST landed beside model.safetensors
_MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json",
                "generation_config.json")
_MODEL_SUFFIXES = (".safetensors", ".gguf")


def model_files_in(d: Path) -> list[str]:
    """The names in ``d`` that mark it as a model's directory (sorted; [] when none or when
    ``d`` does not exist)."""
    try:
        names = [e.name for e in os.scandir(d) if e.is_file()]
    except OSError:
        return []
    return sorted(n for n in names if n in _MODEL_FILES or n.endswith(_MODEL_SUFFIXES))


def refuse_foreign_dir(root: Path, path: Path, name: str) -> None:
    """``NgramError`` when the table directory ``path`` (``<root>/<name>``), or the data dir
    ``root`` itself, holds a model's files and ``path`` holds no table yet (no RocksDB
    ``CURRENT``): a table is never created inside a model or another program's directory.
    An existing table is opened as before, wherever it is."""
    if (path / "CURRENT").is_file():
        return
    for d in (path, root):
        found = model_files_in(d)
        if found:
            shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
            raise NgramError(
                f"{d} holds a model's files ({shown}), not a table: ngramd will not create "
                f"table {name!r} in it.  Choose another directory: --data-dir DIR (the table "
                f"goes to DIR/{name}) or another --name")


def _open(cfg, args):
    from .cold.store import ColdStore
    from .wire.identity import table_identity

    t = cfg.table
    ident = table_identity(n_min=t.n_min, n_max=t.n_max, cold_k=t.cold_k,
                           vocab_size=t.vocab_size, tokenizer=t.tokenizer)
    path = private_data_dir(t.data_dir, t.name)
    try:
        return ColdStore(path, ident, t.cold)
    except StorageError as e:
        if "lock" in str(e).lower():
            raise SystemExit(f"ngramd {args.cmd}: table {t.name!r} at {path} is in use (is "
                             f"ngramd running for it? stop it first): {e}") from None
        raise


def cmd_warm(cfg, args) -> int:
    from tqdm import tqdm

    from .wire.corpus import collect
    from .wire.identity import open_tokenizer, resolve_tokenizer

    # the tokenizer the table records (--tokenizer is folded into [table] tokenizer by main):
    # text is tokenized with the one the identity names, never another
    p = resolve_tokenizer(cfg.table.tokenizer)
    tok = open_tokenizer(p) if p is not None else None
    t0 = time.perf_counter()
    corpus = collect(args.files)
    stop = corpus.refusal(args.skip_bad)
    if stop:
        print(f"ngramd warm: {stop}", file=sys.stderr)
        return 2
    tokens, offsets, info = read_corpus(corpus.files, tok, cfg.table.vocab_size,
                                        progress=not args.no_progress)
    t_read = time.perf_counter() - t0
    if not tokens.size:
        print(f"nothing to count: {info['files']} file(s), no sequence of 2 tokens or more")
        return 0
    with _open(cfg, args) as store:
        bar = tqdm(total=1, unit="part", disable=args.no_progress, file=sys.stderr,
                   desc="count")

        def progress(done, n):
            bar.total = n
            bar.n = done
            bar.refresh()

        t1 = time.perf_counter()
        run = store.bulk_load(tokens, offsets, threads=args.threads, mem_mb=args.mem_mb,
                              progress=progress)
        t_load = time.perf_counter() - t1
        bar.close()
        st = store.stats()
        image = None if args.no_hot_image else _write_hot_image(store, cfg)
    left_out = len(corpus.skipped) + len(corpus.refused)
    print(f"warmed table {cfg.table.name!r}: {tokens.size} tokens from {info['files']} file(s) "
          f"({left_out} not text, skipped) -> run {run.id}: {run.rows} rows, "
          f"{run.pages} pages, {run.bytes / 2**20:.1f} MiB")
    print(f"read + tokenize {t_read:.1f} s, count + write {t_load:.1f} s "
          f"({tokens.size / max(t_load, 1e-9) / 1e3:.0f}k tokens/s); table: {st['runs']} runs, "
          f"{st['run_rows']} rows")
    if image:
        print(f"hot image: {image['entries']} entries, {image['bytes'] / 2**20:.1f} MiB, "
              f"ranked and written in {image['seconds']:.1f} s (the first start serves it)")
    return 0


def _write_hot_image(store, cfg) -> dict | None:
    """Rank the warmed table and write its hot image (``table.write_table_image``), so the
    daemon's first start serves a full hot tier instead of an empty one while it ranks."""
    from .table import write_table_image

    t0 = time.perf_counter()
    w = write_table_image(store, cfg.table)
    if w is not None:
        w["seconds"] = time.perf_counter() - t0
    return w


def cmd_compact(cfg, args) -> int:
    with _open(cfg, args) as store:
        before = store.stats()
        t0 = time.perf_counter()
        store.compact()
        st = store.stats()
    print(f"compacted table {cfg.table.name!r}: {before['runs']} runs -> {st['runs']}, "
          f"{st['run_rows']} rows, {st['sst_bytes'] / 2**20:.1f} MiB on disk, "
          f"{time.perf_counter() - t0:.1f} s")
    return 0


def cmd_clear_hot(cfg, args) -> int:
    """Remove a stopped table's hot tier from shared memory (``[table] shm_dir``): a daemon
    keeps it at exit so that generators keep drafting and a restart serves at once; a table
    retired for good leaves it behind.  Refused while a daemon publishes the table (the lock
    of its control file)."""
    from .hot.segments import HotPublisher
    from .wire.identity import TableIdentity

    t = cfg.table
    d = Path(t.shm_dir)
    files = sorted(p for p in d.glob(f"{t.name}.*")) if d.is_dir() else []
    if not files:
        print(f"no hot tier of table {t.name!r} in {d}")
        return 0
    size = sum(p.stat().st_size for p in files)
    try:  # the publisher's lock: refused while a daemon serves the table
        HotPublisher(d, t.name, TableIdentity()).close(unlink=True)
    except StorageError as e:
        print(f"ngramd clear-hot: {e}; stop it first", file=sys.stderr)
        return 1
    left = [p for p in d.glob(f"{t.name}.*")]
    for p in left:  # a recent segment of a daemon killed -9
        p.unlink(missing_ok=True)
    try:  # the directory too when nothing else is in it (an empty /dev/shm/ngramd/ was left)
        d.rmdir()
    except OSError:
        pass  # another table's tier, or not ours to remove
    print(f"removed the hot tier of table {t.name!r} from {d}: {len(files)} files, "
          f"{size / 2**20:.1f} MiB")
    return 0


def cmd_snapshot(cfg, args) -> int:
    """Ask the running daemon for a snapshot (it owns the table): to the fleet's object store,
    or with ``--to-dir`` to ``[fleet] snapshot_dir``."""
    from .wire.progress import run

    endpoint = args.endpoint or resolve(cfg).server.endpoints[0]
    m = run(lambda: ask_daemon(endpoint, "snapshot", to_dir=args.to_dir), "snapshot")
    print(f"snapshot {m['name']}: {m['bytes'] / 2**20:.1f} MiB, applied seq {m['applied']}, "
          f"stream seq {m['stream_seq']}, {m['seconds']} s -> {m['stored']}")
    return 0


def ask_daemon(endpoint: str, op: str, timeout_ms: int = 10_000, **kw):
    """One call of the declared op ``op`` (not a batch op) to a running daemon, and its value
    (the declaration's ``decode``): the offline tools' whole client, so that the daemon's
    package never imports ``ngram_client``.  The request is built by the op's ``message``
    from ``kw`` and sent once, if a connection is made within ``timeout_ms``; the reply may
    take the op's own ``timeout_ms`` (``SLOW_TIMEOUT_MS`` for a snapshot), else
    ``timeout_ms``.  ``tcp://`` endpoints speak CurveZMQ with ``$NGRAM_SERVER_KEY`` and
    ``$NGRAM_CLIENT_KEY`` as ``NgramClient`` does.  An error reply raises ``NgramError``
    with the daemon's code (message ``code: msg``, or the bare message for ``unavailable``),
    as ``NgramClient`` raises it."""
    import zmq

    from .wire import protocol as P
    from .wire.commands import COMMANDS
    from .wire.curve import client_keys

    spec = COMMANDS[op]
    keys = client_keys(endpoint, os.environ.get("NGRAM_SERVER_KEY"),
                       os.environ.get("NGRAM_CLIENT_KEY"))
    with zmq.Context.instance().socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # writable only once connected
        if keys:
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys
        sock.connect(endpoint)
        if not sock.poll(timeout_ms, zmq.POLLOUT):
            raise NgramError(f"{op}: no connection to {endpoint} in {timeout_ms} ms; the "
                             f"request was not sent", UNAVAILABLE)
        sock.send_multipart(P.encode_request(op, 1, spec.message(**kw).fields))
        wait_ms = spec.timeout_ms or timeout_ms
        if not sock.poll(wait_ms):
            raise NgramError(f"{op}: sent to {endpoint} but not answered within {wait_ms} ms",
                             TIMEOUT)
        reply = P.decode_reply(sock.recv_multipart(copy=False))
    if not reply.ok:
        code, msg = str(reply.fields.get("code")), str(reply.fields.get("msg"))
        raise NgramError(msg if code == UNAVAILABLE else f"{code}: {msg}", code)
    return spec.decode(reply)


def cmd_restore(cfg, args) -> int:
    """Unpack a snapshot file as this config's table (which must not exist yet)."""
    from .snapshots import restore_snapshot
    from .wire.progress import run

    m = run(lambda: restore_snapshot(args.snapshot, cfg), f"restore {args.snapshot}")
    print(f"restored {m['name']} (host {m['host']}, applied seq {m['applied']}, stream seq "
          f"{m['stream_seq']}) as table {cfg.table.name!r} in {cfg.table.data_dir}"
          f"{'' if m.get('hot_image') else '; no hot image in it: the first start ranks'}")
    return 0


def cmd_keygen(args) -> int:
    """Write a CurveZMQ key pair (``zmq.auth.create_certificates``); the secret file is created
    under umask 077, so it is never readable by others, not even for a moment."""
    import zmq.auth

    d = Path(args.dir)
    files = [d / f"{args.name}.key", d / f"{args.name}.key_secret"]
    if not args.force and any(f.exists() for f in files):
        print(f"ngramd keygen: {files[0]} or {files[1]} exists; --force replaces them",
              file=sys.stderr)
        return 1
    old = os.umask(0o077)
    try:
        d.mkdir(parents=True, exist_ok=True)
        public, secret = zmq.auth.create_certificates(d, args.name)
    finally:
        os.umask(old)
    os.chmod(secret, 0o600)  # --force: open() kept an existing file's mode
    os.chmod(public, 0o644)  # a public key is meant to be handed out
    print(f"public key: {public}\nsecret key: {secret} (mode 600: keep it there)")
    if args.name == "server":
        print(f"daemon:  [server] curve_secret_key = \"{secret}\"\n"
              f"clients: ngram-client --server-key {public}  (or NGRAM_SERVER_KEY)")
    else:
        print(f"client:  ngram-client --client-key {secret}  (or NGRAM_CLIENT_KEY)\n"
              f"daemon:  copy {public} into its curve_authorized_dir")
    return 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="ngramd", description="Offline tools for a stopped table.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-c", "--config", help="the daemon's TOML config")
    common.add_argument("--name", help="table name")
    common.add_argument("--data-dir", help="RocksDB parent directory")
    common.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    common.add_argument("--log-level", default="INFO")
    w = sub.add_parser("warm", parents=[common], help="count a corpus into the table (bulk)")
    w.add_argument("files", nargs="+", help="text files, .npy token arrays, directories")
    w.add_argument("--tokenizer", metavar="MODEL",
                   help="the table's tokenizer: a tokenizer.json, a model directory or a .gguf "
                        "file (default: [table] tokenizer)")
    w.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    w.add_argument("--mem-mb", type=int, default=2048,
                   help="RAM for counting (more: fewer passes over the corpus)")
    w.add_argument("--skip-bad", action="store_true",
                   help="skip named files that are not UTF-8 text instead of refusing the run "
                        "(files in directories are always skipped, in one summary line)")
    w.add_argument("--no-progress", action="store_true")
    w.add_argument("--no-hot-image", action="store_true",
                   help="do not rank the table and write its hot image (the daemon's first "
                        "start then ranks it, serving an empty hot tier meanwhile)")
    sub.add_parser("compact", parents=[common], help="merge every run into one")
    h = sub.add_parser("clear-hot", parents=[common],
                       help="remove a stopped table's hot tier from shared memory")
    h.add_argument("--shm-dir", help="the hot tier's directory (default: [table] shm_dir)")
    s = sub.add_parser("snapshot", parents=[common],
                       help="snapshot the running daemon's table (fleet object store)")
    s.add_argument("--to-dir", action="store_true",
                   help="write to [fleet] snapshot_dir instead of the object store")
    s.add_argument("--endpoint", help="the daemon (default: from the config)")
    r = sub.add_parser("restore", parents=[common],
                       help="unpack a snapshot file as a new table (stopped daemon)")
    r.add_argument("snapshot", help="a .tar written by 'ngramd snapshot --to-dir'")
    k = sub.add_parser("keygen", help="write a CurveZMQ key pair (tcp endpoints)")
    k.add_argument("dir", help="directory of the key files (created)")
    k.add_argument("--name", default="server",
                   help="file name: 'server' (default) for the daemon, any other for a client")
    k.add_argument("--force", action="store_true", help="replace existing key files")
    args = ap.parse_args(argv)
    if args.cmd == "keygen":
        return cmd_keygen(args)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sets = list(args.set)
    if args.name:
        sets.append(f'table.name="{args.name}"')
    if args.data_dir:
        sets.append(f'table.data_dir="{args.data_dir}"')
    if getattr(args, "shm_dir", None):
        sets.append(f"table.shm_dir={json.dumps(args.shm_dir)}")
    if getattr(args, "tokenizer", None):
        sets.append(f"table.tokenizer={json.dumps(args.tokenizer)}")
    try:
        cfg = load_daemon_config(args.config, tuple(sets))
        return {"warm": cmd_warm, "compact": cmd_compact, "snapshot": cmd_snapshot,
                "restore": cmd_restore, "clear-hot": cmd_clear_hot}[args.cmd](cfg, args)
    except NgramError as e:
        print(f"ngramd {args.cmd}: {e}", file=sys.stderr)
        return 1
