"""What llama.cpp's eval of T tokens costs against one token: the step-cost curve the draft-length
policy meets in llama.cpp (bench_llamacpp's "why"), on the embedded SmolLM2-135M GGUF.

For 1 and 2 threads, FlashAttention off and on, and ``logits_all`` off (plain llama.cpp) and on
(what a ``Llama`` with a draft model runs): after a 300-token prefix, the median of 15 evals of
T tokens (T = 1, 2, 3, 4, 6, 8, 12, 16), in ms.  JSON to the path given.

    .venv/bin/python bench/bench_llamacpp_eval.py bench/out/llamacpp-curve.json
"""

import json
import statistics
import sys
import time
from pathlib import Path

from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

from ngram_generator.model import resolve_checkpoint


def main() -> int:
    d, g = resolve_checkpoint(None, None)
    path = str(Path(d) / g)
    res = {}
    for th in (1, 2):
        for fa in (False, True):
            for la in (False, True):
                llm = Llama(model_path=path, n_ctx=1024, n_threads=th, n_threads_batch=th,
                            flash_attn=fa, verbose=False,
                            draft_model=LlamaPromptLookupDecoding() if la else None)
                llm.eval(list(range(1000, 1300)))
                row = {}
                for T in (1, 2, 3, 4, 6, 8, 12, 16):
                    if T > 1 and not la:
                        continue
                    ts = []
                    for _ in range(15):
                        llm.n_tokens = 300
                        t0 = time.perf_counter()
                        llm.eval(list(range(2000, 2000 + T)))
                        ts.append(time.perf_counter() - t0)
                    row[T] = round(statistics.median(ts) * 1e3, 3)
                res[f"threads{th} fa{int(fa)} logits_all{int(la)}"] = row
                print(th, fa, la, row, flush=True)
    Path(sys.argv[1]).parent.mkdir(parents=True, exist_ok=True)
    Path(sys.argv[1]).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
