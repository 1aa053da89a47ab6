"""A table's snapshot: a RocksDB checkpoint of its runs, its hot image and a manifest, packed as
one tar; and the restore of one as a new table (ARCHITECTURE §11.4).

The fleet (``ngramd.fleet``) keeps snapshots in its object store and bootstraps new hosts from
them; ``ngramd snapshot``/``restore`` and the ``snapshot`` op use the same files outside any
fleet.  The checkpoint is taken with no spill or merge running, so its meta says exactly what
it holds: ``applied`` of the snapshot host's own log and, per other origin, the last seq
counted.  A restored table records those watermarks (and the stream sequence the snapshot
covers) and takes a new table id: it is a new table, whose consumer replays the stream after
that sequence.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tarfile
import tempfile
import time
from pathlib import Path

from .cold.store import ColdStore
from .config import DaemonConfig
from .hot.image import copy_image
from .wire.errors import NgramError
from .wire.identity import TableIdentity

log = logging.getLogger("ngramd.fleet")  # as before the split: operators filter on it

SNAPSHOT_FORMAT = 1


def write_snapshot(cold: ColdStore, tmp_dir: Path, *, host_id: str, origin: bytes, stream: str,
                   stream_seq: int | None, digest: str) -> tuple[Path, dict]:
    """Checkpoint ``cold`` and pack it with its manifest as ``tmp_dir/<name>.tar``; the caller
    has flushed the table (and paused the consumer, for ``stream_seq`` to hold).  ``origin``
    is the id this table's own records carry on other hosts (``fleet.origin_id``)."""
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(dir=tmp_dir, prefix=".snapshot-"))
    try:
        held = cold.checkpoint(work / "table")
        # the hot tier's image travels with the table: a restored host serves it at once
        hot_image = copy_image(cold.path, work / "table", held["applied"])
        origins = {o.hex(): q for o, q in held["origins"].items()}
        mine = origin.hex()
        origins[mine] = max(origins.get(mine, 0), held["applied"])
        created = time.time()
        name = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(created)) + f"-{host_id}.tar"
        manifest = {"format": SNAPSHOT_FORMAT, "name": name, "host": host_id,
                    "created": created, "stream": stream, "stream_seq": stream_seq,
                    "identity": cold.identity.to_dict(), "digest": digest,
                    "applied": held["applied"], "origins": origins, "hot_image": hot_image}
        (work / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
        out = tmp_dir / name
        with tarfile.open(out, "w") as tar:  # SST pages are compressed already
            tar.add(work / "manifest.json", "manifest.json")
            tar.add(work / "table", "table")
        manifest["bytes"] = out.stat().st_size
        manifest["seconds"] = round(time.perf_counter() - t0, 3)
        return out, manifest
    finally:
        shutil.rmtree(work, ignore_errors=True)


def keep_in_dir(path: Path, manifest: dict, dest_dir) -> dict:
    """Move a written snapshot into ``dest_dir``; returns its manifest with ``stored``."""
    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    shutil.move(str(path), dest / path.name)
    manifest["stored"] = str(dest / path.name)
    return manifest


def read_manifest(tar_path: Path) -> dict:
    """The manifest of a snapshot tar."""
    with tarfile.open(tar_path) as tar:
        f = tar.extractfile("manifest.json")
        if f is None:
            raise ValueError("no manifest.json")
        return json.loads(f.read())


def restore_snapshot(tar_path: str | os.PathLike, cfg: DaemonConfig) -> dict:
    """Unpack a snapshot as this daemon's table (which must not exist yet): the checkpoint
    becomes ``<data_dir>/<name>`` with the snapshot's origin watermarks and stream sequence
    in its meta and a new table id.  Crash-safe: the table appears by one rename at the end;
    a half-done restore is a hidden directory the next attempt removes."""
    from .table import table_identity_of  # the identity this config asks for

    tar_path = Path(tar_path)
    dest = Path(cfg.table.data_dir) / cfg.table.name
    if dest.exists() and any(dest.iterdir()):
        raise NgramError(f"restore: {dest} already holds a table; move it away first")
    try:
        manifest = read_manifest(tar_path)
    except (OSError, ValueError, tarfile.TarError, KeyError) as e:
        raise NgramError(f"restore: {tar_path} is not a snapshot ({e})") from None
    ident = table_identity_of(cfg.table)
    theirs = TableIdentity(**manifest["identity"])
    ident.check_compatible(theirs)
    work = dest.parent / f".restore-{cfg.table.name}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        with tarfile.open(tar_path) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith("table/")]
            tar.extractall(work, members=members, filter="data")
        cold = ColdStore(str(work / "table"), ident, cfg.table.cold)
        try:
            cold.record_fleet({bytes.fromhex(o): int(q) for o, q in manifest["origins"].items()},
                              manifest.get("stream_seq"), new_table_id=True)
        finally:
            cold.close()
        if dest.exists():
            dest.rmdir()
        os.rename(work / "table", dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("restored snapshot %s (host %s, applied %d, stream seq %s, hot image %s) into %s",
             manifest["name"], manifest["host"], manifest["applied"], manifest["stream_seq"],
             "yes" if manifest.get("hot_image") else "no", dest)
    return manifest
