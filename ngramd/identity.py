"""The identity of a table: what makes its keys and ids meaningful.

A table records its orders, K, vocabulary size and the tokenizer fingerprint when created;
reopening it (or a client talking to it) with a different identity is an ``IdentityMismatch``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import BadInput, IdentityMismatch
from .kernels import HOT_K, MAX_ORDER

FORMAT_VERSION = 2  # 2: runs of pages (ngramd/cold.py); 1: one RocksDB key per context


@dataclass(frozen=True)
class TableIdentity:
    n_min: int = 1
    n_max: int = 16
    cold_k: int = 8
    vocab_size: int = 151_936  # Qwen3 embedding rows; ids must be below this
    tokenizer: str = ""  # sha256 hex of tokenizer.json ("" = not recorded)
    hot_k: int = HOT_K
    format: int = FORMAT_VERSION

    def __post_init__(self):
        if not 1 <= self.n_min <= self.n_max <= MAX_ORDER:
            raise BadInput(f"orders must satisfy 1 <= n_min <= n_max <= {MAX_ORDER}, "
                           f"got {self.n_min}..{self.n_max}")
        if not 1 <= self.hot_k <= self.cold_k <= 64:
            raise BadInput(f"need 1 <= hot_k ({self.hot_k}) <= cold_k ({self.cold_k}) <= 64")
        if not 2 <= self.vocab_size < 2**32 - 1:
            raise BadInput(f"vocab_size {self.vocab_size} out of range")

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "TableIdentity":
        return cls(**json.loads(raw))

    def check_compatible(self, other: "TableIdentity") -> None:
        """Raise ``IdentityMismatch`` naming every field that differs."""
        diffs = [f"{k}: table has {v!r}, requested {getattr(other, k)!r}"
                 for k, v in asdict(self).items() if getattr(other, k) != v]
        if diffs:
            raise IdentityMismatch("table identity differs: " + "; ".join(diffs))


#: The seed report's orders, kept as a one-line preset (DESIGN §3).
SEED_PRESET = dict(n_min=4, n_max=8)


def tokenizer_fingerprint(path: str | Path) -> str:
    """sha256 of a tokenizer.json (or of ``tokenizer.json`` inside a directory)."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise BadInput(f"tokenizer file not found: {p}")
    return hashlib.sha256(p.read_bytes()).hexdigest()
