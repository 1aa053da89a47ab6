"""``ngram-generate``: run prompts through the speculative generator (or the plain baseline).

Examples::

    ngram-generate "Write a Python function that reverses a list."
    ngram-generate --prompts prompts.jsonl --out results.jsonl --daemon ipc:///run/ngramd/qwen3.sock
    ngram-generate --model ~/models/Qwen3-4B --compare --prompts code.txt
    ngram-generate --engine llamacpp --compare --prompts code.txt   # llama.cpp, the embedded GGUF
    ngramd --tokenizer "$(ngram-generate --print-model)"   # a table for the embedded model

Prompts come from arguments, a text file (one prompt per non-empty line) or JSONL (a string, or
an object with ``prompt``/``text`` or chat ``messages`` per line).  Results go to stdout, the
per-request metrics to ``--out`` (JSONL), logs and the progress bar to stderr.

The daemon is ``--daemon``, else ``$NGRAMD_ENDPOINT``, else the default table's socket (as for
``ngram-client``; ``--daemon none``: local drafts only); one that does not answer is said at
once, naming the endpoint, and drafting is local until it does; a malformed endpoint or a
missing model exits 2 before torch loads, a table made for another tokenizer exits 3 with what
to do.  A prompt the model's context cannot hold exits 2 before anything runs; one
that leaves less room than ``--max-new-tokens`` generates fewer tokens, with a warning.
``--compare`` runs plain and speculative decoding on each prompt back to back (which goes first
alternates), so the speed-up is measured pair by pair under the same load; a greedy output that
differs between the two exits 1 (speculation must be lossless).

Only the standard library is imported before the arguments are parsed: ``--help`` and
``--print-model`` load no torch, transformers or numba (they took 5 s).

Exit codes: 0 ok, 1 a greedy output differed, 2 usage (bad option, endpoint, prompt or model),
3 the daemon's table was made for another tokenizer.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import os
import sys
from pathlib import Path

log = logging.getLogger("ngram_generator")

#: ``--daemon none``: no daemon even when $NGRAMD_ENDPOINT is set
NO_DAEMON = "none"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ngram-generate",
        description="Speculative decoding with n-gram drafts (request-local table, ngramd hot "
                    "tier and daemon). Without --model, runs the embedded SmolLM2-135M-Instruct.",
        epilog=__doc__[__doc__.index("Exit codes"):].strip())
    p.add_argument("prompt", nargs="*", help="prompt text (several allowed)")
    p.add_argument("--prompts", metavar="FILE", help="a .txt (one prompt a line) or .jsonl file")
    g = p.add_argument_group("model")
    _engine_args(g)
    g.add_argument("--model", metavar="PATH",
                   help="checkpoint directory or .gguf file (default: embedded SmolLM2-135M)")
    g.add_argument("--gguf-file", metavar="NAME", help="GGUF file inside --model DIR")
    g.add_argument("--print-model", action="store_true",
                   help="print the path of the model file (or directory) that would be loaded "
                        "and exit: what 'ngramd --tokenizer' takes to make a table for it")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (default: auto)")
    g.add_argument("--dtype", default="auto", help="auto, fp32, bf16, fp16 (default: bf16 on "
                   "CUDA, fp32 on CPU)")
    g.add_argument("--attn", default="auto",
                   help="auto, flash_attention_2, sdpa, eager (default: flash_attention_2 when "
                        "available on CUDA, else sdpa)")
    g.add_argument("--threads", type=int, metavar="N",
                   help="torch CPU threads (default: 1 beside a daemon, else all cores); "
                        "llama.cpp's threads with --engine llamacpp (default: its own)")
    g.add_argument("--no-model-cache", action="store_true",
                   help="read a GGUF model through transformers every time, not the converted "
                        "checkpoint kept in $NGRAM_MODEL_CACHE (default ~/.cache/flash-nest/"
                        "models; NGRAM_MODEL_CACHE=off turns it off too)")
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
    _speculation_args(p.add_argument_group("speculation"))
    g = p.add_argument_group("output")
    g.add_argument("--out", metavar="FILE", help="write one JSON record per request (JSONL)")
    g.add_argument("--show", action="store_true", help="print every completion (default: only "
                   "with a single prompt)")
    g.add_argument("--quiet", action="store_true", help="no completions, only the summary")
    g.add_argument("--log-level", default="INFO")
    return p


def _speculation_args(g) -> None:
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--no-spec", action="store_true", help="plain decoding (the baseline)")
    mode.add_argument("--compare", action="store_true",
                      help="run plain and speculative on each prompt; print the speed-up")
    g.add_argument("--daemon", metavar="ENDPOINT",
                   help="ngramd endpoint, e.g. ipc:///run/ngramd/qwen3.sock (default: "
                        "$NGRAMD_ENDPOINT, else the default table's socket, as for ngram-client; "
                        "'none': local drafts only)")
    g.add_argument("--daemon-timeout-ms", type=int, default=1000)
    g.add_argument("--remote-budget-ms", type=float,
                   help="the daemon's time for cold reads per (asynchronous) ask (default: "
                        "the generator's DraftConfig)")
    g.add_argument("--ask-backoff", type=int,
                   help="while the daemon's answers beat no in-process draft, at most every "
                        "Nth short draft asks it (default 64; 1: every one)")
    g.add_argument("--remote-wait-ms", type=float,
                   help="wait this long for the daemon when nothing drafts in-process "
                        "(default: never wait, use its answer at the next step)")
    g.add_argument("--ingest-prompt", action=argparse.BooleanOptionalAction, default=None,
                   help="feed prompts to the daemon's table too, not only outputs (default: as "
                        "the table says, [table] learn_prompts)")
    # orders, stop rules and the draft limit belong to the table (its info()); these flags are
    # explicit local overrides, logged once (max-draft is clamped to the daemon's limit)
    g.add_argument("--n-min", type=int, help="override the table's lowest order "
                   "(default: the daemon's; the generator's own without one)")
    g.add_argument("--n-max", type=int, help="override the table's highest order "
                   "(default: the daemon's; the generator's own without one)")
    g.add_argument("--max-draft", type=int, metavar="TOKENS",
                   help="override the draft limit, at most the daemon's max_draft_len "
                        "(default: that limit; the generator's own without a daemon)")
    g.add_argument("--p-cum", type=float, help="override the table's p_cum stop rule")
    g.add_argument("--full-drafts", "--fixed-draft", dest="full_drafts", action="store_true",
                   help="verify every draft in full (default: the tokens the measured step "
                        "cost and the learned acceptance pay for; ngram_generator.policy)")


def _engine_args(g) -> None:
    g.add_argument("--engine", choices=("transformers", "llamacpp"), default="transformers",
                   help="transformers (default), or llamacpp: llama.cpp through "
                        "llama-cpp-python (the [llamacpp] extra), a GGUF model, drafting "
                        "through its draft-model hook (ngram_generator.llamacpp)")
    g.add_argument("--flash-attn", choices=("on", "off"), default="off",
                   help="--engine llamacpp: llama.cpp's FlashAttention kernels (default: off, "
                        "llama-cpp-python's default)")


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


def resolve_daemon(flag: str | None) -> tuple[str | None, str]:
    """``(endpoint or None, where it came from)``: ``--daemon``, else ``$NGRAMD_ENDPOINT``,
    else none; ``--daemon none`` is none whatever the environment says."""
    if flag:
        return (None if flag == NO_DAEMON else flag), "--daemon"
    env = os.environ.get("NGRAMD_ENDPOINT")
    if env:
        return env, "$NGRAMD_ENDPOINT"
    from ngramd.wire.protocol import default_endpoint

    return default_endpoint(), DEFAULT_ORIGIN


#: where the endpoint came from when neither --daemon nor $NGRAMD_ENDPOINT named one
DEFAULT_ORIGIN = "the default; --daemon or $NGRAMD_ENDPOINT to choose"


def _early_checks(args) -> tuple[int, str | None, bool]:
    """What can be said before torch and transformers load (seconds): the endpoint (a typo
    exits 2), whether a daemon answers there (a refused socket is said once, naming the
    endpoint and where it came from: a default that no daemon serves is not "no daemon
    configured"), and the model path (a missing one exits 2 at once, not after 7 s of
    imports).  Returns ``(exit code or 0, endpoint, whether it may answer)``."""
    from ngram_client.client import check_endpoint
    from ngramd.wire.errors import NgramError
    from ngramd.wire.protocol import connect_refusal

    from .model import ModelLoadError, resolve_checkpoint

    endpoint, origin = resolve_daemon(args.daemon)
    answering = endpoint is not None
    if endpoint is not None:
        try:
            check_endpoint(endpoint)
        except NgramError as e:  # as ngram-client: a typo is a usage error, not a silent 1.0x
            print(f"error: {e} (from {origin})", file=sys.stderr)
            return 2, None, False
        why = connect_refusal(endpoint) if endpoint.startswith("ipc://") else None
        if why is not None:
            answering = False
            log.warning("the daemon at %s (%s) is not answering (%s): drafting from each "
                        "request's own context until it does; start ngramd there, or "
                        "--daemon none", endpoint, origin, why)
    try:
        resolve_checkpoint(args.model, args.gguf_file)
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2, None, False
    return 0, endpoint, answering


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.print_model:
        return _print_model(args)
    prompts = read_prompts(args)
    if not prompts:
        print("error: no prompts (give them as arguments or with --prompts FILE)",
              file=sys.stderr)
        return 2
    rc, endpoint, answering = _early_checks(args)
    if rc:
        return rc
    if args.engine == "llamacpp":
        return _run_llamacpp(args, prompts, endpoint, answering)
    # the heavy imports (torch, transformers, numba): only once the arguments are good
    from ngramd.wire.rules import DEFAULT_RULES

    from .drafting import DraftConfig
    from .model import ModelLoadError, default_threads, load_model
    from .sampling import SamplingParams

    try:
        sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
        overrides = {"n_min": args.n_min, "n_max": args.n_max,
                     "max_draft_len": args.max_draft, "p_cum": args.p_cum}
        draft_config = DraftConfig(**{k: v for k, v in (("remote_budget_ms",
                                                          args.remote_budget_ms),
                                                         ("remote_wait_ms", args.remote_wait_ms),
                                                         ("ask_backoff", args.ask_backoff))
                                      if v is not None})
        DEFAULT_RULES.updated(**overrides)  # bad values: exit 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    threads = args.threads if args.threads is not None else default_threads(answering)
    try:
        with _quiet_unless_tty():  # transformers' per-tensor progress bars, in a log file
            lm = load_model(args.model, gguf_file=args.gguf_file, device=args.device,
                            dtype=args.dtype, attn=args.attn, threads=threads,
                            model_cache=False if args.no_model_cache else None)
        requests = _requests(lm, prompts, args)
    except (ModelLoadError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    fingerprint = _fingerprint(lm) if endpoint else None
    if answering and (why := _table_refuses(endpoint, fingerprint, args)):
        print(why, file=sys.stderr)
        return 3
    return _run(lm, requests, args, endpoint, fingerprint, sampling, draft_config, overrides)


@contextlib.contextmanager
def _quiet_unless_tty():
    """Hide what libraries write to stderr while a model loads (the GGUF conversion's tqdm
    bars: hundreds of redraws in a log) when stderr is not a terminal; logging keeps its own
    handle on stderr, so log lines still show.  On a failure the hidden text is shown."""
    if sys.stderr.isatty():
        yield
        return
    hidden = io.StringIO()
    try:
        with contextlib.redirect_stderr(hidden):
            yield
    except BaseException:
        sys.stderr.write(hidden.getvalue()[-4000:])
        raise


def _print_model(args) -> int:
    """``--print-model``: the file (a .gguf) or directory that ``--model`` names, or the
    embedded default's; no model is loaded."""
    from .model import ModelLoadError, resolve_checkpoint

    try:
        directory, gguf = resolve_checkpoint(args.model, args.gguf_file)
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(Path(directory) / gguf if gguf else directory)
    return 0


