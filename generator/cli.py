"""``ngram-generate``: run prompts through the speculative generator (or the plain baseline).

Examples::

    ngram-generate "Write a Python function that reverses a list."
    ngram-generate --prompts prompts.jsonl --out results.jsonl --daemon ipc:///run/ngramd/qwen3.sock
    ngram-generate --model ~/models/Qwen3-4B --compare --prompts code.txt

Prompts come from arguments, a text file (one prompt per non-empty line) or JSONL (a string, or
an object with ``prompt``/``text`` or chat ``messages`` per line).  Results go to stdout, the
per-request metrics to ``--out`` (JSONL), logs and the progress bar to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path

from .drafting import DraftConfig, DraftLengthPolicy, VerifyCost
from .metrics import RequestMetrics, format_table, summarize
from .model import ModelLoadError, default_threads, load_model
from .remote import DaemonLink
from .sampling import SamplingParams
from .spec import Generation, Generator

log = logging.getLogger("ngram_generator")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ngram-generate",
        description="Speculative decoding with n-gram drafts (request-local table, ngramd hot "
                    "tier and daemon). Without --model, runs the embedded SmolLM2-135M-Instruct.")
    p.add_argument("prompt", nargs="*", help="prompt text (several allowed)")
    p.add_argument("--prompts", metavar="FILE", help="a .txt (one prompt a line) or .jsonl file")
    g = p.add_argument_group("model")
    g.add_argument("--model", metavar="PATH",
                   help="checkpoint directory or .gguf file (default: embedded SmolLM2-135M)")
    g.add_argument("--gguf-file", metavar="NAME", help="GGUF file inside --model DIR")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (default: auto)")
    g.add_argument("--dtype", default="auto", help="auto, fp32, bf16, fp16 (default: bf16 on "
                   "CUDA, fp32 on CPU)")
    g.add_argument("--attn", default="auto",
                   help="auto, flash_attention_2, sdpa, eager (default: flash_attention_2 when "
                        "available on CUDA, else sdpa)")
    g.add_argument("--threads", type=int, metavar="N",
                   help="torch CPU threads (default: 1 beside a daemon, else all cores)")
    g = p.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=int, default=128, metavar="N")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, help="seed for sampling (request i uses seed + i)")
    g.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop string (repeatable)")
    g.add_argument("--system", metavar="TEXT", help="system message for the chat template")
    g.add_argument("--no-chat-template", action="store_true",
                   help="feed prompts raw even when the tokenizer has a chat template")
    g = p.add_argument_group("speculation")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--no-spec", action="store_true", help="plain decoding (the baseline)")
    mode.add_argument("--compare", action="store_true",
                      help="run plain and speculative on each prompt; print the speed-up")
    g.add_argument("--daemon", metavar="ENDPOINT",
                   help="ngramd endpoint, e.g. ipc:///run/ngramd/qwen3.sock (default: none, "
                        "local drafts only)")
    g.add_argument("--daemon-timeout-ms", type=int, default=1000)
    g.add_argument("--remote-budget-ms", type=float, default=DraftConfig.remote_budget_ms,
                   help="the daemon's time for cold reads per (asynchronous) ask "
                        "(default: %(default)s)")
    g.add_argument("--remote-wait-ms", type=float, default=DraftConfig.remote_wait_ms,
                   help="wait this long for the daemon when nothing drafts in-process "
                        "(default: %(default)s: never wait, use its answer at the next step)")
    g.add_argument("--ingest-prompt", action=argparse.BooleanOptionalAction, default=None,
                   help="feed prompts to the daemon's table too, not only outputs (default: as "
                        "the table says, [table] learn_prompts)")
    # orders, stop rules and the draft limit belong to the table (its info()); these flags are
    # explicit local overrides, logged once (max-draft is clamped to the daemon's limit)
    g.add_argument("--n-min", type=int, help=f"override the table's lowest order "
                   f"(default: the daemon's; {DraftConfig.n_min} without one)")
    g.add_argument("--n-max", type=int, help=f"override the table's highest order "
                   f"(default: the daemon's; {DraftConfig.n_max} without one)")
    g.add_argument("--max-draft", type=int, metavar="TOKENS",
                   help=f"override the draft limit, at most the daemon's max_draft_len "
                        f"(default: that limit; {DraftConfig.max_draft} without a daemon)")
    g.add_argument("--p-cum", type=float, help="override the table's p_cum stop rule")
    g.add_argument("--fixed-draft", action="store_true",
                   help="verify every draft in full (no adaptive length)")
    g = p.add_argument_group("output")
    g.add_argument("--out", metavar="FILE", help="write one JSON record per request (JSONL)")
    g.add_argument("--show", action="store_true", help="print every completion (default: only "
                   "with a single prompt)")
    g.add_argument("--quiet", action="store_true", help="no completions, only the summary")
    g.add_argument("--log-level", default="INFO")
    return p


def read_prompts(args) -> list[str | list[dict]]:
    """Prompts as text, or as chat message lists (from JSONL ``messages``)."""
    prompts: list[str | list[dict]] = list(args.prompt)
    if args.prompts:
        path = Path(args.prompts)
        try:
            raw = path.read_text(encoding="utf-8")
        except OSError as e:
            raise SystemExit(f"error: cannot read prompts from {path}: {e.strerror}") from None
        if path.suffix == ".jsonl":
            for i, line in enumerate(raw.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SystemExit(f"error: {path}:{i}: not JSON ({e.msg})") from None
                if isinstance(rec, dict):
                    rec = rec.get("messages") or rec.get("prompt") or rec.get("text")
                if not isinstance(rec, (str, list)) or not rec:
                    raise SystemExit(f"error: {path}:{i}: expected a string or an object with "
                                     f"'prompt', 'text' or 'messages'") from None
                prompts.append(rec)
        else:
            prompts.extend(line for line in raw.splitlines() if line.strip())
    return prompts


def encode(tokenizer, prompt: str | list[dict], *, chat: bool, system: str | None) -> list[int]:
    """Token ids of a prompt, through the chat template when there is one and ``chat``."""
    if chat and getattr(tokenizer, "chat_template", None):
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if system and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": system}] + messages
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))
    if isinstance(prompt, list):
        prompt = "\n".join(str(m.get("content", "")) for m in prompt)
    return list(tokenizer.encode(prompt))


def _label(prompt: str | list[dict], width: int = 40) -> str:
    text = prompt if isinstance(prompt, str) else str(prompt[-1].get("content", ""))
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 1] + "…"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prompts = read_prompts(args)
    if not prompts:
        print("error: no prompts (give them as arguments or with --prompts FILE)",
              file=sys.stderr)
        return 2
    try:
        sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
        overrides = {"n_min": args.n_min, "n_max": args.n_max, "max_draft": args.max_draft,
                     "p_cum": args.p_cum}
        draft_config = DraftConfig(remote_budget_ms=args.remote_budget_ms,
                                   remote_wait_ms=args.remote_wait_ms)
        DraftConfig(**{k: v for k, v in overrides.items() if v is not None})  # bad values: exit 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    threads = args.threads if args.threads is not None else default_threads(bool(args.daemon))
    try:
        lm = load_model(args.model, gguf_file=args.gguf_file, device=args.device,
                        dtype=args.dtype, attn=args.attn, threads=threads)
    except (ModelLoadError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    link = DaemonLink(args.daemon, timeout_ms=args.daemon_timeout_ms,
                      tokenizer_fingerprint=_fingerprint(lm) if args.daemon else None)
    policy = None if args.fixed_draft else DraftLengthPolicy(VerifyCost())
    try:
        gen = Generator(lm, policy=policy, link=link, draft_config=draft_config,
                        ingest_prompt=args.ingest_prompt, overrides=overrides)
    except ValueError as e:  # an override that does not fit the table's settings
        print(f"error: {e}", file=sys.stderr)
        link.close()
        return 2
    gen.calibrate()  # warm-up (never timed) and the verify cost the policy needs

    modes = ["plain", "spec"] if args.compare else ["plain"] if args.no_spec else ["spec"]
    show = not args.quiet and (args.show or len(prompts) == 1)
    results: dict[str, list[RequestMetrics]] = {m: [] for m in modes}
    rows = []
    out_file = open(args.out, "w", encoding="utf-8") if args.out else None
    try:
        bar = _progress(len(prompts) * len(modes))
        for i, prompt in enumerate(prompts):
            ids = encode(lm.tokenizer, prompt, chat=not args.no_chat_template, system=args.system)
            seed = None if args.seed is None else args.seed + i
            sp = SamplingParams(sampling.temperature, sampling.top_p, sampling.top_k, seed)
            gens: dict[str, Generation] = {}
            for mode in modes:
                g = gen.generate(ids, max_new_tokens=args.max_new_tokens, sampling=sp,
                                 stop=args.stop, speculative=mode == "spec")
                gens[mode] = g
                results[mode].append(g.metrics)
                if out_file is not None:
                    rec = {"index": i, "prompt": prompt, "text": g.text, **g.metrics.to_dict()}
                    out_file.write(json.dumps(rec, ensure_ascii=False) + "\n")
                    out_file.flush()
                if bar is not None:
                    bar.update(1)
                if show:
                    print(f"--- [{i}] {mode}: {_label(prompt)}\n{g.text}\n", flush=True)
            rows.append(_row(i, prompt, gens, sampling.greedy))
        if bar is not None:
            bar.close()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if out_file is not None:
            out_file.close()
        link.flush()  # the last request's ingest and report, before the process exits
        link.close()
    print(_report(rows, results, args.compare, sampling.greedy))
    return 0


def _fingerprint(lm) -> str | None:
    """The fingerprint of the model's tokenizer, for the daemon's identity check: computed
    from the loaded tokenizer the same way for a checkpoint directory and a GGUF file (whose
    tokenizer is inside it), so it matches the table iff vocab, merges and special tokens do.
    None (logged) only for a tokenizer without a fast backend: then nothing is checked."""
    from ngramd.identity import hf_tokenizer_fingerprint

    try:
        return hf_tokenizer_fingerprint(lm.tokenizer)
    except Exception as e:  # a slow tokenizer, or a backend that does not serialise
        log.warning("cannot fingerprint the model's tokenizer (%s): the daemon cannot check "
                    "that this model's ids match its table", e)
        return None


def _progress(total: int):
    if total < 3 or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="req", file=sys.stderr)


def _row(i: int, prompt, gens: dict[str, Generation], greedy: bool) -> list:
    if "plain" in gens and "spec" in gens:
        p, s = gens["plain"].metrics, gens["spec"].metrics
        speedup = s.decode_tok_s / p.decode_tok_s if p.decode_tok_s else 0.0
        same = ("yes" if gens["plain"].tokens == gens["spec"].tokens else "NO") if greedy else "-"
        return [i, _label(prompt, 28), s.new_tokens, f"{p.decode_tok_s:.1f}",
                f"{s.decode_tok_s:.1f}", f"{speedup:.2f}x", f"{s.mean_accepted_length:.2f}", same]
    m = next(iter(gens.values())).metrics
    return [i, _label(prompt, 28), m.new_tokens, f"{m.ttft_s * 1e3:.0f}", f"{m.decode_tok_s:.1f}",
            m.verify_forwards, f"{m.mean_accepted_length:.2f}", f"{m.acceptance_rate:.2f}",
            f"{100 * m.draft_share:.1f}%"]


def _report(rows, results: dict[str, list[RequestMetrics]], compare: bool, greedy: bool) -> str:
    if compare:
        header = ["#", "prompt", "tokens", "plain tok/s", "spec tok/s", "speed-up", "AL",
                  "identical"]
        plain, spec = summarize(results["plain"]), summarize(results["spec"])
        ratios = [s.decode_tok_s / p.decode_tok_s
                  for p, s in zip(results["plain"], results["spec"]) if p.decode_tok_s]
        lines = [format_table(rows, header), "",
                 f"overall: plain {plain['decode_tok_s']:.1f} tok/s, speculative "
                 f"{spec['decode_tok_s']:.1f} tok/s, speed-up "
                 f"{spec['decode_tok_s'] / max(plain['decode_tok_s'], 1e-9):.2f}x "
                 f"(median per prompt {statistics.median(ratios) if ratios else 0:.2f}x); "
                 f"AL {spec['al']:.2f}, acceptance {spec['acceptance_rate']:.2f}"]
        if greedy:
            same = sum(r[-1] == "yes" for r in rows)
            lines.append(f"greedy outputs identical: {same}/{len(rows)}")
        lines.append(_orders(spec))
        return "\n".join(lines)
    mode = next(iter(results))
    s = summarize(results[mode])
    header = ["#", "prompt", "tokens", "TTFT ms", "tok/s", "forwards", "AL", "accept",
              "drafting"]
    lines = [format_table(rows, header), "",
             f"{mode}: {s['requests']} requests, {s['new_tokens']} tokens, "
             f"{s['decode_tok_s']:.1f} tok/s (median {s['median_decode_tok_s']:.1f}), "
             f"median TTFT {s['median_ttft_s'] * 1e3:.0f} ms, AL {s['al']:.2f}, "
             f"acceptance {s['acceptance_rate']:.2f}, drafting {100 * s['draft_share']:.1f}% "
             f"of the time"]
    if mode == "spec":
        lines.append(_orders(s))
    return "\n".join(lines)


def _orders(s: dict) -> str:
    per = s.get("per_order") or {}
    if not per:
        return "per order: no drafts"
    return "per order (accepted/drafted): " + ", ".join(
        f"{o}: {v['accepted']}/{v['drafted']}" for o, v in per.items())


if __name__ == "__main__":
    sys.exit(main())
