"""The daemon's operations, one class each: the single place an op is declared.

A command class says everything both sides must agree on (circus's command classes are the
model: one class per command with its name, options, message and output):

* ``name``, ``idempotent`` (a client may resend it after a timeout), ``runs`` (``INLINE`` on
  the serving loop, ``POOL`` on a worker thread, ``INGEST`` on the one ingest thread),
  ``after_ingests`` (a pool job that first waits for the ingests received before it);
* the request: header ``fields`` (``Field``: name, type, bounds, default -- the server's
  validation is driven by them, ``parse``), ``batch`` (token sequences as the tokens +
  offsets frames), ``keys`` (an optional uint64 frame); ``message(...)`` builds it on the
  client, and its signature is the client method's signature;
* the reply: ``arrays`` (names of the arrays of its data frame, in order) and ``decode(reply)``,
  the value the client method returns.

What the daemon does for an op is not here: ``ngramd/handlers.py`` holds one handler per op
(``@handles("name")``), given the validated fields (and ``tokens``, ``offsets``, ``keys``),
returning the reply's fields, the ``arrays`` among them.  This module is the client's half of
the contract: it imports numpy only (never numba, RocksDB or the daemon).

What adding an op takes: one class here (declaration, ``message``, ``decode``), one handler in
``ngramd/handlers.py``, the method pair ``name()``/``name_async()`` in ``client/client.py``
(written out, so that IDEs and static tools see it: two short methods whose parameters and
docstring are the declaration's; tests/test_client_ops.py fails until they are) and,
optionally, one ``Console`` entry with a formatter in ``client/cli.py``.  From the class alone
``protocol.OPS`` lists the op, the daemon validates it (``Server._args``) and ``ngram-client
name`` has its fields as options and prints the client method's value as JSON; the handler is
what the daemon dispatches to (``Server._handle``).  tests/test_commands.py declares one and
checks them.  Before the declarations: six places in four files (``OPS``, ``_op_X``/``_job_X``
and ``_check_slow`` in the server, ``X``/``X_async`` and a decoder in the client, a subcommand
and its formatter in the CLI).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Sequence

import numpy as np

from .constants import MAX_DRAFT_LEN, MAX_ORDER
from .errors import BadInput

INLINE, POOL, INGEST = "inline", "pool", "ingest"
REQUIRED = object()  # a Field default: the field must be present
MAX_KEY_BYTES = 256  # an ingest key (the dedup memory holds up to ``dedup_keys`` of them)
#: ``save_policy``: the largest state, the most keys a table keeps states under, the longest key
MAX_POLICY_STATE_BYTES = 1 << 20
MAX_POLICY_STATES = 64
MAX_POLICY_KEY_BYTES = 128


# ---------------------------------------------------------------------------------------------
# fields: declared once, checked by the daemon where a request arrives
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Field:
    """One header field: ``kind`` is ``int``, ``number`` (int or float), ``bool``, ``key`` (a
    string of at most ``hi`` bytes), ``ascii`` (a string of ``lo..hi`` printable ASCII
    characters), ``blob`` (bytes, a msgpack bin, of ``lo..hi`` bytes; a string is refused: its
    op's header may be larger than others', ``protocol.MAX_BLOB_HEADER_BYTES``), ``counts`` (a
    map order -> count, as ``report`` sends) or ``figures`` (``POLICY_FIGURES``); bounds
    ``lo..hi`` are inclusive.  A field with a ``default`` may be absent or null."""

    name: str
    kind: str
    lo: float = 0
    hi: float = 0
    default: Any = REQUIRED
    doc: str = ""

    def parse(self, header: dict):
        v = header.get(self.name)
        if v is None and self.default is not REQUIRED:
            return self.default
        return _PARSE[self.kind](self, v)


def _int(f: Field, v):
    if not isinstance(v, int) or isinstance(v, bool) or not f.lo <= v <= f.hi:
        raise BadInput(f"{f.name} must be an integer in {f.lo}..{f.hi}, got {v!r}"[:200])
    return v


def _number(f: Field, v):
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not f.lo <= v <= f.hi:
        raise BadInput(f"{f.name} must be a number in {f.lo}..{f.hi:g}, got {v!r}"[:200])
    return v


def _bool(f: Field, v):
    if not isinstance(v, bool):
        raise BadInput(f"{f.name} must be true or false, got {v!r}"[:200])
    return v


def _key(f: Field, v):
    if not (isinstance(v, (str, bytes)) and len(v) <= f.hi):
        raise BadInput(f"{f.name} must be a string of at most {f.hi} bytes")
    return v


def _ascii(f: Field, v) -> str:
    """A name a person may type (``save_policy``'s key): printable ASCII, ``lo..hi`` long."""
    if not isinstance(v, str):
        raise BadInput(f"{f.name} must be a string, got {type(v).__name__}")
    if not f.lo <= len(v) <= f.hi:
        raise BadInput(f"{f.name} must be {f.lo:g}..{f.hi:g} bytes of printable ASCII, "
                       f"got {len(v)} characters")
    if not (v.isascii() and v.isprintable()):
        raise BadInput(f"{f.name} must be printable ASCII (' ' to '~'), got {v!r}"[:200])
    return v


def _blob(f: Field, v) -> bytes:
    """Opaque bytes (a msgpack bin): never a string, which a client's encoding could alter."""
    if not isinstance(v, bytes):
        raise BadInput(f"{f.name} must be bytes (a msgpack bin), got {type(v).__name__}")
    if not f.lo <= len(v) <= f.hi:
        bound = f"{int(f.lo)}.." if f.lo else "at most "
        raise BadInput(f"{f.name} must be {bound}{int(f.hi)} bytes, got {len(v)} bytes")
    return v


def _counts(f: Field, m) -> dict[int, int]:
    """A report map {order: count}; keys may arrive as ints or digit strings."""
    if not isinstance(m, dict) or len(m) > MAX_ORDER + 1:
        raise BadInput(f"{f.name} must be a map of at most {MAX_ORDER + 1} orders")
    out = {}
    for k, v in m.items():
        if isinstance(k, bool) or not (isinstance(k, int) or isinstance(k, (str, bytes))
                                       and k.isascii() and k.isdigit() and len(k) <= 3):
            raise BadInput(f"{f.name}: order {str(k)[:20]!r} is not an integer")
        n = int(k)
        if not 0 <= n <= MAX_ORDER or not isinstance(v, int) or isinstance(v, bool) \
                or not 0 <= v < 1 << 48:
            raise BadInput(f"{f.name}: bad entry {n}: {str(v)[:20]}")
        out[n] = v
    return out


#: what a generator's draft-length policy reports with ``report`` (``policy``), each a count since
#: its previous report: steps with a draft, those it verified none of, and for the policy and
#: the three it is compared with on the same steps (``ngram_generator.policy.StepTally``), the
#: tokens they would emit and the seconds they would take by the generator's cost model
POLICY_FIGURES = ("steps", "plain_steps", *(f"{p}_{what}" for what in ("tokens", "seconds")
                                            for p in ("policy", "plain", "full", "oracle")))


def _figures(f: Field, m) -> dict[str, float]:
    """A map of some of ``POLICY_FIGURES`` to finite non-negative numbers."""
    if not isinstance(m, dict):
        raise BadInput(f"{f.name} must be a map of figures")
    out = {}
    for k, v in m.items():
        name = k.decode("ascii", "replace") if isinstance(k, bytes) else k
        if name not in POLICY_FIGURES:
            raise BadInput(f"{f.name}: unknown figure {str(k)[:40]!r} (known: "
                           f"{', '.join(POLICY_FIGURES)})")
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < 1e15:
            raise BadInput(f"{f.name}: {name} must be a number in [0, 1e15), got {str(v)[:20]}")
        out[name] = float(v)
    return out


_PARSE = {"int": _int, "number": _number, "bool": _bool, "key": _key, "ascii": _ascii,
          "blob": _blob, "counts": _counts, "figures": _figures}


# ---------------------------------------------------------------------------------------------
# the command base class
# ---------------------------------------------------------------------------------------------
class Message(NamedTuple):
    """What a client sends for one call: header ``fields``, the token sequences ``seqs`` of a
    ``batch`` op, the ``keys`` frame of an op that takes one."""

    fields: dict | None = None
    seqs: Sequence | None = None
    keys: np.ndarray | None = None


#: name -> command, in declaration order (the order ``info`` and the metrics list them)
COMMANDS: dict[str, "Command"] = {}


class Command:
    """Base of the op declarations (module doc).  Subclasses set ``name`` and are registered
    in ``COMMANDS`` as one instance each."""

    name: ClassVar[str] = ""
    idempotent: ClassVar[bool] = True
    runs: ClassVar[str] = INLINE
    after_ingests: ClassVar[bool] = False
    batch: ClassVar[bool] = False
    keys: ClassVar[bool] = False
    fields: ClassVar[tuple[Field, ...]] = ()
    arrays: ClassVar[tuple[str, ...]] = ()
    #: the client's time per attempt (ms) when the caller gives none; None: the client's own
    timeout_ms: ClassVar[int | None] = None
    #: a ``POOL`` op that may wait seconds to minutes (on counting, a rebuild, a scan): it runs
    #: on the server's wait pool, so the short pooled ops (``lookup``, ``top``) never queue
    #: behind it (abandoned flushes on the shared pool once held every worker for minutes)
    waits: ClassVar[bool] = False
    #: the header field that bounds the op's wait on the server (s); the client fills it from
    #: its own timeout when the caller gives none, so a wait never outlives its caller
    wait_field: ClassVar[str | None] = None
    help: ClassVar[str] = ""  # one line, for ``ngram-client --help``

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.name:
            assert cls.name not in COMMANDS, f"op {cls.name} declared twice"
            COMMANDS[cls.name] = cls()

    def message(self) -> Message:
        """The request for the client method's arguments (its signature is the method's)."""
        return Message()

    def decode(self, reply) -> dict:
        """The client method's value from a success reply (``protocol.Reply``)."""
        f = reply.fields
        return {k: v for k, v in f.items() if k not in ("v", "id", "ok")}

    def parse(self, header: dict) -> dict:
        """The validated header fields, by name (``BadInput`` names the first bad one)."""
        return {f.name: f.parse(header) for f in self.fields}


SLOW_TIMEOUT_MS = 600_000  # ops that legitimately take long: whole-log apply, rebuild, scans


class Draft:
    """One drafted continuation, the one result type from the kernel to the generator: what
    ``HotReader.draft`` returns, what the ``draft`` op decodes to, what a generator verifies.

    ``tokens`` (uint32), and per token the ``orders`` (uint8) and ``tiers`` (uint8: 0 local,
    1 hot, 2 cold, 3 recent; ``constants.TIER_NAMES``) that made it and its ``conf`` (float32,
    the share count/total); ``probes``: slot-table probes spent (in-process drafts; 0 from the
    daemon).  ``len(draft)`` is its number of tokens.  The arrays may be views of a reader's
    buffers (``HotReader.draft`` says how long they stay valid)."""

    __slots__ = ("tokens", "orders", "tiers", "conf", "probes")

    def __init__(self, tokens, orders, tiers, conf, probes: int = 0):
        self.tokens, self.orders, self.tiers, self.conf = tokens, orders, tiers, conf
        self.probes = probes

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def truncate(self, k: int) -> "Draft":
        """The first ``k`` tokens (views)."""
        return Draft(self.tokens[:k], self.orders[:k], self.tiers[:k], self.conf[:k],
                     self.probes)

    def copy(self) -> "Draft":
        """A draft that owns its arrays (a reader's views are overwritten by its next call)."""
        return Draft(self.tokens.copy(), self.orders.copy(), self.tiers.copy(),
                     self.conf.copy(), self.probes)

    def __repr__(self):
        return (f"Draft(tokens={self.tokens.tolist()}, orders={self.orders.tolist()}, "
                f"tiers={self.tiers.tolist()})")


#: the name the client library exported for ``Draft`` before the types were one
DraftResult = Draft


class DraftBatch:
    """The drafts of a batch of contexts, the one batch form: what ``Table.draft`` and
    ``HotReader.draft_batch`` return and what the ``draft`` op's reply holds.

    ``(B, L)`` arrays ``tokens`` (uint32), ``orders``, ``tiers`` (uint8), ``conf`` (float32)
    and ``lengths`` (int32, ``(B,)``): row ``b`` holds ``lengths[b]`` tokens; ``probes``: the
    slot-table probes spent (in-process drafts; 0 from the daemon).  ``len(batch)`` is B;
    ``batch[b]`` is row ``b``'s ``Draft`` (views).  ``arrays()`` and ``from_arrays`` are the
    wire's names for them (``DraftOp.arrays``).  The arrays may be views of a reader's buffers
    (``HotReader.draft_batch`` says how long they stay valid)."""

    __slots__ = ("tokens", "orders", "tiers", "conf", "lengths", "probes")
    #: the wire's array names, in the order of the fields above (the reply's data frame)
    WIRE = ("tok", "order", "tier", "conf", "length")

    def __init__(self, tokens, orders, tiers, conf, lengths, probes: int = 0):
        self.tokens, self.orders, self.tiers, self.conf = tokens, orders, tiers, conf
        self.lengths, self.probes = lengths, probes

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def __getitem__(self, b: int) -> Draft:
        n = int(self.lengths[b])
        return Draft(self.tokens[b, :n], self.orders[b, :n], self.tiers[b, :n],
                     self.conf[b, :n])

    def drafts(self) -> list[Draft]:
        """Every row's ``Draft`` (views)."""
        tok, order, tier, conf = self.tokens, self.orders, self.tiers, self.conf
        return [Draft(tok[i, :n], order[i, :n], tier[i, :n], conf[i, :n])
                for i, n in enumerate(self.lengths.tolist())]

    def arrays(self) -> dict:
        """The arrays by their wire names (``WIRE``)."""
        return dict(zip(self.WIRE, (self.tokens, self.orders, self.tiers, self.conf,
                                    self.lengths)))

    @classmethod
    def from_arrays(cls, a: dict, probes: int = 0) -> "DraftBatch":
        """A batch from arrays by their wire names (a reply's data frame)."""
        return cls(*(a[k] for k in cls.WIRE), probes)


# ---------------------------------------------------------------------------------------------
# the ops
# ---------------------------------------------------------------------------------------------
class Ping(Command):
    """Liveness: the daemon's instance id (changes at restart) and health state."""

    name = "ping"
    help = "round trip to the daemon"


class Info(Command):
    """Identity, hot segment (``hot: {shm_dir, table, generation}``), orders, limits."""

    name = "info"
    help = "table identity, hot segment, limits"


class Stats(Command):
    """The table's figures plus the server's (requests, errors, latency per op)."""

    name = "stats"
    help = "hit rates, latency, sizes, acceptance"


class DraftOp(Command):
    """Draft up to ``max_len`` tokens after each context (uint32 arrays or int sequences, most
    recent last); ``budget_us`` bounds the daemon's time on cold reads (µs) before it answers
    from the hot tier alone."""

    name = "draft"
    batch = True
    # the table refuses more than its max_draft_len (<= MAX_DRAFT_LEN, sent in info())
    fields = (Field("max_len", "int", 1, MAX_DRAFT_LEN, doc="tokens to draft after a context"),
              Field("budget_us", "number", 0, 1e9, None, "µs the daemon may spend on cold reads"))
    arrays = DraftBatch.WIRE
    help = "draft after TEXT ('-' reads stdin)"

    def message(self, contexts: Sequence, max_len: int, budget_us: float | None = None):
        fields = {"max_len": int(max_len)}
        if budget_us is not None:
            fields["budget_us"] = float(budget_us)
        return Message(fields, contexts)

    def decode(self, reply) -> list[Draft]:
        return DraftBatch.from_arrays(reply.arrays).drafts()


class Lookup(Command):
    """Top-3 candidates of every order: ``tok, cnt`` (B, n_max+1, 3) uint32, ``total``
    (B, n_max+1) uint32 (0 = absent), ``tier`` (B, n_max+1) uint8 (1 hot, 2 cold, 255 none).
    Cold reads of every order: a tool's op, so it runs on a worker and never holds drafts
    back (``Table.lookup`` bounds it)."""

    name = "lookup"
    runs = POOL
    batch = True
    arrays = ("tok", "cnt", "total", "tier")
    help = "lookup after TEXT ('-' reads stdin)"

    def message(self, contexts: Sequence):
        return Message(None, contexts)

    def decode(self, reply) -> dict:
        return reply.arrays


class Ingest(Command):
    """Append sequences to the table; the value is ``(first_seq, last_seq)`` once durable.
    Never resent by the client: a repeated ``key`` is answered with the first ack
    (``duplicate: true``) instead of being counted again.  Executed by the server's ingest
    thread (group commit: ``ngramd.writefront.IngestFront``)."""

    name = "ingest"
    idempotent = False
    runs = INGEST
    batch = True
    fields = (Field("key", "key", 0, MAX_KEY_BYTES, None, "dedup key (random if not given)"),)
    help = "tokenize FILES and add them to the table"

    def message(self, seqs: Sequence, key: str | None = None):
        return Message({"key": key or uuid.uuid4().hex}, seqs)

    def decode(self, reply) -> tuple[int, int]:
        return int(reply.fields["first_seq"]), int(reply.fields["last_seq"])


class Report(Command):
    """Per-order counts of drafted and accepted tokens (for stats), the draft-length policy's
    figures since the previous report (``POLICY_FIGURES``; for stats), and optionally the
    kernel keys of the hot entries drafted from (they rank the next hot generation)."""

    name = "report"
    idempotent = False  # adds counts: a blind resend could count twice
    keys = True
    fields = (Field("drafted", "counts", default={}), Field("accepted", "counts", default={}),
              Field("policy", "figures", default={}))

    def message(self, drafted: dict, accepted: dict, keys: np.ndarray | None = None,
                policy: dict | None = None):
        header = {"drafted": {int(k): int(v) for k, v in drafted.items()},
                  "accepted": {int(k): int(v) for k, v in accepted.items()}}
        if policy:
            header["policy"] = {str(k): float(v) for k, v in policy.items()}
        return Message(header, None, keys)

    def decode(self, reply) -> None:
        return None


class Top(Command):
    """The ``n`` most frequent contexts of ``order``: list of (key, total, tok, cnt); the table
    stores contexts as their 64-bit keys (``ngramd.kernels.hashing.key_hash``)."""

    name = "top"
    runs = POOL
    fields = (Field("order", "int", 1, MAX_ORDER, doc="n-gram order (context tokens)"),
              Field("n", "int", 1, 100_000, doc="contexts to list"))
    arrays = ("key", "total", "tok", "cnt")
    timeout_ms = SLOW_TIMEOUT_MS
    help = "most frequent n-grams of an order"

    def message(self, order: int, n: int = 20):
        return Message({"order": int(order), "n": int(n)})

    def decode(self, reply) -> list:
        a = reply.arrays
        return [(int(a["key"][i]), int(a["total"][i]), a["tok"][i], a["cnt"][i])
                for i in range(len(a["total"]))]


class RebuildHot(Command):
    """Build and publish a new hot generation now; the value is its number."""

    name = "rebuild_hot"
    runs = POOL
    waits = True
    fields = (Field("full", "bool", default=False, doc="rescan the cold tier"),)
    timeout_ms = SLOW_TIMEOUT_MS
    help = "publish a new hot generation now"

    def message(self, full: bool = False):
        return Message({"full": bool(full)})

    def decode(self, reply) -> int:
        return int(reply.fields["generation"])


class Flush(Command):
    """Wait until everything ingested so far is counted; the value is the applied log seq.
    Ordered after the ingests the daemon received before it, even when pipelined.  Answers
    within ``wait_s``: ``storage`` as soon as counting cannot go on (a failing disk),
    ``timeout`` at the deadline (the default is below the client's own wait)."""

    name = "flush"
    runs = POOL
    waits = True
    wait_field = "wait_s"
    after_ingests = True
    fields = (Field("wait_s", "number", lo=0.001, hi=86_400.0,
                    default=SLOW_TIMEOUT_MS / 1000 - 10,
                    doc="answer `timeout` after this many seconds"),)
    timeout_ms = SLOW_TIMEOUT_MS
    help = "wait until the ingest log is applied"

    def message(self, wait_s: float | None = None):
        return Message(None if wait_s is None else {"wait_s": float(wait_s)})

    def decode(self, reply) -> int:
        return int(reply.fields["applied"])


class Checksum(Command):
    """Digests of the table's content that do not depend on how it was written: ``totals``
    (every context's key, order and total) and ``digest`` (with its candidates), ``rows``,
    ``capped_rows`` (``ColdStore.checksum``).  Hosts of a fleet that counted the same records
    agree; flush first to include what is still in the log."""

    name = "checksum"
    runs = POOL
    waits = True
    timeout_ms = SLOW_TIMEOUT_MS
    help = "digests of the table's content (compare the hosts of a fleet)"


class Snapshot(Command):
    """A consistent snapshot of the table (``ngramd/fleet.py``): to the fleet's JetStream
    object store, or with ``to_dir`` to ``[fleet] snapshot_dir``; the value is its manifest
    (``name``, ``bytes``, ``stream_seq``, ``applied``, ``stored``, ...)."""

    name = "snapshot"
    runs = POOL
    waits = True
    idempotent = False
    fields = (Field("to_dir", "bool", default=False,
                    doc="write to [fleet] snapshot_dir instead of the object store"),)
    timeout_ms = SLOW_TIMEOUT_MS
    help = "snapshot the table (object store, or --to-dir)"

    def message(self, to_dir: bool = False):
        return Message({"to_dir": bool(to_dir)})


class HotCurve(Command):
    """Drafting quality against the hot tier's size (``ngramd/hot/curve.py``): the sequences
    sent are replayed from token ``prompt_tokens`` on, ``max_len`` a step, against ``points``
    budgets halving from ``max_mb`` (at most 8x the hot budget: ``Table.hot_curve``).  The
    value: per budget, AL with the request-local table first and with the hot tier alone,
    acceptance and hit rates per order; ``recommended``: the smallest with 97% of the largest
    one's AL."""

    name = "hot_curve"
    runs = POOL
    waits = True
    batch = True
    fields = (Field("max_mb", "number", 0.001, float(1 << 20), None,
                    "largest hot budget to try, MiB (default 4x hot_budget_mb or the hot tier's size)"),
              Field("points", "int", 2, 16, 8, "budgets: max_mb, max_mb/2, ..."),
              Field("prompt_tokens", "int", 1, 1 << 20, 64,
                    "tokens of each sequence before the replay starts"),
              Field("max_len", "int", 1, 64, 8, "draft tokens per step (k)"))
    timeout_ms = SLOW_TIMEOUT_MS
    help = "AL and hit rate against the hot budget, from FILES held out of the table"

    def message(self, seqs: Sequence, max_mb: float | None = None, points: int = 8,
                prompt_tokens: int = 64, max_len: int = 8):
        return Message({"max_mb": max_mb, "points": int(points),
                        "prompt_tokens": int(prompt_tokens), "max_len": int(max_len)}, seqs)


class SavePolicy(Command):
    """Store a generator's draft-length-policy state, opaque bytes of at most
    ``MAX_POLICY_STATE_BYTES``, under ``key`` (printable ASCII, at most
    ``MAX_POLICY_KEY_BYTES``: e.g. ``cpu:/models/qwen3-0.6b``), replacing the one stored there;
    a restarted generator starts from it (``load_policy``).  Durable in the table's RocksDB: it
    survives a restart and rides checkpoints and snapshots.  At most ``MAX_POLICY_STATES`` keys
    a table.  The value: ``key``, ``bytes`` (the state's size) and ``states`` (the keys stored
    now)."""

    name = "save_policy"
    runs = POOL
    fields = (Field("key", "ascii", 1, MAX_POLICY_KEY_BYTES,
                    doc="whose state: the generator's device and model, say"),
              Field("state", "blob", 0, MAX_POLICY_STATE_BYTES,
                    doc="the state, opaque bytes"))
    help = "store a generator's draft-length-policy state (opaque bytes) under a key"

    def message(self, key: str, state: bytes):
        if isinstance(state, (bytearray, memoryview)):
            state = bytes(state)
        return Message({"key": key, "state": state})


class LoadPolicy(Command):
    """The draft-length-policy state ``save_policy`` stored under ``key``: ``state`` (bytes)
    and ``saved_at`` (unix seconds), both None when none is stored there."""

    name = "load_policy"
    runs = POOL
    fields = (Field("key", "ascii", 1, MAX_POLICY_KEY_BYTES, doc="the key it was saved under"),)
    help = "a generator's draft-length-policy state stored under a key (bytes as base64)"

    def message(self, key: str):
        return Message({"key": key})