def _requests(lm, prompts, args) -> list[tuple[str | list[dict], list[int], int]]:
    """``(prompt, ids, max new tokens)`` per prompt, every one checked against the model's
    context before anything runs (``LoadedModel.room``): ``ValueError`` naming the prompt when
    one cannot fit; a warning when one leaves less room than ``--max-new-tokens``."""
    out = []
    for i, prompt in enumerate(prompts):
        ids = encode(lm.tokenizer, prompt, chat=not args.no_chat_template, system=args.system)
        try:
            room = lm.room(len(ids), args.max_new_tokens)
        except ValueError as e:
            raise ValueError(f"prompt {i} ({_label(prompt)}): {e}") from None
        if room < args.max_new_tokens:
            log.warning("prompt %d has %d tokens: the model's context (%d) leaves room for %d "
                        "new tokens, not --max-new-tokens %d", i, len(ids), lm.max_context,
                        room, args.max_new_tokens)
        out.append((prompt, ids, room))
    return out


def _table_refuses(endpoint: str, fingerprint: str | None, args) -> str | None:
    """What to do when the daemon's table was made for another tokenizer than the model's
    (one message, then exit 3: drafting from a Qwen3 table with SmolLM2 ids can never work,
    so retrying it only runs at plain speed); None when it matches or when no
    daemon answers now (the generator then drafts locally and reconnects later)."""
    from ngram_client import NgramClient
    from ngramd.wire.errors import IdentityMismatch

    try:
        with NgramClient(endpoint, timeout_ms=args.daemon_timeout_ms, retries=0,
                         tokenizer_fingerprint=fingerprint):
            return None
    except IdentityMismatch as e:
        model = _model_path(args)
        return (f"error: the table at {endpoint} was made for another tokenizer than this "
                f"model's ({e}).\nMake a table for this model -- 'ngramd --name NAME "
                f"--tokenizer {model}' (any new name or data directory; a .gguf file, a model "
                f"directory or a tokenizer.json) -- and point --daemon at it; or run the "
                f"model the table was made for; or --daemon none to draft locally only.")
    except Exception as e:  # absent or slow: the link says so once and drafts locally
        log.debug("identity check at %s: %s", endpoint, e)
        return None


