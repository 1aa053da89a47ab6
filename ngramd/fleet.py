"""Many hosts: every ``ngramd`` shares what its generators learn through NATS JetStream
(ARCHITECTURE §11: the data flow, the formats, identity and membership, snapshots).

Drafting stays host-local (µs budgets): one daemon per host, its generators beside it.  What
each host ingests should still reach every other host, or each table sees 1/N of the fleet's
outputs.  The replication is NATS JetStream's, not a protocol of ours: a durable, replicated
stream with per-message dedup ids, durable consumers that remember each host's position, and
an object store for snapshots.  Off by default (``[fleet] enabled``).

* **Publish.**  The ingest log is the outbox: a publisher task sends this host's own records
  above the log's hold (``cold.log``), one acknowledged message at a time, and moves the hold
  after the ack, so a crash loses nothing and a repeat is dropped by dedup ids and consumers.
* **Consume.**  A durable pull consumer per member (a table on a host, ``origin_id``) appends
  the others' records to the local log, marked with their origin, before it acknowledges;
  a redelivery is dropped per record against the table's per-origin watermarks
  (``ColdStore.origin_watermarks``).  Messages are taken in stream order; at a gap the
  consumer is made again at the missing message.
* **Identity.**  A host whose table identity differs from the stream's refuses to join and
  keeps serving its own table.
* **Snapshots and bootstrap.**  A snapshot (``ngramd.snapshots``) is taken with the consumer
  paused, so its manifest says exactly which stream sequence it covers; a new host restores
  the newest before its table opens (``bootstrap``) and replays the stream after it.

Not shared: tables filled before the fleet was enabled and ``ngramd warm`` bulk loads (they
bypass the log); share them by making that host the first snapshot's source.  Hosts count
the same records, so their totals agree exactly; the top-``cold_k`` candidate lists of a
context with more distinct continuations than ``cold_k`` may differ in their tail
(``ColdStore.checksum``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import struct
import threading
import time
import uuid
from pathlib import Path

from .cold.store import ColdStore
from .config import DaemonConfig, FleetConfig
from .snapshots import keep_in_dir, restore_snapshot, write_snapshot
from .wire.errors import IDENTITY, UNAVAILABLE, NgramError
from .wire.identity import TableIdentity

log = logging.getLogger(__name__)

ORIGIN_HEADER = "Ngram-Origin"  # the publishing table's id (``origin_id``)
HOST_HEADER = "Ngram-Host"  # its host's name, for people
MSG_ID_HEADER = "Nats-Msg-Id"
META_IDENTITY = "ngram_identity"
META_DIGEST = "ngram_identity_digest"
_REC = struct.Struct("<QI")  # seq in the origin's log, record length
FETCH_BATCH = 256  # messages per consumer fetch (one local append for all of them)
DUPLICATE_WINDOW_S = 120.0
#: an abandoned durable consumer (a retired host) is removed by the server after this long
CONSUMER_INACTIVE_S = 7 * 86400.0


# ---------------------------------------------------------------------------------------------
# names and wire format
# ---------------------------------------------------------------------------------------------
def identity_digest(identity: TableIdentity) -> str:
    """16 hex digits naming a table identity in subjects and snapshot names."""
    return hashlib.sha256(identity.to_json()).hexdigest()[:16]


def member_name(host_id: str, table_id: str) -> str:
    """A fleet member: a table on a host (see ``origin_id``)."""
    return f"{host_id}-{table_id[:12]}"


def origin_id(member: str) -> bytes:
    """The 16-byte origin id a member's records carry in other hosts' logs.

    A member is a table on a host, ``<host id>-<table id>``: log seqs belong to a table's log,
    so a table rebuilt or restored on the same host is a new origin (its predecessor's
    messages are other records, not its own), and one table copied to several hosts before
    they joined is one origin per host.  A table remembers the member it published as
    (``fleet-member`` in its directory) and refuses to join as another (``Fleet.start``)."""
    return hashlib.blake2b(member.encode(), digest_size=16).digest()


def load_host_id(cfg: FleetConfig, data_dir: str | os.PathLike, table: str) -> str:
    """``[fleet] host_id``, or the id made at this table's first start in a fleet (kept in
    ``<data_dir>/<table>.fleet-host``)."""
    if cfg.host_id:
        return cfg.host_id
    f = Path(data_dir) / f"{table}.fleet-host"
    try:
        hid = f.read_text().strip()
        if hid:
            return hid
    except FileNotFoundError:
        pass
    hid = uuid.uuid4().hex[:16]
    f.parent.mkdir(parents=True, exist_ok=True)
    tmp = f.with_suffix(".tmp")
    tmp.write_text(hid + "\n")
    os.replace(tmp, f)
    return hid


def encode_records(recs: list[tuple[int, bytes]]) -> bytes:
    """Log records ``(seq, record)`` as one message body: per record its seq (u64 LE), its
    length (u32 LE) and the record (skip word + tokens, ``ngramd/cold/store.py``)."""
    return b"".join(_REC.pack(q, len(r)) + r for q, r in recs)


def decode_records(body: bytes) -> list[tuple[int, bytes]]:
    """The inverse of ``encode_records``; ``ValueError`` for anything that is not a sequence
    of whole, increasing records of whole tokens."""
    out, pos, last = [], 0, -1
    mv = memoryview(body)
    while pos < len(body):
        if pos + _REC.size > len(body):
            raise ValueError("truncated record head")
        q, n = _REC.unpack_from(body, pos)
        pos += _REC.size
        if n < 4 or n % 4 or pos + n > len(body):
            raise ValueError(f"record {q}: bad length {n}")
        if q <= last:
            raise ValueError(f"record seqs do not increase ({last} then {q})")
        rec = bytes(mv[pos:pos + n])
        if int.from_bytes(rec[:4], "little") >> 31:
            raise ValueError(f"record {q}: carries an origin (a relayed record)")
        out.append((q, rec))
        pos += n
        last = q
    if not out:
        raise ValueError("no records")
    return out


class FleetRefused(NgramError):
    """This host's table identity differs from the one the fleet's stream carries."""

    code = IDENTITY


# ---------------------------------------------------------------------------------------------
# snapshots
# ---------------------------------------------------------------------------------------------
def snapshot_to_dir(table, dest_dir, abort: threading.Event | None = None) -> dict:
    """A snapshot of a table outside any fleet (a backup, or a fleet's first table): flush,
    checkpoint, pack into ``dest_dir``; its origin is named by the table id."""
    tmp = Path(dest_dir)
    tmp.mkdir(parents=True, exist_ok=True)
    table.writes.flush(abort=abort)
    host_id = table.cold.table_id[:16]
    path, manifest = write_snapshot(table.cold, tmp, host_id=host_id,
                                    origin=origin_id(member_name(host_id, table.cold.table_id)),
                                    stream="", stream_seq=None,
                                    digest=identity_digest(table.identity))
    return keep_in_dir(path, manifest, dest_dir)


# ---------------------------------------------------------------------------------------------
# NATS connection
# ---------------------------------------------------------------------------------------------
def _connect_options(cfg: FleetConfig, name: str) -> dict:
    opts = dict(servers=list(cfg.servers), name=name, connect_timeout=cfg.timeout_s,
                max_reconnect_attempts=-1, reconnect_time_wait=1.0, allow_reconnect=True)
    if cfg.creds_file:
        opts["user_credentials"] = cfg.creds_file
    if cfg.nkey_seed_file:
        opts["nkeys_seed"] = cfg.nkey_seed_file
    if cfg.user:
        opts["user"] = cfg.user
        opts["password"] = Path(cfg.password_file).read_text().strip()
    return opts


def check_credentials(cfg: FleetConfig) -> None:
    """Readable credential files (``--check-config`` and start): a clear error now rather than
    an authorization loop later."""
    for name in ("creds_file", "nkey_seed_file", "password_file"):
        p = getattr(cfg, name)
        if p and not os.access(p, os.R_OK):
            raise NgramError(f"[fleet] {name} {p!r} is not readable")


async def _stream_identity(js, cfg: FleetConfig, identity: TableIdentity, digest: str) -> str:
    """Create the stream with this identity, or check the existing one's; returns "created"
    or "joined", raises ``FleetRefused``."""
    from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
    from nats.js.errors import BadRequestError, NotFoundError

    meta = {META_IDENTITY: identity.to_json().decode(), META_DIGEST: digest}
    sc = StreamConfig(name=cfg.stream, subjects=[f"{cfg.subject_prefix}.{digest}.>"],
                      retention=RetentionPolicy.LIMITS, storage=StorageType.FILE,
                      discard=DiscardPolicy.OLD, num_replicas=cfg.replicas,
                      duplicate_window=DUPLICATE_WINDOW_S, max_age=cfg.max_age_s or None,
                      metadata=meta, description="ngramd fleet: ingest log records")
    for _ in range(3):
        try:
            info = await js.stream_info(cfg.stream)
        except NotFoundError:
            try:
                await js.add_stream(sc)
                return "created"
            except BadRequestError:  # another host created it meanwhile: read it again
                continue
        theirs = (info.config.metadata or {}).get(META_DIGEST)
        if theirs != digest:
            raise FleetRefused(
                f"fleet stream {cfg.stream!r} carries table identity "
                f"{(info.config.metadata or {}).get(META_IDENTITY, '(none recorded)')} "
                f"(digest {theirs}); this host's is {identity.to_json().decode()} "
                f"(digest {digest}): refusing to join")
        return "joined"
    raise NgramError(f"fleet stream {cfg.stream!r}: could neither create nor read it",
                     UNAVAILABLE)


# ---------------------------------------------------------------------------------------------
# the fleet member
# ---------------------------------------------------------------------------------------------
class Fleet:
    """This daemon's membership of a fleet: a thread running an asyncio loop with the
    publisher, the consumer and (optionally) the snapshot timer.  ``start``/``stop`` from
    the daemon; ``stats`` and ``snapshot`` from any thread."""

    def __init__(self, cfg: FleetConfig, table, host_id: str, data_dir: str | os.PathLike):
        self.cfg = cfg
        self.table = table
        self.cold: ColdStore = table.cold
        self.host_id = host_id  # a name for people (subjects, consumer, logs)
        self.member = member_name(host_id, self.cold.table_id)  # the origin of its records
        self.identity = table.identity
        self.digest = identity_digest(self.identity)
        self.subject = f"{cfg.subject_prefix}.{self.digest}.{host_id}"
        self.data_dir = Path(data_dir)
        self.consumer = self.member
        self.state = "starting"
        self.last_error = ""  # what keeps the fleet from working now ("" once connected)
        self.last_error_t = 0.0  # when it happened (unix s; 0 = none)
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._new_records: asyncio.Event | None = None
        self._nc = None
        self._js = None
        # consumer position: the last stream sequence whose records are in the local log
        # (or were skipped as already here); snapshots read it under _apply_lock
        self._apply_lock = threading.Lock()
        self._stream_seq = self.cold.fleet_stream_seq or 0
        self._expect = 0  # the stream sequence the consumer needs next (set by _subscribe)
        self._gap_at = 0  # where the last gap was seen (the consumer was made again there)
        self._wm: dict[bytes, int] = {}
        self.published_seq = 0
        self.counters = dict(published_msgs=0, published_records=0, publish_errors=0,
                             consumed_msgs=0, applied_records=0, duplicate_records=0,
                             bad_msgs=0, consume_errors=0, snapshots=0, delivery_gaps=0,
                             missed_msgs=0)
        self.consume_lag: int | None = None
        self.stream_last_seq: int | None = None
        self.last_snapshot: dict | None = None
        self._last_snapshot_t = 0.0

    # ---- life cycle -------------------------------------------------------------------------
    def start(self) -> None:
        check_credentials(self.cfg)
        if not self._same_member():
            return
        hold = self.cold.log.ilog.hold
        if hold is None:  # first start in a fleet: publish from here on
            hold = self.cold.last_seq()
            self.cold.log.ilog.set_hold(hold)
            if hold and self.cold.fleet_stream_seq is None:  # (a restored table: not ours)
                log.warning("fleet: first start of this table in a fleet; its %d earlier log "
                            "records are not published (share an existing table through a "
                            "snapshot)", hold)
        self.published_seq = hold
        self._wm = self.cold.origin_watermarks()
        self._thread = threading.Thread(target=self._run, name="fleet", daemon=True)
        self._thread.start()
        self.table.writes.on_append = self._wake_publisher
        log.info("fleet: host %s, stream %s, subject %s, consumer %s, servers %s",
                 self.host_id, self.cfg.stream, self.subject, self.consumer,
                 ", ".join(self.cfg.servers))

    def _same_member(self) -> bool:
        """A table publishes under one member name for life: joining under another (a changed
        ``host_id``, a directory copied from a host that had joined) would make its records
        look like someone else's, and every host would count them again."""
        f = Path(self.cold.path) / "fleet-member"
        try:
            known = f.read_text().strip()
        except FileNotFoundError:
            tmp = f.with_suffix(".tmp")
            tmp.write_text(self.member + "\n")
            os.replace(tmp, f)
            return True
        if known == self.member:
            return True
        e = FleetRefused(f"this table published to the fleet as {known!r} and would now as "
                         f"{self.member!r} (its host_id changed, or it was copied from another "
                         f"host): refusing to join, which would count {known!r}'s records "
                         f"twice; give the host its old host_id back, or start it with an "
                         f"empty table (it restores a snapshot)")
        self.state, self.last_error = "refused", str(e)
        log.error("fleet: %s", e)
        self.table.faults.fault("fleet", e)
        return False

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self.table.writes.on_append = None
        loop = self._loop
        if loop is not None and self._new_records is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._new_records.set)
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("fleet: the NATS thread did not stop within %.0f s", timeout_s)

    def _wake_publisher(self) -> None:
        loop, ev = self._loop, self._new_records
        if loop is not None and ev is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closing
                loop.call_soon_threadsafe(ev.set)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception as e:  # a bug: say so, keep serving the local table
            log.exception("fleet: stopped by an unexpected error")
            self.state, self.last_error = "failed", f"{type(e).__name__}: {e}"

    async def _main(self) -> None:
        import nats

        self._loop = asyncio.get_running_loop()
        self._new_records = asyncio.Event()
        delay = 0.5
        self.state = "connecting"
        while not self._stop.is_set():
            try:
                self._nc = await nats.connect(**_connect_options(self.cfg, f"ngramd-{self.host_id}"),
                                              error_cb=self._on_error,
                                              disconnected_cb=self._on_disconnect,
                                              reconnected_cb=self._on_reconnect)
                break
            except Exception as e:  # no server yet: keep trying, the table serves meanwhile
                self._note_error("connecting", e)
                self.state = "connecting"
                await self._sleep(delay)
                delay = min(delay * 2, 10.0)
        if self._stop.is_set():
            return await self._close()
        self._js = self._nc.jetstream(timeout=self.cfg.timeout_s)
        try:
            while not self._stop.is_set():
                try:
                    how = await _stream_identity(self._js, self.cfg, self.identity, self.digest)
                    break
                except FleetRefused as e:
                    self.state, self.last_error = "refused", str(e)
                    log.error("fleet: %s", e)
                    self.table.faults.fault("fleet", e)
                    return
                except Exception as e:
                    self._note_error("joining the stream", e)
                    self.state = "joining"
                    await self._sleep(2.0)
            else:
                return
            log.info("fleet: %s stream %s", how, self.cfg.stream)
            self._connected()
            tasks = [asyncio.create_task(self._publish_loop(), name="publish"),
                     asyncio.create_task(self._consume_loop(), name="consume")]
            if self.cfg.snapshot_interval_s > 0:
                tasks.append(asyncio.create_task(self._snapshot_loop(), name="snapshot"))
            while not self._stop.is_set():
                await self._sleep(1.0)
                for t in tasks:
                    if t.done() and t.exception() is not None:
                        raise t.exception()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await self._close()

    async def _close(self) -> None:
        final = "refused" if self.state == "refused" else "stopped"  # refused stays visible
        self.state = "stopping"
        if self._nc is not None:  # no drain: what was applied is acknowledged already, and an
            with contextlib.suppress(Exception):  # unacknowledged message comes again
                await asyncio.wait_for(self._nc.close(), 2.0)
        self.state = final

    async def _sleep(self, s: float) -> None:
        end = time.monotonic() + s
        while not self._stop.is_set() and time.monotonic() < end:
            await asyncio.sleep(min(0.25, end - time.monotonic()))

    async def _on_error(self, e) -> None:
        self._note_error("nats", e)

    async def _on_disconnect(self) -> None:
        if self.state == "connected":
            self.state = "disconnected"
            log.warning("fleet: disconnected from NATS; publishing waits (backlog in stats)")

    async def _on_reconnect(self) -> None:
        if self.state == "disconnected":
            self._connected()
        log.info("fleet: reconnected to %s", self._nc.connected_url.netloc
                 if self._nc and self._nc.connected_url else "NATS")

    def _connected(self) -> None:
        """State ``connected``; the errors that kept it from being so are over (they were
        logged), so ``last_error`` no longer shows them next to ``connected`` in stats."""
        self.state = "connected"
        self.last_error, self.last_error_t = "", 0.0

    def _note_error(self, what: str, e: BaseException) -> None:
        msg = f"{what}: {type(e).__name__}: {e}"
        if msg != self.last_error:
            log.warning("fleet: %s", msg)
        self.last_error, self.last_error_t = msg, time.time()

    # ---- publish ----------------------------------------------------------------------------
    async def _publish_loop(self) -> None:
        persisted_t = time.monotonic()
        limit = self.cfg.publish_kib << 10
        while not self._stop.is_set():
            if self.cold.last_seq() <= self.published_seq:
                self._new_records.clear()
                if self.cold.last_seq() <= self.published_seq:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._new_records.wait(), 1.0)
                    continue
            last, recs = await asyncio.to_thread(self.cold.log.local_records, self.published_seq,
                                                 limit)
            if recs:
                await self._publish(recs)
            self.published_seq = last
            now = time.monotonic()
            if self.cold.last_seq() <= last or now - persisted_t > 0.2:
                await asyncio.to_thread(self.cold.log.ilog.set_hold, last)
                persisted_t = now

    async def _publish(self, recs: list[tuple[int, bytes]]) -> None:
        """Publish one message, again and again until JetStream acknowledges it (same id)."""
        body = encode_records(recs)
        headers = {MSG_ID_HEADER: f"{self.member}:{recs[0][0]}-{recs[-1][0]}",
                   ORIGIN_HEADER: self.member, HOST_HEADER: self.host_id}
        delay = 0.1
        while True:
            try:
                await self._js.publish(self.subject, body, timeout=self.cfg.timeout_s,
                                       headers=headers)
                self.counters["published_msgs"] += 1
                self.counters["published_records"] += len(recs)
                return
            except Exception as e:
                if self._stop.is_set():
                    raise asyncio.CancelledError from None
                self.counters["publish_errors"] += 1
                self._note_error("publishing", e)
                await self._sleep(delay)
                delay = min(delay * 2, 5.0)

    # ---- consume ----------------------------------------------------------------------------
    async def _subscribe(self, start: int | None = None):
        """(Re)create this host's durable consumer at ``start``, by default at its first
        unacknowledged message; the next message expected is then ``start``.

        Why recreate instead of resuming: JetStream redelivers an unacknowledged message only
        after ``ack_wait``, and meanwhile delivers newer ones.  A consumer that died between
        a fetch and its append would then see an origin's later records first, and the
        earlier ones, arriving after, would look like duplicates (they are at or below the
        origin's watermark).  Starting again at the ack floor keeps delivery in stream order,
        which is what makes the watermark test exact; what was appended but not acknowledged
        comes again and is dropped as a duplicate.

        While it runs, delivery can skip too: a message delivered into a connection that died
        (a NATS node failing over) comes again only after ``ack_wait``, after newer ones.
        The stream holds this table's subjects only, so its sequences are contiguous:
        ``_apply`` stops at a gap, and the consumer is created again at the missing message.
        Messages that left the stream (``max_age_s``) cannot come again: that gap is logged
        and counted (``missed_msgs``) and consumption goes on after it."""
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
        from nats.js.errors import NotFoundError

        try:
            ci = await self._js.consumer_info(self.cfg.stream, self.consumer)
            if start is None:
                start = int(ci.ack_floor.stream_seq) + 1
            await self._js.delete_consumer(self.cfg.stream, self.consumer)
        except NotFoundError:
            pass
        # a restored snapshot covers up to its stream seq
        start = max(start or 1, (self.cold.fleet_stream_seq or 0) + 1)
        first = int((await self._js.stream_info(self.cfg.stream)).state.first_seq or 1)
        if start < first:  # expired (max_age_s) before this table applied them
            self.counters["missed_msgs"] += first - start
            log.error("fleet: stream messages %d..%d expired before this host applied them "
                      "(max_age_s); their records are missing here: restore this host from a "
                      "snapshot to get them", start, first - 1)
        start = max(start, first)
        self._expect = start
        cc = ConsumerConfig(durable_name=self.consumer, ack_policy=AckPolicy.EXPLICIT,
                            ack_wait=30.0, max_ack_pending=FETCH_BATCH * 8,
                            inactive_threshold=CONSUMER_INACTIVE_S,
                            deliver_policy=(DeliverPolicy.BY_START_SEQUENCE if start > 1
                                            else DeliverPolicy.ALL),
                            opt_start_seq=start if start > 1 else None)
        sub = await self._js.pull_subscribe(f"{self.cfg.subject_prefix}.{self.digest}.>",
                                            durable=self.consumer, stream=self.cfg.stream,
                                            config=cc)
        log.info("fleet: consuming stream %s from sequence %d", self.cfg.stream, start)
        return sub

    async def _consume_loop(self) -> None:
        from nats.errors import TimeoutError as NatsTimeout

        sub, lag_t = None, 0.0
        while not self._stop.is_set():
            if sub is None:
                try:
                    sub = await self._subscribe()
                except Exception as e:
                    self._note_error("creating the consumer", e)
                    await self._sleep(2.0)
                    continue
            now = time.monotonic()
            if now - lag_t > 1.0:
                lag_t = now
                with contextlib.suppress(Exception):
                    ci = await sub.consumer_info()
                    self.consume_lag = int(ci.num_pending) + int(ci.num_ack_pending or 0)
                    self.stream_last_seq = int(ci.delivered.stream_seq) + int(ci.num_pending)
            try:
                msgs = await sub.fetch(FETCH_BATCH, timeout=1.0)
            except (NatsTimeout, asyncio.TimeoutError):  # nats-py raises either when idle
                continue
            except Exception as e:
                self.counters["consume_errors"] += 1
                self._note_error("fetching", e)
                await self._sleep(1.0)
                continue
            if not msgs:  # a pull answered by a status message only
                continue
            try:
                gap = await asyncio.to_thread(self._apply, msgs)
            except Exception as e:  # nothing acknowledged: start again at the ack floor
                self.counters["consume_errors"] += 1
                self._note_error("appending remote records", e)
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
                sub = None
                await self._sleep(1.0)
                continue
            for m in msgs:
                if getattr(m, "_ngram_skip", False):
                    continue  # after a gap: not applied, comes again
                with contextlib.suppress(Exception):
                    if getattr(m, "_ngram_bad", False):
                        await m.term()
                    else:
                        await m.ack()
            if gap:
                self.counters["delivery_gaps"] += 1
                log.info("fleet: stream message %d was not delivered in order; consuming "
                         "again from it", self._expect)
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
                try:
                    sub = await self._subscribe(self._expect)
                except Exception as e:
                    self._note_error("creating the consumer", e)
                    sub = None

    def _apply(self, msgs: list) -> bool:
        """Append the new records of ``msgs`` to the local log (one durable write), then move
        the watermarks and the stream position: the caller acknowledges afterwards.  Messages
        are taken in stream order: one already passed is a redelivery (acknowledged, nothing
        applied); at a gap the rest is left (``_ngram_skip``) and True is returned."""
        with self._apply_lock:
            wm = dict(self._wm)
            recs, dup, expect, gap = [], 0, self._expect, False
            for m in msgs:
                sseq = m.metadata.sequence.stream
                if not gap and sseq > expect and expect == self._gap_at:
                    # the consumer was made again at `expect` and still starts later: the
                    # stream has no such message for this filter (not a lost delivery)
                    log.warning("fleet: stream messages %d..%d are not in this table's "
                                "subjects; going on", expect, sseq - 1)
                    expect = sseq
                if gap or sseq > expect:
                    gap = True
                    m._ngram_skip = True
                    continue
                if sseq < expect:
                    continue
                expect += 1
                member = (m.headers or {}).get(ORIGIN_HEADER, "")
                if member == self.member:
                    continue
                try:
                    if not member or len(member) > 64:
                        raise ValueError(f"no or bad {ORIGIN_HEADER} header")
                    items = decode_records(m.data)
                except ValueError as e:
                    self.counters["bad_msgs"] += 1
                    m._ngram_bad = True
                    log.error("fleet: dropping malformed message %s from %r: %s",
                              m.metadata.sequence.stream, member, e)
                    continue
                o = origin_id(member)
                have = wm.get(o, 0)
                for q, rec in items:
                    if q > have:
                        recs.append((o, q, rec))
                        have = q
                    else:
                        dup += 1
                wm[o] = have
            if recs:
                self.table.writes.ingest_remote(recs)
            self._wm = wm
            self._gap_at = expect if gap else 0
            self.counters["consumed_msgs"] += expect - self._expect
            self._expect = expect
            self._stream_seq = max(self._stream_seq, expect - 1)
            self.counters["applied_records"] += len(recs)
            self.counters["duplicate_records"] += dup
            return gap

    # ---- snapshots --------------------------------------------------------------------------
    def snapshot(self, dest_dir: str | None = None, abort: threading.Event | None = None) -> dict:
        """A consistent snapshot (see the module doc) to ``dest_dir`` or the object store;
        blocks until it is stored.  Returns its manifest (name, bytes, stream_seq, ...)."""
        tmp = self.data_dir / ".snapshots"
        tmp.mkdir(parents=True, exist_ok=True)
        with self._apply_lock:  # the consumer waits: S is exactly what the flush covers
            covered = self._stream_seq
            self.table.writes.flush(abort=abort)
            path, manifest = write_snapshot(self.cold, tmp, host_id=self.host_id,
                                            origin=origin_id(self.member),
                                            stream=self.cfg.stream, stream_seq=covered,
                                            digest=self.digest)
        try:
            if dest_dir:
                keep_in_dir(path, manifest, dest_dir)
            else:
                if self._loop is None or self._js is None:
                    raise NgramError("fleet: not connected to NATS; snapshot to a directory "
                                     "instead (--to DIR)", UNAVAILABLE)
                fut = asyncio.run_coroutine_threadsafe(self._upload(path, manifest), self._loop)
                fut.result(timeout=max(60.0, manifest["bytes"] / (5 << 20)))
                manifest["stored"] = f"nats object store {self.cfg.snapshot_bucket}/{path.name}"
        finally:
            path.unlink(missing_ok=True)
        self.counters["snapshots"] += 1
        self.last_snapshot = manifest
        self._last_snapshot_t = time.time()
        log.info("fleet: snapshot %s (%.1f MiB, stream seq %s, applied %d) in %s s -> %s",
                 manifest["name"], manifest["bytes"] / 2**20, manifest["stream_seq"],
                 manifest["applied"], manifest["seconds"], manifest["stored"])
        return manifest

    async def _object_store(self, create: bool):
        from nats.js.api import ObjectStoreConfig, StorageType
        from nats.js.errors import BucketNotFoundError, NotFoundError

        try:
            return await self._js.object_store(self.cfg.snapshot_bucket)
        except (BucketNotFoundError, NotFoundError):
            if not create:
                return None
            return await self._js.create_object_store(
                self.cfg.snapshot_bucket, config=ObjectStoreConfig(
                    bucket=self.cfg.snapshot_bucket, replicas=self.cfg.replicas,
                    storage=StorageType.FILE, description="ngramd fleet snapshots"))

    async def _upload(self, path: Path, manifest: dict) -> None:
        from nats.js.api import ObjectMeta

        obs = await self._object_store(create=True)
        with open(path, "rb") as f:
            await obs.put(path.name, f, meta=ObjectMeta(
                name=path.name, description=json.dumps(
                    {k: manifest[k] for k in ("digest", "host", "created", "stream_seq",
                                              "applied")})))
        mine = sorted(i.name for i in await _list_snapshots(obs, self.digest))
        for old in mine[:-self.cfg.snapshot_keep]:
            with contextlib.suppress(Exception):
                await obs.delete(old)

    async def _snapshot_loop(self) -> None:
        while not self._stop.is_set():
            await self._sleep(self.cfg.snapshot_interval_s)
            if self._stop.is_set():
                return
            try:
                await asyncio.to_thread(self.snapshot, None, self._stop)
            except Exception as e:
                self._note_error("taking a snapshot", e)

    # ---- figures ----------------------------------------------------------------------------
    def stats(self) -> dict:
        last = self.cold.last_seq()
        return dict(
            state=self.state, host_id=self.host_id, stream=self.cfg.stream,
            subject=self.subject, identity_digest=self.digest,
            published_seq=self.published_seq,
            publish_backlog_records=max(0, last - self.published_seq),
            consume_lag_msgs=self.consume_lag, consumed_stream_seq=self._stream_seq,
            stream_last_seq=self.stream_last_seq, origins=len(self._wm),
            last_snapshot_age_s=(round(time.time() - self._last_snapshot_t, 1)
                                 if self._last_snapshot_t else None),
            last_snapshot=(self.last_snapshot or {}).get("name"),
            last_error=self.last_error,
            last_error_age_s=(round(time.time() - self.last_error_t, 1)
                              if self.last_error and self.last_error_t else None),
            **self.counters)


