"""Constants of the formats and the protocol, importable without numba.

They are part of the on-disk and shared-memory formats (change one and bump the format
version).  ``ngramd.kernels`` re-exports them for the kernels; the client library, the CLI and
the identity code import them from here, so ``import ngram_client`` loads neither numba nor
RocksDB (tested in tests/test_client_cli.py).
"""

from __future__ import annotations

import numpy as np

HASH_SEED = np.uint64(0x9E3779B97F4A7C15)
HASH_MUL = np.uint64(0xFF51AFD7ED558CCD)
HASH_ORDER_MUL = np.uint64(0xC4CEB9FE1A85EC53)
SLOT_WORDS = 8
SLOT_BYTES = SLOT_WORDS * 4
#: 64-bit words in one block of a blocked Bloom filter (a 512-bit cache line: kernels.bloom;
#: part of the hot segment's and the image's format)
BB_BLOCK_WORDS = 8
HOT_K = 3
EMPTY_TOKEN = np.uint32(0xFFFFFFFF)
MAX_ORDER = 32
U16_MAX = 0xFFFF
#: the share rule is ``count >= s_min * total * SHARE_SLACK``: thresholds travel as float32, and
#: float32(0.6) * 10 > 6 would reject a share of exactly 6/10 (found by hypothesis)
SHARE_SLACK = 1.0 - 1e-6

TIER_LOCAL = 0
TIER_HOT = 1
TIER_COLD = 2
TIER_RECENT = 3  # the shared-memory table of what the daemon counted since (ngramd/hot/shm.py)
TIER_NAMES = ("local", "hot", "cold", "recent")
#: the longest draft any part makes or answers (tokens): the bound of ``[table] max_draft_len``
#: (the table's own limit, 16 by default), of the draft op's ``max_len`` and of an in-process
#: reader's buffers (``HotReader``)
MAX_DRAFT_LEN = 4096
#: where hot tiers live unless ``[table] shm_dir`` says otherwise
DEFAULT_SHM_DIR = "/dev/shm/ngramd"
