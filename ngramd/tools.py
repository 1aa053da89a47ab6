"""Offline maintenance of a stopped table (``ngramd warm``, ``ngramd compact``), key pairs for
CurveZMQ (``ngramd keygen``) and the data directory's permissions.

``ngramd warm [-c CONFIG] [--set ...] FILES/DIRS...`` counts a corpus straight into the cold
tier (``ColdStore.bulk_load``: one new run, all or nothing, both cores, memory bounded by
``--mem-mb``).  Text files are tokenized with the table's tokenizer (``[table] tokenizer`` or
``--tokenizer``; its fingerprint must match the one the table records) in parallel batches;
``.npy`` files are taken as token ids already (one 1-D integer array = one sequence).  Binary
files (a NUL byte in their first 8 KiB) are skipped with a warning.

``ngramd compact`` merges every run into one (fewest reads, exact entry counts) and reclaims
the space of merged-away pages.

Both need the table's RocksDB lock: stop the daemon first (a running ngramd is reported).

``ngramd snapshot [--to-dir]`` asks the running daemon for a consistent snapshot of its table
(``ngramd/fleet.py``): to the fleet's JetStream object store, or to ``[fleet] snapshot_dir``.
``ngramd restore FILE`` unpacks such a file as the config's table, which must not exist yet
(a fleet host with ``bootstrap = true`` does this itself from the object store).

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

from .config import load_daemon_config
from .errors import NgramError, StorageError

log = logging.getLogger("ngramd.tools")

#: bytes of text per tokenizer batch (encode_batch runs on all cores)
TEXT_BATCH_BYTES = 8 << 20


def _files(paths: list[str]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(q for q in p.rglob("*") if q.is_file())
        elif p.is_file():
            out.append(p)
        else:
            raise SystemExit(f"ngramd warm: no such file or directory: {p}")
    return out


def read_corpus(files: list[Path], tokenizer, vocab_size: int, progress: bool = True
                ) -> tuple[np.ndarray, np.ndarray, dict]:
    """Token ids of every file (one sequence per file) as ``(tokens, offsets, info)``."""
    from tqdm import tqdm

    seqs: list[np.ndarray] = []
    info = {"files": 0, "skipped_binary": 0, "skipped_empty": 0, "text_bytes": 0,
            "tokenize_s": 0.0}
    texts: list[str] = []
    pending = 0

    def flush_texts():
        nonlocal texts, pending
        if texts:
            t0 = time.perf_counter()
            for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
                seqs.append(np.asarray(enc.ids, np.uint32))
            info["tokenize_s"] += time.perf_counter() - t0
        texts, pending = [], 0

    bar = tqdm(total=len(files), unit="file", disable=not progress, file=sys.stderr,
               desc="read")
    for f in files:
        bar.update(1)
        if f.suffix == ".npy":
            a = np.load(f, allow_pickle=False)
            if a.ndim != 1 or a.dtype.kind not in "iu":
                raise SystemExit(f"ngramd warm: {f}: expected a 1-D integer array of token ids")
            if a.size and (int(a.min()) < 0 or int(a.max()) >= vocab_size):
                raise SystemExit(f"ngramd warm: {f}: token ids outside 0..{vocab_size - 1}")
            seqs.append(a.astype(np.uint32))
            info["files"] += 1
            continue
        raw = f.read_bytes()
        if b"\0" in raw[:8192]:
            info["skipped_binary"] += 1
            log.warning("skipping %s: binary (NUL bytes)", f)
            continue
        if tokenizer is None:
            raise SystemExit("ngramd warm: text files need a tokenizer ([table] tokenizer or "
                             "--tokenizer)")
        texts.append(raw.decode("utf-8", errors="replace"))
        info["files"] += 1
        info["text_bytes"] += len(raw)
        pending += len(raw)
        if pending >= TEXT_BATCH_BYTES:
            flush_texts()
    flush_texts()
    bar.close()
    seqs = [s for s in seqs if s.size >= 2]
    info["skipped_empty"] = info["files"] - len(seqs)
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
    owned by another user is left as it is, with a warning."""
    root = Path(data_dir)
    path = root / name
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    for d in (root, path):
        try:
            os.chmod(d, 0o700)
        except PermissionError:
            log.warning("cannot make %s owner-only (owned by uid %d): group members may be "
                        "able to change table files", d, d.stat().st_uid)
    return path


