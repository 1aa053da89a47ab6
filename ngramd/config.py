"""Settings of every component, one frozen dataclass each, loaded from TOML with CLI overrides.

Unknown keys are rejected (a typo in a config file must not silently fall back to a default).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any

import numpy as np

from .errors import BadInput
from .identity import SEED_PRESET


@dataclass(frozen=True)
class ColdConfig:
    """RocksDB tuning, all in one place (DESIGN §5)."""

    block_cache_mb: int = 256
    bloom_bits_per_key: float = 10.0
    direct_reads: bool = False  # bypass the page cache: measures the disk (seed lesson 4)
    compression: str = "zstd"  # zstd | lz4 | none
    sync_log: bool = True  # fsync the WAL before acknowledging an ingest
    read_threads: int = 4
    write_buffer_mb: int = 64


@dataclass(frozen=True)
class TableConfig:
    """What one table is and how it drafts.  Orders default to 1..16; ``preset = "seed"`` gives
    the seed report's 4..8."""

    name: str = "default"
    data_dir: str = "./var/ngramd"  # RocksDB lives in <data_dir>/<name>
    shm_dir: str = "/dev/shm/ngramd"
    preset: str = ""  # "" or "seed" (orders 4..8)
    n_min: int = 1
    n_max: int = 16
    cold_k: int = 8
    vocab_size: int = 151_936
    tokenizer: str = ""  # path of tokenizer.json (or its directory): its sha256 is recorded
    learn_prompts: bool = True  # generators ingest prompts as well as outputs
    # stop rules (DESIGN §3): scalars apply to every order; lists give one value per order n_min..n_max
    c_min: Any = 1
    s_min: Any = 0.3
    p_cum: float = 0.1
    f_cap: float = 0.0  # 0 = uncapped; else cap the draft at f_cap x the first matched order
    max_draft_len: int = 16
    # hot tier
    hot_budget_mb: float = 64.0
    hot_max_probe: int = 16
    hot_rebuild_s: float = 30.0  # scheduled rebuild period (0 = only on demand)
    hot_grace_s: float = 10.0  # old generations are unlinked this long after a swap
    hit_decay: float = 0.5  # decay of observed lookup hits per rebuild
    # degrade (DESIGN §7)
    budget_us: float = 0.0  # 0 = derived: mean hot lookup x 1.5
    warm_cache_entries: int = 65_536
    apply_batch_tokens: int = 1_000_000
    cold: ColdConfig = field(default_factory=ColdConfig)

    def __post_init__(self):
        if self.preset not in ("", "seed"):
            raise BadInput(f"unknown preset {self.preset!r} (known: 'seed')")
        if self.preset == "seed":
            object.__setattr__(self, "n_min", SEED_PRESET["n_min"])
            object.__setattr__(self, "n_max", SEED_PRESET["n_max"])
        if not 1 <= self.n_min <= self.n_max:
            raise BadInput(f"need 1 <= n_min <= n_max, got {self.n_min}..{self.n_max}")
        for name in ("c_min", "s_min"):
            v = getattr(self, name)
            if isinstance(v, (list, tuple)) and len(v) != self.n_max - self.n_min + 1:
                raise BadInput(f"{name}: expected one value per order "
                               f"{self.n_min}..{self.n_max}, got {len(v)}")

    def per_order(self, name: str, dtype) -> np.ndarray:
        """``c_min``/``s_min`` as an array indexed by order (length n_max + 1)."""
        v = getattr(self, name)
        out = np.zeros(self.n_max + 1, dtype)
        if isinstance(v, (list, tuple)):
            out[self.n_min:] = v
        else:
            out[:] = v
        return out


def from_dict(cls, data: dict, where: str = ""):
    """Build dataclass ``cls`` from a dict, recursing into nested dataclasses; unknown keys are
    a ``BadInput`` naming them."""
    if not isinstance(data, dict):
        raise BadInput(f"{where or cls.__name__}: expected a table, got {type(data).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise BadInput(f"unknown config key(s) in [{where or cls.__name__}]: {', '.join(unknown)}")
    kwargs = {}
    for k, v in data.items():
        default = known[k].default_factory() if callable(known[k].default_factory) else known[k].default
        if is_dataclass(default):
            v = from_dict(type(default), v, f"{where}.{k}" if where else k)
        kwargs[k] = v
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise BadInput(f"[{where or cls.__name__}]: {e}") from None


def override(obj, **changes):
    """``dataclasses.replace`` that ignores ``None`` values (unset CLI flags)."""
    changes = {k: v for k, v in changes.items() if v is not None}
    return replace(obj, **changes) if changes else obj