def _model_path(args) -> str:
    try:
        from .model import resolve_checkpoint

        directory, gguf = resolve_checkpoint(args.model, args.gguf_file)
        return str(Path(directory) / gguf) if gguf else directory
    except Exception:
        return args.model or "MODEL"


def _run(lm, requests, args, endpoint, fingerprint, sampling, draft_config, overrides) -> int:
    """Generate every request (``--compare``: plain and speculative back to back, the order
    alternating by prompt) and print the report; 1 if a greedy output differed."""
    from .policy import DraftLengthPolicy, StepCost, state_key, summary, take_up
    from .remote import DaemonLink
    from .sampling import SamplingParams
    from .spec import Generator

    link = DaemonLink(endpoint, timeout_ms=args.daemon_timeout_ms,
                      tokenizer_fingerprint=fingerprint)
    policy = None if args.full_drafts else DraftLengthPolicy(StepCost.for_device(lm.device.type))
    try:
        gen = Generator(lm, policy=policy, link=link, draft_config=draft_config,
                        ingest_prompt=args.ingest_prompt, overrides=overrides)
    except ValueError as e:  # an override that does not fit the table's settings
        print(f"error: {e}", file=sys.stderr)
        link.close()
        return 2
    key = state_key(lm.device.type, _model_path(args))
    # where the last run of this model on this kind of device stopped (printed with the report)
    took = take_up(policy, link, key) if policy is not None else None
    gen.calibrate()  # warm-up (never timed) and the verify cost the policy needs

    modes = ["plain", "spec"] if args.compare else ["plain"] if args.no_spec else ["spec"]
    show = not args.quiet and (args.show or len(requests) == 1)
    results: dict[str, list] = {m: [] for m in modes}
    rows = []
    out_file = open(args.out, "w", encoding="utf-8") if args.out else None
    try:
        bar = _progress(len(requests) * len(modes))
        for i, (prompt, ids, room) in enumerate(requests):
            seed = None if args.seed is None else args.seed + i
            sp = SamplingParams(sampling.temperature, sampling.top_p, sampling.top_k, seed)
            gens = {}
            # plain first on even prompts, speculative first on odd ones: a drift in the
            # machine's speed (other processes, clocks) falls on both modes alike; the plain
            # run feeds nothing back, so it cannot help the speculative one
            for mode in (modes if i % 2 == 0 else modes[::-1]):
                g = gen.generate(ids, max_new_tokens=room, sampling=sp, stop=args.stop,
                                 speculative=mode == "spec")
                gens[mode] = g
                if out_file is not None:
                    rec = {"index": i, "prompt": prompt, "text": g.text, **g.metrics.to_dict()}
                    out_file.write(json.dumps(rec, ensure_ascii=False) + "\n")
                    out_file.flush()
                if bar is not None:
                    bar.update(1)
                if show:
                    print(f"--- [{i}] {mode}: {_label(prompt)}\n{g.text}\n", flush=True)
            for mode in modes:
                results[mode].append(gens[mode].metrics)
            rows.append(_row(i, prompt, gens, sampling.greedy))
        if bar is not None:
            bar.close()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if out_file is not None:
            out_file.close()
        if policy is not None and link.available:  # for the next run (take_up)
            link.save_policy(key, policy.state())
        link.flush()  # the last request's ingest and report, before the process exits
        link.close()
    print(_report(rows, results, args.compare, sampling.greedy))
    if policy is not None and "spec" in modes:
        print(summary(policy.report()))
        print(f"draft-length policy: {took}"
              + ("; what it learned is kept in the table for the next run" if link.available
                 else ""))
    if args.compare and sampling.greedy and any(r[-1] != "yes" for r in rows):
        print("error: a greedy output differed between plain and speculative decoding "
              "(speculation must be lossless: please report it)", file=sys.stderr)
        return 1
    return 0


