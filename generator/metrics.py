"""Per-request metrics and their summary.

The loop only increments counters in a :class:`RequestMetrics`; derived figures (tokens/s, AL,
acceptance rate, drafting share) are properties, and :func:`summarize`/:func:`format_table`
turn a list of them into the end-of-run report.  Times are seconds, rates tokens per second.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Iterable

from ngramd.wire.constants import TIER_NAMES


@dataclass
class RequestMetrics:
    """Counters of one request.

    * ``ttft_s`` — from the start of ``generate`` to the first new token (prefill included).
    * ``decode_s`` — from the first new token to the last; ``decode_tokens`` tokens came in it.
    * ``verify_forwards`` — forwards after the prefill (one per step, drafts or not).
    * ``drafted``/``accepted`` — draft tokens verified / accepted (bonus tokens excluded).
    * ``draft_s`` — time spent producing drafts and choosing their length.
    """

    mode: str = "spec"  # "spec" or "plain"
    prompt_tokens: int = 0
    new_tokens: int = 0
    finish_reason: str = ""
    ttft_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0
    verify_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    drafted_by_order: dict[int, int] = field(default_factory=dict)
    accepted_by_order: dict[int, int] = field(default_factory=dict)
    drafted_by_tier: dict[str, int] = field(default_factory=dict)
    accepted_by_tier: dict[str, int] = field(default_factory=dict)

    def count_draft(self, orders, tiers, accepted: int) -> None:
        """Attribute one verified draft: its first ``accepted`` tokens were accepted."""
        self.drafted += len(orders)
        self.accepted += accepted
        for i, (o, t) in enumerate(zip(orders, tiers)):
            o = int(o)
            name = TIER_NAMES[t] if 0 <= t < len(TIER_NAMES) else str(int(t))
            self.drafted_by_order[o] = self.drafted_by_order.get(o, 0) + 1
            self.drafted_by_tier[name] = self.drafted_by_tier.get(name, 0) + 1
            if i < accepted:
                self.accepted_by_order[o] = self.accepted_by_order.get(o, 0) + 1
                self.accepted_by_tier[name] = self.accepted_by_tier.get(name, 0) + 1

    @property
    def forwards(self) -> int:
        """Model forwards: the prefill and every verify step."""
        return self.verify_forwards + 1

    @property
    def decode_tokens(self) -> int:
        return max(self.new_tokens - 1, 0)

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second after the first token (0 when fewer than two tokens came)."""
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """AL: tokens gained per verify forward, the bonus token counted (plain decoding: 1)."""
        if not self.verify_forwards:
            return 0.0
        return (self.accepted + self.verify_forwards) / self.verify_forwards

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def draft_share(self) -> float:
        """Share of the request's wall time spent drafting."""
        return self.draft_s / self.total_s if self.total_s > 0 else 0.0

    def to_dict(self) -> dict:
        """JSON-ready record (keys are strings)."""
        return {
            "mode": self.mode, "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
            "finish_reason": self.finish_reason, "ttft_s": round(self.ttft_s, 6),
            "decode_s": round(self.decode_s, 6), "total_s": round(self.total_s, 6),
            "decode_tok_s": round(self.decode_tok_s, 3), "forwards": self.forwards,
            "verify_forwards": self.verify_forwards, "drafted": self.drafted,
            "accepted": self.accepted, "al": round(self.mean_accepted_length, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "draft_share": round(self.draft_share, 5),
            "per_order": {str(o): {"drafted": d, "accepted": self.accepted_by_order.get(o, 0)}
                          for o, d in sorted(self.drafted_by_order.items())},
            "per_tier": {t: {"drafted": d, "accepted": self.accepted_by_tier.get(t, 0)}
                         for t, d in sorted(self.drafted_by_tier.items())},
        }


def summarize(rows: Iterable[RequestMetrics]) -> dict:
    """Totals over requests: tokens/s from summed tokens and times (not a mean of ratios),
    medians of TTFT and per-request tokens/s, AL and acceptance over all verify steps."""
    rows = list(rows)
    if not rows:
        return {"requests": 0}
    tokens = sum(r.decode_tokens for r in rows)
    decode_s = sum(r.decode_s for r in rows)
    verify = sum(r.verify_forwards for r in rows)
    accepted = sum(r.accepted for r in rows)
    drafted = sum(r.drafted for r in rows)
    total_s = sum(r.total_s for r in rows)
    by_order: dict[int, list[int]] = {}
    for r in rows:
        for o, d in r.drafted_by_order.items():
            acc = by_order.setdefault(o, [0, 0])
            acc[0] += d
            acc[1] += r.accepted_by_order.get(o, 0)
    return {
        "requests": len(rows),
        "new_tokens": sum(r.new_tokens for r in rows),
        "decode_tok_s": tokens / decode_s if decode_s > 0 else 0.0,
        "median_decode_tok_s": statistics.median(r.decode_tok_s for r in rows),
        "median_ttft_s": statistics.median(r.ttft_s for r in rows),
        "forwards": sum(r.forwards for r in rows),
        "al": (accepted + verify) / verify if verify else 0.0,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "draft_share": sum(r.draft_s for r in rows) / total_s if total_s > 0 else 0.0,
        "per_order": {o: {"drafted": d, "accepted": a} for o, (d, a) in sorted(by_order.items())},
    }


def format_table(rows: list[list], header: list[str]) -> str:
    """A plain fixed-width text table (numbers right-aligned)."""
    cells = [[_fmt(c) for c in row] for row in [header] + rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for j, r in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if j and _numeric(c) else c.ljust(w)
                               for c, w in zip(r, widths)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(c) -> str:
    if isinstance(c, float):
        return f"{c:.3f}" if abs(c) < 10 else f"{c:.1f}"
    return str(c)


def _numeric(s: str) -> bool:
    try:
        float(s.rstrip("x%"))
        return True
    except ValueError:
        return False
