"""ngramd as llama.cpp's draft source, through llama-cpp-python's draft-model hook.

    from llama_cpp import Llama
    from ngram_generator.llamacpp import NgramdDraftModel

    llm = Llama(model_path="model.gguf", n_ctx=4096,
                draft_model=NgramdDraftModel("model.gguf", endpoint="ipc:///run/ngramd/x.sock"))

**How llama-cpp-python uses a draft model** (0.3.36, ``Llama.generate``): after each eval and
the sampling of its positions it calls the draft model with every token so far (prompt, output
and the token just sampled, ``np.intc``), and evaluates that token and the returned draft in one
eval, every position's logits kept (``Llama`` sets ``logits_all`` when it has a draft model).
It then samples position by position and goes on while the token sampled equals the draft token
placed after it; the first that differs is emitted and ends the step.  That is speculative
sampling with a one-hot draft (a draft token is accepted with probability p(token); a rejected
position emits a sample of p): lossless for sampling as for greedy decoding.  Each emitted token
takes one draw of the sampler, as in plain decoding, so a seeded run emits the same tokens with
or without drafts, up to the floating point of evaluating several tokens in one batch.

**What a call does** is what the vLLM proposer does for a batch, here at batch 1, through the
same :class:`~.batch.BatchDrafter`: the request is recognised by its tokens
(:class:`~.tracker.RequestTracker`: the hook gets no request id), drafted from its own
request-local table, then the hot and recent tiers read in-process from shared memory, the
daemon asked asynchronously when that draft is short; the draft-length policy
(:mod:`.policy`) decides how many of the draft's tokens to return (none: a plain step).

**The step cost the policy learns** is the time from one call's return to the next call: one
eval of the 1 + k tokens (k: the draft returned) on llama.cpp's own kernels, the copy of their
logits, and the sampling of the positions it emitted.  That is what a step costs a llama.cpp
user, measured without a handle on the ``Llama`` (the hook is the one object a user passes); a
wrapped ``eval`` would leave the logits copy and the sampling out.  A call whose history grew by
more than 1 + k tokens is not a step (another request, or the next turn of a chat whose prompt
holds this one): it is not timed.

**A request ends** when another starts (a history that does not continue the last call's), when
no call came for ``idle_s`` (a timer thread), at :meth:`NgramdDraftModel.finish` and at
:meth:`~NgramdDraftModel.close` (at exit too).  It is then fed back to the table once, with the
per-order counts and keys the other generators send; a request that continues a finished one
(a chat's next turn, or a request that was only slow) feeds back only what follows it.

**Identity**: the table must record the GGUF's tokenizer (``ngramd --tokenizer model.gguf``);
one of another tokenizer is refused with the warning the other generators give, and drafting
goes on from each request alone.  What the policy learned is kept in the table (``policy_key``)
and taken up by the next draft model that starts.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from pathlib import Path

import numpy as np

from .batch import BatchDrafter, BatchSettings
from .drafting import DraftConfig, settings_from_table
from .policy import RunClock, StepCost, state_key, summary, take_up
from .remote import DaemonLink

try:
    from llama_cpp.llama_speculative import LlamaDraftModel
except ImportError as e:  # the [llamacpp] extra is not installed
    raise ImportError(f"ngram_generator.llamacpp needs llama-cpp-python ({e}): pip install "
                      f"'flash-nest[llamacpp]' (make llamacpp builds its wheel once)") from e

log = logging.getLogger(__name__)

#: ``endpoint=NO_DAEMON``: draft from each request alone, whatever $NGRAMD_ENDPOINT says
NO_DAEMON = "none"
#: The step-cost prior on llama.cpp's CPU backend: ``f(T) = 1 + slope (T - 1)``.  An eval of T
#: tokens costs nearly T single-token evals there (the 1-token path is a matrix-vector product,
#: a batch's is not: bench/RESULTS.md, "llama.cpp drafting from the table"), far above the
#: torch CPU prior's 0.12; the fit corrects either from the steps it times.
CPU_SLOPE = 0.45


def gguf_vocab_size(path: str | Path) -> int:
    """Tokens in a GGUF file's vocabulary (its metadata; no tensor is read).  ``BadInput`` (a
    ``ValueError``) for a file that is no GGUF or holds no tokenizer."""
    from ngramd.wire.errors import BadInput
    from ngramd.wire.gguf import read_metadata

    n = read_metadata(path).get("tokenizer.ggml.tokens")
    if not isinstance(n, int) or n < 1:
        raise BadInput(f"{path}: the GGUF file holds no tokenizer (tokenizer.ggml.tokens)")
    return n


def resolve_endpoint(endpoint: str | None) -> str | None:
    """``endpoint``; None: ``$NGRAMD_ENDPOINT``, else the default table's socket (as
    ``ngram-generate`` without ``--daemon``); ``"none"``: no daemon."""
    import os

    if endpoint == NO_DAEMON:
        return None
    if endpoint:
        return endpoint
    if os.environ.get("NGRAMD_ENDPOINT"):
        return os.environ["NGRAMD_ENDPOINT"]
    from ngramd.wire.protocol import default_endpoint

    return default_endpoint()


class NgramdDraftModel(LlamaDraftModel):
    """llama-cpp-python's draft model, drafting from ngramd (module doc).

    ``model_path``: the GGUF the ``Llama`` runs (its tokenizer proves the table's identity, its
    vocabulary bounds the ids).  ``endpoint``: the daemon (None: ``$NGRAMD_ENDPOINT``, else the
    default; ``"none"``: each request alone).  ``max_draft``: the longest draft (default: the
    table's ``max_draft_len``).  ``full_drafts``: return every draft in full (no policy).
    ``keep_policy``/``policy_key``: take up and keep what the policy learned in the table
    (default key ``llama.cpp-<device>:<file name>``).  ``device``: where the ``Llama`` runs its
    layers, ``cpu`` or ``cuda`` (the step-cost prior: a GPU verifies a few more tokens nearly
    free).  ``idle_s``: a request with no call for this long is finished.
    ``link``/``step_clock``: injected by tests."""

    def __init__(self, model_path: str | Path, endpoint: str | None = None, *,
                 max_draft: int | None = None, full_drafts: bool = False,
                 keep_policy: bool = True, policy_key: str | None = None,
                 learn_prompts: bool | None = None, device: str = "cpu", idle_s: float = 2.0,
                 timeout_ms: int = 1000, link: DaemonLink | None = None, step_clock=None):
        path = Path(model_path)
        vocab = gguf_vocab_size(path)
        if link is None:
            from ngramd.wire.identity import tokenizer_fingerprint

            link = DaemonLink(resolve_endpoint(endpoint), timeout_ms=timeout_ms,
                              tokenizer_fingerprint=tokenizer_fingerprint(path))
        self.link = link
        link.connect()
        config = settings_from_table(link.info if link.available else {}, DraftConfig(),
                                     {"max_draft_len": max_draft})
        self.max_draft = config.rules.max_draft_len
        self.drafter = BatchDrafter(config, link, vocab_size=vocab,
                                    settings=BatchSettings(park_s=0.0, full_drafts=full_drafts),
                                    learn_prompts=learn_prompts,
                                    cost=StepCost(slope=CPU_SLOPE) if device == "cpu"
                                    else StepCost.for_device(device),
                                    step_clock=step_clock or RunClock())
        self.keep_policy = keep_policy and not full_drafts
        self.policy_key = policy_key or state_key(f"llama.cpp-{device}", path.name)
        self.idle_s = float(idle_s)
        self.calls = self.returned = 0  # counters: hook calls, draft tokens returned
        self.call_s = 0.0  # counter: seconds spent in the hook
        self._n = 0  # tokens of the last call's history (0: no request running)
        self._k = 0  # draft tokens it returned
        self._last_call = time.monotonic()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.took_up = (take_up(self.drafter.policy, link, self.policy_key)
                        if self.keep_policy else "the draft-length policy is not kept")
        log.info("ngramd draft model for %s: %s; up to %d tokens a draft; %s", path.name,
                 _link_line(link), self.max_draft, self.took_up)
        self._timer = threading.Thread(target=self._watch_idle, daemon=True,
                                       name="ngramd-draft-idle")
        self._timer.start()
        atexit.register(_close_at_exit, weakref.ref(self))

    # -- the hook ------------------------------------------------------------------------------
    def __call__(self, input_ids: np.ndarray, /, **kwargs) -> np.ndarray:
        """The draft after ``input_ids`` (every token so far), as ``np.intc`` (module doc)."""
        t0 = time.perf_counter()
        n = int(input_ids.shape[0])
        with self._lock:
            prev = self._n
            step = 0 < prev < n <= prev + 1 + self._k  # the next step of the last call's request
            if prev and not step:  # another request, or more than a step: the last one ends
                self.drafter.idle()  # (park_s 0: fed back now; a continuation feeds the rest)
            sampled = input_ids[prev:] if step else input_ids[n - 1:]
            draft = self.drafter.step([sampled], [n], [input_ids], self.max_draft)[0]
            self._n, self._k = n, len(draft)
            self._last_call = time.monotonic()
            self.calls += 1
            self.returned += len(draft)
            self.call_s += time.perf_counter() - t0
        return np.array(draft, np.intc)

    # -- the end of a request ------------------------------------------------------------------
    def finish(self) -> None:
        """Feed back the request running now (its end is not told to the hook: the timer does
        it after ``idle_s``), and keep the policy's state in the table."""
        with self._lock:
            self._finish()

    def _finish(self) -> None:
        if self.drafter.active:
            self.drafter.idle()
        self._n = self._k = 0
        if self.keep_policy and self.link.available:
            self.link.save_policy(self.policy_key, self.drafter.policy.state())

    def _watch_idle(self) -> None:
        while not self._closed.wait(max(self.idle_s / 2, 0.05)):
            with self._lock:
                if self._n and time.monotonic() - self._last_call >= self.idle_s:
                    self._finish()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until what was fed back is acknowledged by the daemon (True) or ``timeout_s``."""
        return self.link.flush(timeout_s)

    def close(self) -> None:
        """Feed back what runs, keep the policy, wait a little for the daemon, and close."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            self._finish()
        self.link.flush(5.0)
        self.link.close()

    # -- figures ---------------------------------------------------------------------------------
    def counters(self) -> tuple[int, int, float]:
        """``(calls, draft tokens returned, seconds in the hook)`` so far."""
        return self.calls, self.returned, self.call_s

    def stats(self) -> dict:
        """What the draft model did (``BatchDrafter.report``: drafts and acceptance per tier,
        requests, the policy), its calls and the link's counters."""
        with self._lock:
            return {"draft_model": {**self.drafter.report(), "calls": self.calls,
                                    "call_s": self.call_s},
                    "link": self.link.stats()}

    def summary(self) -> str:
        """The policy's figures in a few lines (``policy.summary``)."""
        with self._lock:
            return summary(self.drafter.policy.report())


def _link_line(link: DaemonLink) -> str:
    if link.state == "up":
        return f"ngramd at {link.endpoint} (tokenizer matches the table's)"
    if link.state == "off":
        return "no daemon: drafting from each request alone"
    return f"ngramd at {link.endpoint} {link.state} ({link.stats().get('why')})"


def _close_at_exit(ref: weakref.ref) -> None:
    """``atexit``'s: the draft model's ``close`` (the request running is fed back), if it is
    still alive; a failure is said, never raised."""
    model = ref()
    if model is not None:
        try:
            model.close()
        except Exception as e:
            log.warning("ngramd draft model: closing failed: %s", e)


__all__ = ["NgramdDraftModel", "gguf_vocab_size", "resolve_endpoint"]