def _fingerprint(lm) -> str | None:
    """The fingerprint of the model's tokenizer, for the daemon's identity check: computed
    from the loaded tokenizer the same way for a checkpoint directory and a GGUF file (whose
    tokenizer is inside it), so it matches the table iff vocab, merges and special tokens do.
    None (logged) only for a tokenizer without a fast backend: then nothing is checked."""
    from ngramd.wire.identity import hf_tokenizer_fingerprint

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


def _row(i: int, prompt, gens: dict, greedy: bool) -> list:
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


def paired_speedup(plain: list, spec: list) -> dict:
    """The speed-up measured pair by pair: for each prompt, speculative over plain decode
    tokens/s of the two runs made back to back; ``geomean`` (the mean of ratios is a
    geometric one), ``lo``/``hi`` and ``pairs``.  Two totals taken apart would let a change
    in the machine's load between them pass for a speed-up (the host's load can swing plain
    decoding several-fold between two runs)."""
    ratios = [s.decode_tok_s / p.decode_tok_s for p, s in zip(plain, spec)
              if p.decode_tok_s > 0 and s.decode_tok_s > 0]
    if not ratios:
        return {"pairs": 0, "geomean": 0.0, "lo": 0.0, "hi": 0.0}
    return {"pairs": len(ratios), "lo": min(ratios), "hi": max(ratios),
            "geomean": math.exp(sum(map(math.log, ratios)) / len(ratios))}


