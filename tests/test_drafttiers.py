"""The drafting front end (``ngramd.drafttiers``, ``ngramd.kernels.batch``): one compiled
specialisation of the kernel whatever tiers are mapped, and the batched draft of an engine's
rows equal to each row's own draft, over a real hot tier (pruned, with its filter) and a real
recent table in /dev/shm."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import numba
import numpy as np
import pytest

from ngram_generator.batch import BatchDrafter, BatchSettings
from ngram_generator.drafting import DraftConfig, NgramDrafter, draft_rows
from ngramd import kernels as K
from ngramd.hot import shm as hotshm
from ngramd.drafttiers import EMPTY, LOCAL_FIRST, NO_SHARED, WARM_FIRST, DraftTiers, SharedTiers
from ngramd.hot.selection import build_hot, pruned_filter
from ngramd.hot.shm import HotPublisher, HotReader
from ngramd.cold.rows import Counter
from ngramd.wire.identity import TableIdentity
from ngramd.wire.rules import DraftRules
from ngramd.kernels.count import count_ngrams
from ngramd.wire.constants import SLOT_WORDS

VOCAB = 4000
IDENT = TableIdentity(n_min=1, n_max=8, cold_k=4, vocab_size=VOCAB)
RULES = DraftRules(n_min=1, n_max=8, max_draft_len=8)  # the table's default stop rules
CONFIG = DraftConfig(rules=RULES)


def texts(rng, pool, n: int) -> list[np.ndarray]:
    """``n`` texts of 30 phrases drawn from ``pool`` with 0-2 noise ids between them."""
    out = []
    for _ in range(n):
        parts = []
        for p in rng.integers(0, len(pool), 30):
            parts += [pool[p], rng.integers(0, VOCAB, rng.integers(0, 3)).astype(np.uint32)]
        out.append(np.concatenate(parts))
    return out


@pytest.fixture
def reader():
    """A reader of a pruned hot tier (with its filter) of one set of texts and a recent epoch
    of another, and held-out texts drawn from both."""
    base = tempfile.mkdtemp(prefix="ngramd-test-", dir="/dev/shm")
    rng = np.random.default_rng(3)
    pool = [rng.integers(0, VOCAB, rng.integers(6, 20)).astype(np.uint32) for _ in range(300)]
    hot_pool, recent_pool = pool[:200], pool[200:]
    train = np.concatenate(texts(rng, hot_pool, 40))
    rows = count_ngrams(train, np.array([0, train.size]), 1, 8, 4)
    slots, _, redundant = build_hot(rows, 1 << 20, 1, 0.3, 16, return_pruned=True)
    words, nprobe = pruned_filter(redundant)
    assert nprobe and words.size  # the filter is exercised
    pub = HotPublisher(os.path.join(base, "n"), "t", IDENT, grace_s=0.0)
    pub.publish(slots, 16, pruned=words, pruned_nprobe=nprobe)
    rec = hotshm.RecentTable(pub, 1 << 14, 16, grace_s=0.0)
    fresh = np.concatenate(texts(rng, recent_pool, 10))
    rs = Counter(IDENT).count(fresh, np.array([0, fresh.size]), np.zeros(1, np.int64))
    assert rec.add(rs.key, rs.order, rs.total, rs.poff, rs.tok, rs.cnt) > 0
    r = HotReader(os.path.join(base, "n"), "t", identity=IDENT)
    try:
        yield r, texts(rng, pool, 16)
    finally:
        r.close()
        rec.close()
        pub.close()
        shutil.rmtree(base, ignore_errors=True)


def _same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in ((a.tokens, b.tokens), (a.orders, b.orders),
                                                 (a.tiers, b.tiers), (a.conf, b.conf)))


def test_a_batch_drafts_what_each_row_drafts_alone(reader):
    """``draft_rows`` (one kernel call, each row its own request-local table) gives every row
    the draft its drafter gives alone: rows that move, limits that differ (0 included) and a
    local table larger than the others."""
    r, held = reader
    link = SimpleNamespace(hot_table=lambda: r, available=False)
    n = len(held)
    batch = [NgramDrafter(CONFIG, link) for _ in range(n)]
    alone = [NgramDrafter(CONFIG, link) for _ in range(n)]
    pos = [20 + 3 * i for i in range(n)]
    pos[0] = 6000  # a request whose local table outgrew the default
    held[0] = np.concatenate([held[0]] * (6300 // held[0].size + 1))
    for d, e, t, p in zip(batch, alone, held, pos):
        d.start(t[:p])
        e.start(t[:p])
    assert batch[0].tiers.first.shape[0] > batch[1].tiers.first.shape[0]
    tiers = DraftTiers(LOCAL_FIRST, None, CONFIG.max_probe)
    rng = np.random.default_rng(0)
    seen, drafted = set(), 0
    for step in range(40):
        order = rng.permutation(n)  # the engine moves rows
        limits = [int(x) for x in rng.integers(-1, 11, n)]
        got = draft_rows([batch[i] for i in order], limits, tiers, link)
        for j, i in enumerate(order):
            want = alone[i].draft(limits[j])
            assert _same(got[j], want), (step, i)
            seen |= set(want.tiers.tolist())
            drafted += len(want)
        for i in range(n):
            k = int(rng.integers(1, 4))
            new = held[i][pos[i]:pos[i] + k]
            pos[i] += k
            batch[i].extend(new)
            alone[i].extend(new)
    assert drafted > 500 and seen == {K.TIER_LOCAL, K.TIER_HOT, K.TIER_RECENT}


def test_the_vllm_batch_drafts_as_its_rows_alone_with_the_shared_tiers(reader):
    """``BatchDrafter.step`` (full drafts) over the hot and recent tiers: each row's draft is
    that of a drafter started on the row's tokens."""
    r, held = reader
    link = SimpleNamespace(hot_table=lambda: r, available=False, refresh=lambda: None,
                           state="off", learn_prompts=False)
    bd = BatchDrafter(CONFIG, link, vocab_size=VOCAB, settings=BatchSettings(full_drafts=True))
    rows = 6
    width = max(t.size for t in held)
    tokens = np.zeros((rows, width), np.int32)
    num = np.array([30 + 5 * i for i in range(rows)], np.int64)
    for i in range(rows):
        tokens[i, :held[i].size] = held[i]
    hot_tokens = 0
    for _ in range(20):
        sampled = [tokens[i, num[i] - 1:num[i]].tolist() for i in range(rows)]
        got = bd.step(sampled, num, tokens, 8)
        for i in range(rows):
            ref = NgramDrafter(CONFIG, link)
            ref.start(tokens[i, :num[i]].astype(np.uint32))
            want = ref.draft(8)
            assert got[i] == want.tokens.tolist(), i
            hot_tokens += int((want.tiers == K.TIER_HOT).sum())
        num += 2
    assert hot_tokens > 0