def _open(cfg, args):
    from .cold import ColdStore
    from .identity import table_identity

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
    from tokenizers import Tokenizer
    from tqdm import tqdm

    from .identity import resolve_tokenizer

    # the tokenizer the table records (--tokenizer is folded into [table] tokenizer by main):
    # text is tokenized with the one the identity names, never another
    p = resolve_tokenizer(cfg.table.tokenizer)
    tok = Tokenizer.from_file(str(p)) if p is not None else None
    files = _files(args.files)
    t0 = time.perf_counter()
    tokens, offsets, info = read_corpus(files, tok, cfg.table.vocab_size,
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
    print(f"warmed table {cfg.table.name!r}: {tokens.size} tokens from {info['files']} file(s) "
          f"({info['skipped_binary']} binary skipped) -> run {run.id}: {run.rows} rows, "
          f"{run.pages} pages, {run.bytes / 2**20:.1f} MiB")
    print(f"read + tokenize {t_read:.1f} s, count + write {t_load:.1f} s "
          f"({tokens.size / max(t_load, 1e-9) / 1e3:.0f}k tokens/s); table: {st['runs']} runs, "
          f"{st['run_rows']} rows")
    return 0


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


def cmd_snapshot(cfg, args) -> int:
    """Ask the running daemon for a snapshot (it owns the table): to the fleet's object store,
    or with ``--to-dir`` to ``[fleet] snapshot_dir``."""
    from ngram_client import NgramClient

    from .service import resolve

    endpoint = args.endpoint or resolve(cfg).server.endpoints[0]
    with NgramClient(endpoint, timeout_ms=10_000, retries=0) as c:
        m = c.snapshot(to_dir=args.to_dir)
    print(f"snapshot {m['name']}: {m['bytes'] / 2**20:.1f} MiB, applied seq {m['applied']}, "
          f"stream seq {m['stream_seq']}, {m['seconds']} s -> {m['stored']}")
    return 0


def cmd_restore(cfg, args) -> int:
    """Unpack a snapshot file as this config's table (which must not exist yet)."""
    from .fleet import restore_snapshot

    m = restore_snapshot(args.snapshot, cfg)
    print(f"restored {m['name']} (host {m['host']}, applied seq {m['applied']}, stream seq "
          f"{m['stream_seq']}) as table {cfg.table.name!r} in {cfg.table.data_dir}")
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
    w.add_argument("--tokenizer", help="tokenizer.json (or its directory) for text files")
    w.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    w.add_argument("--mem-mb", type=int, default=2048,
                   help="RAM for counting (more: fewer passes over the corpus)")
    w.add_argument("--no-progress", action="store_true")
    sub.add_parser("compact", parents=[common], help="merge every run into one")
    s = sub.add_parser("snapshot", parents=[common],
                       help="snapshot the running daemon's table (fleet object store)")
    s.add_argument("--to-dir", action="store_true",
                   help="write to [fleet] snapshot_dir instead of the object store")
    s.add_argument("--endpoint", help="the daemon (default: from the config)")
    r = sub.add_parser("restore", parents=[common],
                       help="unpack a snapshot file as a new table (stopped daemon)")
    r.add_argument("snapshot", help="a .tar written by `ngramd snapshot --to-dir`")
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
    if getattr(args, "tokenizer", None):
        sets.append(f"table.tokenizer={json.dumps(args.tokenizer)}")
    try:
        cfg = load_daemon_config(args.config, tuple(sets))
        return {"warm": cmd_warm, "compact": cmd_compact, "snapshot": cmd_snapshot,
                "restore": cmd_restore}[args.cmd](cfg, args)
    except NgramError as e:
        print(f"ngramd {args.cmd}: {e}", file=sys.stderr)
        return 1
