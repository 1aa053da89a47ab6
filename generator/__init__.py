"""ngram_generator — speculative decoding for causal LMs, drafting from n-gram tables.

Read ``spec.py`` first (the loop), then ``sampling.py`` (lossless acceptance) and
``drafting.py`` (where drafts come from) and ``policy/`` (how many of their tokens to
verify).  ``model.py`` loads
checkpoints, ``remote.py`` is the only module that talks to the daemon, ``cli.py`` is
``ngram-generate``; ``vllm.py`` is the proposer vLLM loads (``method="custom_class"``).

The names below are imported on first use (PEP 562), so that ``ngram_generator.vllm`` and
``ngram_generator.drafting`` load without torch or transformers: the vLLM environment pins its
own transformers, and the ``generator`` extra (torch, transformers) is only for the loop here.
"""

import importlib

_EXPORTS = {
    "DaemonLink": "remote", "Draft": "drafting", "DraftConfig": "drafting",
    "DraftLengthPolicy": "policy", "DraftSource": "drafting", "NgramDrafter": "drafting",
    "StepCost": "policy", "AcceptanceModel": "policy", "RequestMetrics": "metrics", "summarize": "metrics",
    "LoadedModel": "model", "ModelLoadError": "model", "load_model": "model",
    "SamplingParams": "sampling", "Generation": "spec", "Generator": "spec",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
