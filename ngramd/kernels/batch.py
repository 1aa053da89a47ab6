"""Batched drafting: one numba call drafts every row of an engine's step, each row with its
own first table (its request-local table) beside the tiers all rows share (ARCHITECTURE §3.4,
§12).

``kernels.draft`` drafts a batch of contexts from one set of four tables.  A vLLM step has a
request-local table per row: drafting it with ``draft`` took one call, one type dispatch and one
trip through Python per row.  ``draft_rows`` runs the very step ``draft`` runs for each context
(``kernels.drafting._draft_one``) for every row in one call, the row's first table taken from
``firsts[b]``, so each row drafts exactly what ``draft`` drafts for that row alone (tested
against it).  vLLM's ``batch_propose_numba`` (``vllm/v1/spec_decode/ngram_proposer.py``) is the
model: one jitted loop over the rows of a step.  Called through ``drafttiers.DraftTiers``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..wire.constants import HOT_K
from .drafting import _draft_one


@njit(cache=True)
def draft_scratch(n_max, max_len):
    """The scratch buffers ``kernels.drafting._draft_one`` reuses for every context of a call: the
    window of ``n_max + max_len`` tokens, the suffix hashes, candidate and per-table state."""
    return (np.empty(n_max + max_len, np.uint32), np.zeros(n_max + 1, np.uint64),
            np.empty(HOT_K, np.uint32), np.empty(HOT_K, np.uint32), np.empty(HOT_K, np.uint32),
            np.empty(HOT_K, np.uint32), np.full(4, n_max, np.int64), np.zeros(4, np.int64),
            np.zeros(4, np.int64))


@njit(cache=True)
def draft_rows(source, firsts, rules, tokens, offsets, max_lens, out):
    """Draft up to ``max_lens[b]`` tokens after each context ``tokens[offsets[b]:offsets[b+1]]``
    into row ``b`` of ``out`` (``kernels.draft``'s layouts), from ``source`` with its first
    table replaced by ``firsts[b]`` (a numba typed list of slot tables of one type: the
    ``source``'s own first table is not read).  A row with ``max_lens[b] <= 0`` drafts nothing;
    ``max_lens`` above ``out``'s width are cut to it.  Returns the slot-table probes spent.

    The scratch buffers are allocated once a call, as in ``draft``."""
    n_max = rules[1]
    out_tok, out_order, out_tier, out_conf, out_len = out
    width = out_tok.shape[1]
    _, t1, t2, t3, tiers, restart, max_probe, pruned, nprobe, pruned_table = source
    scratch = draft_scratch(n_max, width)
    probes = 0
    for b in range(offsets.shape[0] - 1):
        max_len = min(max_lens[b], width)
        if max_len <= 0:
            out_len[b] = 0
            continue
        row = (firsts[b], t1, t2, t3, tiers, restart, max_probe, pruned, nprobe, pruned_table)
        ln, p = _draft_one(row, rules, tokens[offsets[b]:offsets[b + 1]], max_len, out_tok[b],
                           out_order[b], out_tier[b], out_conf[b], scratch)
        out_len[b] = ln
        probes += p
    return probes