async def _list_snapshots(obs, digest: str) -> list:
    out = []
    for info in await obs.list():
        if getattr(info, "deleted", False):
            continue
        with contextlib.suppress(ValueError, TypeError):
            if json.loads(info.description or "{}").get("digest") == digest:
                out.append(info)
    return out


def bootstrap(cfg: DaemonConfig) -> dict | None:
    """Before the table opens: if it does not exist yet and the fleet has a snapshot of this
    identity, restore the newest.  Returns its manifest, or None (a table exists, no
    snapshot, or NATS unreachable: then the table starts empty and replays the stream)."""
    from .table import table_identity_of

    f = cfg.fleet
    dest = Path(cfg.table.data_dir) / cfg.table.name
    if not (f.enabled and f.bootstrap) or (dest / "CURRENT").exists():
        return None
    digest = identity_digest(table_identity_of(cfg.table))

    async def fetch(into: Path) -> bool:
        import nats

        from nats.js.errors import BucketNotFoundError, NotFoundError

        nc = await nats.connect(**dict(_connect_options(f, "ngramd-bootstrap"),
                                       max_reconnect_attempts=0, allow_reconnect=False))
        try:
            js = nc.jetstream(timeout=f.timeout_s)
            try:
                obs = await js.object_store(f.snapshot_bucket)
            except (BucketNotFoundError, NotFoundError):
                return False
            snaps = sorted(await _list_snapshots(obs, digest), key=lambda i: i.name)
            if not snaps:
                return False
            with open(into, "wb") as fh:
                await obs.get(snaps[-1].name, writeinto=fh)
            return True
        finally:
            await nc.close()

    dest.parent.mkdir(parents=True, exist_ok=True)
    tar = dest.parent / f".bootstrap-{cfg.table.name}.tar"
    t0 = time.perf_counter()
    try:
        try:
            found = asyncio.run(asyncio.wait_for(fetch(tar), max(60.0, 30 * f.timeout_s)))
        except Exception as e:
            log.warning("fleet bootstrap: no snapshot fetched (%s: %s); starting empty and "
                        "replaying the stream", type(e).__name__, e)
            return None
        if not found:
            log.info("fleet bootstrap: no snapshot of identity %s in %s; starting empty",
                     digest, f.snapshot_bucket)
            return None
        manifest = restore_snapshot(tar, cfg)
        manifest["restore_s"] = round(time.perf_counter() - t0, 3)
        log.info("fleet bootstrap: restored %s in %.1f s", manifest["name"],
                 manifest["restore_s"])
        return manifest
    finally:
        tar.unlink(missing_ok=True)
