"""Fill numba's on-disk cache once, before the first test (``conftest.numba_cache``).

Every kernel is ``@njit(cache=True)``: the first process to call it with a signature compiles
it (0.1-1 s a kernel, holding the GIL) and writes the result beside the source
(``__pycache__``, or ``$NUMBA_CACHE_DIR``); later processes load it.  On a fresh clone the first
daemons of a run compiled while their tests waited on deadlines: a daemon's background warm-up
held the GIL long enough that ``test_cli_draft_and_lookup_decode_text`` once failed with "no
answer ... 3 tries of 2000 ms".  ``warm`` runs, in the test process, the paths a daemon, a
hot-tier reader and a generator's drafter take, with the argument types they use, so every
process of the run finds them compiled.  With the cache filled it costs a few seconds (loads).
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import numpy as np


def warm(root: Path, tokenizer: str = "") -> None:
    """Call every kernel path once on small data; ``root`` is a scratch directory."""
    from ngramd.config import TableConfig
    from ngramd.hot.shm import HotReader
    from ngramd.table import Table, _warm_background
    from ngram_generator import stepkernels
    from ngram_generator.drafting import NgramDrafter

    shm = Path("/dev/shm") / f"ngramd-warm-{uuid.uuid4().hex[:10]}"
    cfg = TableConfig(name="warm", data_dir=str(root / "data"), shm_dir=str(shm),
                      tokenizer=tokenizer, hot_budget_mb=1.0, hot_rebuild_s=0.0, recent_mb=1.0)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 500, 3000).astype(np.uint32) for _ in range(4)]
    tokens = np.concatenate(seqs)
    offsets = np.zeros(len(seqs) + 1, np.int64)
    np.cumsum([s.size for s in seqs], out=offsets[1:])
    ctx = np.ascontiguousarray(tokens[:40])
    ctx_offs = np.array([0, 20, 40], np.int64)
    try:
        with Table(cfg) as t:  # compiles the request path (Table._warm_kernels)
            _warm_background(t.identity)  # the write path's and the hot build's, here at once
            for _ in range(2):  # two runs: the second flush merges
                t.writes.ingest(tokens, offsets)
                t.writes.flush()
            t.rebuild_hot()
            t.writes.ingest(tokens[:500], np.array([0, 500], np.int64))  # the recent table
            t.writes.flush()
            t.draft(ctx, ctx_offs, 8, budget_us=1e6)
            t.lookup(ctx, ctx_offs)
            t.top(3, 5)
            t.cold.checksum()
            t.hotcycle.hot_curve(tokens[:400], np.array([0, 400], np.int64), max_mb=1.0,
                                 points=2, prompt_tokens=64, max_len=8)
            reader = HotReader(shm, "warm", identity=t.identity)
            reader.draft(ctx[:20], 8, t.rules)
            reader.draft_batch(ctx, ctx_offs, 8, t.rules)
            reader.probe_batch(np.zeros(4, np.uint64))
            drafter = NgramDrafter()  # compiles the request-local table's kernels
            drafter.start(ctx)
            drafter.draft(8)
            drafter.finish()
            stepkernels.warm()  # the draft-length policy's and the batch's kernels
    finally:
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":  # conftest.pytest_configure: once, before xdist starts its workers
    import tempfile

    from ngram_client.cli import default_tokenizer_path

    with tempfile.TemporaryDirectory(prefix="numba-warm-") as d:
        warm(Path(d), str(default_tokenizer_path() or ""))
