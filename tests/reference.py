"""Plain-Python reference implementations the kernels are tested against.

Slow and obvious on purpose: dicts of tuples, Counters, Python ints.
"""

from __future__ import annotations

from collections import Counter, defaultdict

M64 = (1 << 64) - 1
SEED = 0x9E3779B97F4A7C15
MUL = 0xFF51AFD7ED558CCD
ORDER_MUL = 0xC4CEB9FE1A85EC53


def fmix64(k: int) -> int:
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & M64
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & M64
    k ^= k >> 33
    return k


def key_hash(ctx) -> int:
    """The documented key of a context (all of ``ctx``), see ngramd.kernels.hashing."""
    s = SEED
    n = len(ctx)
    for k in range(1, n + 1):
        s = ((s ^ int(ctx[n - k])) * MUL) & M64
        s = ((s << 31) | (s >> 33)) & M64
    key = fmix64(s ^ ((n * ORDER_MUL) & M64))
    return key or 1


def count(seqs, n_min, n_max):
    """{context tuple: Counter(next token)} over all orders n_min..n_max."""
    table = defaultdict(Counter)
    for seq in seqs:
        seq = [int(t) for t in seq]
        for i in range(1, len(seq)):
            for n in range(n_min, min(i, n_max) + 1):
                table[tuple(seq[i - n:i])][seq[i]] += 1
    return table


def topk(counter: Counter, k: int):
    """Best k (token, count) by count desc, token asc."""
    return sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))[:k]


def draft(table, ctx, n_min, n_max, max_len, c_min=1, s_min=0.0, p_cum=0.0, f_cap=0.0,
          step_rule="next_order"):
    """Chained longest match.  ``step_rule``: "next_order" starts each step at the previous
    match order + 1 (the kernel's rule); "full" always starts at n_max."""
    ext = [int(t) for t in ctx]
    out = []
    start = n_max
    pc = 1.0
    cap = max_len
    while len(out) < max_len:
        hi = min(start, len(ext), n_max)
        found = None
        for n in range(hi, n_min - 1, -1):
            c = table.get(tuple(ext[len(ext) - n:]))
            if not c:
                continue
            tok, cnt = topk(c, 1)[0]
            total = sum(c.values())
            if cnt < c_min or cnt < s_min * total:
                continue
            found = (n, tok, cnt / total)
            break
        if found is None:
            break
        n, tok, share = found
        start = min(n + 1, n_max) if step_rule == "next_order" else n_max
        pc *= share
        if out and pc < p_cum:
            break
        if not out and f_cap > 0:
            cap = min(max_len, max(1, int(f_cap * n)))
        out.append((tok, n))
        ext.append(tok)
        if len(out) >= cap:
            break
    return out


def local_table(seqs, n_min, n_max, hot_k=3, limit=0xFFFF):
    """The request-local table (``kernels.local.local_add``): ``{context tuple: (candidates,
    total)}`` with ``candidates`` a list of ``[token, count]``, best first.

    Per event: a known candidate gains 1; else a free place takes the token with count 1; else
    a weakest (last) candidate with count <= 1 is replaced by the token with count 1; else the
    weakest loses 1 and the token is not kept.  ``total`` counts every event.  Candidates stay
    in a stable descending order of count.  A total above ``limit`` halves every count (down)
    and the total (up)."""
    table = {}
    for seq in seqs:
        seq = [int(t) for t in seq]
        for i in range(1, len(seq)):
            for n in range(n_min, min(i, n_max) + 1):
                ctx = tuple(seq[i - n:i])
                cands, total = table.get(ctx, ([], 0))
                tok = seq[i]
                for c in cands:
                    if c[0] == tok:
                        c[1] += 1
                        break
                else:
                    if len(cands) < hot_k:
                        cands.append([tok, 1])
                    elif cands[-1][1] <= 1:
                        cands[-1] = [tok, 1]
                    else:
                        cands[-1][1] -= 1
                total += 1
                cands.sort(key=lambda c: -c[1])  # stable: ties keep their order
                if total > limit:
                    for c in cands:
                        c[1] //= 2
                    total = (total + 1) // 2
                table[ctx] = (cands, total)
    return table
