"""Requests through llama.cpp (llama-cpp-python), for ``ngram-generate --engine llamacpp``
(``cli.py``) and ``bench/bench_llamacpp.py``: :class:`LlamaTokenizer` (a loaded ``Llama``'s
tokenizer and chat template, in the shape the CLI and the benches use a transformers
tokenizer), :func:`load_llama` and :func:`run_request` (one request, timed, with its metrics).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from .metrics import RequestMetrics


#: llama.cpp's context is rounded up to this many tokens
CTX_ROUND = 256


class LlamaTokenizer:
    """The tokenizer of a ``Llama`` (``vocab_only=True`` loads only that), with the GGUF's chat
    template rendered as llama-cpp-python renders it (``Jinja2ChatFormatter``)."""

    def __init__(self, llm):
        self.llm = llm
        self.chat_template = llm.metadata.get("tokenizer.chat_template")
        self.vocab_size = int(llm.n_vocab())
        self.eos_token_id = int(llm.token_eos())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_special_tokens, special=True)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def decode(self, ids) -> str:
        return self.llm.detokenize(list(ids)).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = False):
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        if not self.chat_template:
            raise ValueError("the GGUF file has no chat template (tokenizer.chat_template)")
        vocab = self.llm

        def piece(i: int) -> str:
            return vocab.detokenize([i], special=True).decode("utf-8", errors="replace")

        fmt = Jinja2ChatFormatter(self.chat_template, eos_token=piece(vocab.token_eos()),
                                  bos_token=piece(vocab.token_bos()),
                                  add_generation_prompt=add_generation_prompt)
        text = fmt(messages=messages).prompt
        return self.encode(text, add_special_tokens=False) if tokenize else text


def load_llama(path: str | Path, *, n_ctx: int, threads: int | None = None,
               flash_attn: bool = False, draft_model=None):
    """A ``Llama`` for ``path`` (quiet: llama.cpp's own log off).  With a draft model,
    ``logits_all=True`` too: llama-cpp-python 0.3.36 keeps every position's logits when it has
    a draft model but sizes their buffer by the ``logits_all`` argument (``n_batch`` rows
    without it), so a request past 512 tokens fails in ``Llama.eval``."""
    from llama_cpp import Llama

    return Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                 flash_attn=flash_attn, draft_model=draft_model,
                 logits_all=draft_model is not None, verbose=False)


def trained_context(llm, default: int = 2048) -> int:
    """The context the model was trained for (its GGUF's ``<arch>.context_length``)."""
    meta = llm.metadata
    value = meta.get(f"{meta.get('general.architecture', 'llama')}.context_length")
    return int(value) if value and str(value).isdigit() else default


def context_size(lengths: list[int], max_new: int, limit: int) -> int:
    """llama.cpp's context for prompts of ``lengths`` tokens and ``max_new`` new tokens,
    rounded up to ``CTX_ROUND``, at most ``limit`` (the model's trained context; a draft past
    the context's end is cut by ``Llama.generate``)."""
    need = max(lengths, default=0) + max_new + 1
    return min(limit, CTX_ROUND * math.ceil(need / CTX_ROUND))


def run_request(llm, ids: list[int], max_new: int, *, temperature: float = 0.0,
                top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, seed: int | None = None,
                stop_ids=None) -> tuple[list[int], RequestMetrics]:
    """Generate up to ``max_new`` tokens after ``ids`` with ``llm`` (``Llama.generate``; its
    draft model, if any, drafts) and return them with the request's metrics.  ``stop_ids``:
    tokens that end it (default: the model's EOS), not counted.  A request with an
    ``NgramdDraftModel`` counts its steps (one eval each after the prefill), the draft tokens
    returned and the time spent in the hook; tokens beyond one an eval are the accepted ones."""
    draft = llm.draft_model
    counters = getattr(draft, "counters", None)
    before = counters() if counters else None
    if seed is not None:
        llm.set_seed(seed)
    stop = set(stop_ids) if stop_ids is not None else {llm.token_eos()}
    m = RequestMetrics(mode="spec" if draft is not None else "plain", prompt_tokens=len(ids),
                       finish_reason="length")
    out: list[int] = []
    t0 = time.perf_counter()
    first = last = t0
    for tok in llm.generate(ids, temp=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                            typical_p=1.0, repeat_penalty=1.0, reset=True):
        now = time.perf_counter()
        if not out:
            first = now
        if tok in stop:
            m.finish_reason = "stop"
            break
        out.append(int(tok))
        last = now
        if len(out) >= max_new:
            break
    m.total_s = time.perf_counter() - t0
    m.ttft_s, m.decode_s, m.new_tokens = first - t0, last - first, len(out)
    if before is not None:
        calls, returned, seconds = (a - b for a, b in zip(counters(), before))
        m.verify_forwards, m.drafted, m.draft_s = calls, returned, seconds
        m.accepted = max(m.decode_tokens - calls, 0)
    else:
        m.verify_forwards = m.decode_tokens
    return out, m
