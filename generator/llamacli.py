"""``ngram-generate --engine llamacpp``: the same prompts through llama.cpp (llama-cpp-python),
drafting from ngramd with :class:`~.llamacpp.NgramdDraftModel`; ``--compare`` runs plain
llama.cpp (a ``Llama`` without a draft model) on each prompt back to back with it.

Also what ``bench/bench_llamacpp.py`` runs requests with: :class:`LlamaTokenizer` (a loaded
``Llama``'s tokenizer and chat template, in the shape the CLI and the benches use a
transformers tokenizer) and :func:`run_request` (one request, timed, with its metrics).
"""

from __future__ import annotations

import logging
import math
import sys
import time
from pathlib import Path

from .metrics import RequestMetrics

log = logging.getLogger("ngram_generator")

#: llama.cpp's context is rounded up to this many tokens
CTX_ROUND = 256
#: room for a draft past the last new token: llama-cpp-python 0.3.36 evaluates a draft that
#: reaches the context's end and then fails to store its logits (ValueError in ``Llama.eval``)
DRAFT_ROOM = 64


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
    """llama.cpp's context for prompts of ``lengths`` tokens and ``max_new`` new tokens and a
    draft after them (``DRAFT_ROOM``), rounded up to ``CTX_ROUND``, at most ``limit`` (the
    model's trained context)."""
    need = max(lengths, default=0) + max_new + 1 + DRAFT_ROOM
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


def run(args, prompts: list, endpoint: str | None, answering: bool) -> int:
    """``ngram-generate --engine llamacpp`` (``cli.main`` has checked the arguments, the
    endpoint and the model path)."""
    from . import cli
    from .model import resolve_checkpoint

    directory, gguf = resolve_checkpoint(args.model, args.gguf_file)
    if not gguf:
        print(f"error: --engine llamacpp runs a GGUF file; {directory} is a checkpoint "
              f"directory (name the .gguf file with --model or --gguf-file)", file=sys.stderr)
        return 2
    path = Path(directory) / gguf
    try:
        from llama_cpp import Llama

        from .llamacpp import NgramdDraftModel
    except ImportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from ngramd.wire.identity import tokenizer_fingerprint

    if answering and (why := cli._table_refuses(endpoint, tokenizer_fingerprint(path), args)):
        print(why, file=sys.stderr)
        return 3
    vocab = Llama(model_path=str(path), vocab_only=True, verbose=False)
    tok = LlamaTokenizer(vocab)
    requests = [(p, cli.encode(tok, p, chat=not args.no_chat_template, system=args.system))
                for p in prompts]
    n_ctx = context_size([len(ids) for _, ids in requests], args.max_new_tokens,
                         trained_context(vocab))
    if any(len(ids) + 1 >= n_ctx for _, ids in requests):
        print(f"error: a prompt does not fit the model's context ({n_ctx} tokens)",
              file=sys.stderr)
        return 2
    draft = None
    if not args.no_spec:
        draft = NgramdDraftModel(path, endpoint or "none", max_draft=args.max_draft,
                                 full_drafts=args.full_drafts, learn_prompts=args.ingest_prompt,
                                 timeout_ms=args.daemon_timeout_ms)
    try:
        return _generate(args, path, tok, requests, n_ctx, draft)
    finally:
        if draft is not None:
            draft.close()


def _generate(args, path: Path, tok: LlamaTokenizer, requests: list, n_ctx: int,
              draft) -> int:
    """Every request (``--compare``: plain and speculative back to back, the order alternating
    by prompt), then the report; 1 if a greedy output differed."""
    from . import cli

    modes = ["plain", "spec"] if args.compare else ["plain"] if args.no_spec else ["spec"]
    fa = args.flash_attn == "on"
    engines = {m: load_llama(path, n_ctx=n_ctx, threads=args.threads, flash_attn=fa,
                             draft_model=draft if m == "spec" else None) for m in modes}
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    for llm in engines.values():  # llama.cpp's first eval sets up its buffers: never timed
        run_request(llm, requests[0][1][:8], 4)
    if draft is not None:
        draft.finish()
    show = not args.quiet and (args.show or len(requests) == 1)
    results: dict[str, list] = {m: [] for m in modes}
    rows = []
    for i, (prompt, ids) in enumerate(requests):
        seed = None if args.seed is None else args.seed + i
        gens = {}
        for mode in (modes if i % 2 == 0 else modes[::-1]):
            out, m = run_request(engines[mode], ids, args.max_new_tokens, seed=seed, **sampling)
            if mode == "spec":
                draft.finish()  # fed back now, not after idle_s
            gens[mode] = _Gen(out, tok.decode(out), m)
            if show:
                print(f"--- [{i}] {mode}: {cli._label(prompt)}\n{gens[mode].text}\n", flush=True)
        for mode in modes:
            results[mode].append(gens[mode].metrics)
        rows.append(cli._row(i, prompt, gens, args.temperature == 0))
    greedy = args.temperature == 0
    report = cli._report(rows, results, args.compare, greedy)
    if report.rsplit("\n", 1)[-1].startswith("per order"):  # the hook sends those itself
        report = report.rsplit("\n", 1)[0]
    print(report)
    print(f"llama.cpp: {path.name}, flash_attn {args.flash_attn}, {n_ctx}-token context")
    if draft is not None:
        if not args.full_drafts:
            print(draft.summary())
        print(f"draft-length policy: {draft.took_up}"
              + ("; what it learned is kept in the table for the next run"
                 if draft.link.available and draft.keep_policy else ""))
    if args.compare and greedy and any(r[-1] != "yes" for r in rows):
        print("error: a greedy output differed between plain and speculative decoding "
              "(speculation must be lossless: please report it)", file=sys.stderr)
        return 1
    return 0


class _Gen:
    """One request's result, in the shape ``cli._row`` reads."""

    def __init__(self, tokens: list[int], text: str, metrics: RequestMetrics):
        self.tokens, self.text, self.metrics = tokens, text, metrics