def _report(rows, results: dict, compare: bool, greedy: bool) -> str:
    from .metrics import format_table, summarize

    if compare:
        header = ["#", "prompt", "tokens", "plain tok/s", "spec tok/s", "speed-up", "AL",
                  "identical"]
        plain, spec = summarize(results["plain"]), summarize(results["spec"])
        sp = paired_speedup(results["plain"], results["spec"])
        lines = [format_table(rows, header), "",
                 f"speed-up {sp['geomean']:.2f}x: geometric mean over {sp['pairs']} prompts of "
                 f"speculative / plain tokens/s, each pair run back to back (range "
                 f"{sp['lo']:.2f}x-{sp['hi']:.2f}x); AL {spec['al']:.2f}, acceptance "
                 f"{spec['acceptance_rate']:.2f} (overall plain {plain['decode_tok_s']:.1f}, "
                 f"speculative {spec['decode_tok_s']:.1f} tok/s)"]
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


def _run_llamacpp(args, prompts: list, endpoint: str | None, answering: bool) -> int:
    """``--engine llamacpp``: the prompts through llama.cpp (llama-cpp-python), drafting from
    ngramd with ``llamacpp.NgramdDraftModel``; ``--compare`` runs plain llama.cpp (a ``Llama``
    without a draft model) on each prompt back to back with it (``main`` has checked the
    arguments, the endpoint and the model path)."""
    from .llamacli import LlamaTokenizer, context_size, trained_context
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

    if answering and (why := _table_refuses(endpoint, tokenizer_fingerprint(path), args)):
        print(why, file=sys.stderr)
        return 3
    vocab = Llama(model_path=str(path), vocab_only=True, verbose=False)
    tok = LlamaTokenizer(vocab)
    requests = [(p, encode(tok, p, chat=not args.no_chat_template, system=args.system))
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
        return _generate_llamacpp(args, path, tok, requests, n_ctx, draft)
    finally:
        if draft is not None:
            draft.close()


def _generate_llamacpp(args, path: Path, tok, requests: list, n_ctx: int, draft) -> int:
    """Every request (``--compare``: plain and speculative back to back, the order alternating
    by prompt), then the report; 1 if a greedy output differed."""
    from .llamacli import load_llama, run_request

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
            gens[mode] = _LlamaGen(out, tok.decode(out), m)
            if show:
                print(f"--- [{i}] {mode}: {_label(prompt)}\n{gens[mode].text}\n", flush=True)
        for mode in modes:
            results[mode].append(gens[mode].metrics)
        rows.append(_row(i, prompt, gens, args.temperature == 0))
    greedy = args.temperature == 0
    report = _report(rows, results, args.compare, greedy)
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


class _LlamaGen:
    """One request's result, in the shape ``_row`` reads."""

    def __init__(self, tokens: list[int], text: str, metrics):
        self.tokens, self.text, self.metrics = tokens, text, metrics

if __name__ == "__main__":
    sys.exit(main())
