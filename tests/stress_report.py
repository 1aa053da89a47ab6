"""Print the summary table of a reliability run (``make stress``): one row per scenario, from
the JSON lines ``tests/test_reliability.py`` appends to ``$NGRAM_STRESS_REPORT``.

    python tests/stress_report.py [bench/out/stress.jsonl]
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path


def _kv(d: dict) -> str:
    return " ".join(f"{k}={json.dumps(v, separators=(',', ':')) if isinstance(v, dict) else v}"
                    for k, v in d.items())


def main(argv: list[str]) -> int:
    path = Path(argv[0] if argv else os.environ.get("NGRAM_STRESS_REPORT",
                                                    "bench/out/stress.jsonl"))
    if not path.exists():
        print(f"stress_report: no rows in {path}", file=sys.stderr)
        return 1
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    cols = ("scenario", "size", "what", "counts", "result", "s")
    table = [(r["scenario"], r["size"], r["what"], _kv(r.get("counts", {})),
              r["result"][:60], f"{r['seconds']:.1f}") for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    widths[3] = min(widths[3], 80)
    line = "  ".join(f"{{:{w}.{w}}}" for w in widths)
    print(f"reliability run: {platform.node()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}; rows from {path}")
    print(line.format(*cols))
    print(line.format(*("-" * w for w in widths)))
    for r, t in zip(rows, table):
        print(line.format(*t))
        if r.get("figures"):
            print(f"    figures: {_kv(r['figures'])}")
        if len(r["result"]) > 60:
            print(f"    result: {r['result']}")
    failed = sum(not r["result"].startswith(("pass", "skip")) for r in rows)
    total = sum(r["seconds"] for r in rows)
    print(f"{len(rows)} scenarios, {failed} failed, {total / 60:.1f} min in scenarios")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