def test_every_source_has_one_numba_type(reader):
    """With or without a hot tier, a first table or the daemon's layout: the kernel's source
    types the same, so numba compiles one version of the kernel for all of them."""
    r, _ = reader
    local = np.zeros((64, SLOT_WORDS), np.uint32)
    sources = [DraftTiers().source, DraftTiers(LOCAL_FIRST, local, 16).source,
               DraftTiers(WARM_FIRST, local, 16, r.tiers).source,
               DraftTiers(shared=r.tiers).source,
               DraftTiers(shared=SharedTiers(local, max_probe=4)).source]
    assert len({numba.typeof(s) for s in sources}) == 1
    t = DraftTiers(LOCAL_FIRST, local, 16)
    before = t.source
    t.share(NO_SHARED)
    t.set_first(local)
    assert t.source is before  # the same tables: nothing rebuilt
    t.share(r.tiers)
    assert t.source is not before and t.source[1] is r.tiers.hot
    assert not t.first.flags.writeable and t.first.base is local  # a view, not a copy
    assert r.tiers is r.tiers  # one value until something changes
    assert DraftTiers().first is EMPTY


def test_contexts_of_any_type_draft_the_same(reader):
    """The fast call takes a writable uint32 context; any other (a list, int64, read-only)
    takes numba's dispatcher through a uint32 copy of its tail, and drafts the same."""
    r, held = reader
    ctx = held[1][:40].copy()
    want = r.draft(ctx, 8, RULES).copy()
    assert len(want)
    ro = ctx.copy()
    ro.flags.writeable = False
    for other in (ctx.tolist(), ctx.astype(np.int64), ro, np.concatenate([held[2], ctx])):
        assert _same(r.draft(other, 8, RULES), want)


_ONE_SPECIALISATION = r"""
import json, os, sys, numpy as np
from types import SimpleNamespace
from ngramd import kernels as K
from ngramd.kernels.count import count_ngrams
from ngramd.hot.curve import ReplaySettings, replay
from ngramd.hot.selection import build_hot
from ngramd.hot.shm import HotPublisher, HotReader
from ngramd.wire.identity import TableIdentity
from ngramd.wire.rules import DraftRules
from ngram_generator.drafting import DraftConfig, NgramDrafter
shm, rules = sys.argv[1], DraftRules(n_min=1, n_max=8, max_draft_len=8)
ident = TableIdentity(n_min=1, n_max=8, cold_k=4, vocab_size=1000)
holder = SimpleNamespace(reader=None)
link = SimpleNamespace(hot_table=lambda: holder.reader, available=False)
drafter = NgramDrafter(DraftConfig(rules=rules), link)  # compiles, with no hot tier mapped
toks = (np.arange(300, dtype=np.uint32) * 7) % 13
drafter.start(toks[:50])
drafter.draft(8)
slots, _ = build_hot(count_ngrams(toks, np.array([0, toks.size]), 1, 8, 4), 1 << 20, 1, 0.0, 16)
pub = HotPublisher(shm, "t", ident, grace_s=0.0)
pub.publish(slots, 16)
holder.reader = HotReader(shm, "t", identity=ident)  # the hot tier maps mid-run
hot = drafter.draft(8)
holder.reader.draft(toks[:20], 8, rules)
replay(slots, (np.zeros(0, np.uint64), 0), [(toks[:30], toks[30:60])],
       ReplaySettings(rules=rules))
print(json.dumps({"signatures": [str(s) for s in K.draft.signatures], "drafted": len(hot)}))
holder.reader.close()
pub.close()
"""


def test_drafting_with_and_without_a_hot_tier_compiles_one_kernel(tmp_path):
    """In a fresh process: a generator drafts before and after the hot tier maps, a reader and
    the hot-size replay draft too, and ``kernels.draft`` holds one compiled signature (two
    before: a writable empty table and a read-only map typed differently, so the second
    compiled, or loaded, inside the step where the hot tier first mapped)."""
    base = tempfile.mkdtemp(prefix="ngramd-test-", dir="/dev/shm")
    try:
        out = subprocess.run([sys.executable, "-c", _ONE_SPECIALISATION,
                              os.path.join(base, "n")], capture_output=True, text=True,
                             env=dict(os.environ), timeout=600)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["drafted"] > 0
    assert len(got["signatures"]) == 1, got["signatures"]
