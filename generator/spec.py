"""The speculative loop (and plain decoding, which is the same loop with no drafts).

One request::

    prefill(prompt)                      one forward, logits of the last position only
    token = choose(logits)               argmax, or a sample of the processed distribution
    repeat until EOS / max_new_tokens / stop string:
        draft  = source.draft(...)       local table + hot tier (+ daemon on a miss)
        k      = policy.choose(draft)    0..len(draft), by expected tokens per second
                                         (the full draft is scored against what is emitted)
        logits = forward([token] + draft[:k])     one forward over k + 1 tokens, KV cache kept
        n, token = accept(draft[:k], logits)      greedy or speculative sampling (sampling.py)
        crop the cache to drop the k - n rejected positions; emit draft[:n] + [token]

``token`` (the last emitted one) is never in the cache: it enters with the next forward.  The
functions :func:`forward` and :func:`crop_cache` are the only places that touch the model and its
cache, so the cache bookkeeping can be tested on its own.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from .drafting import (EMPTY_DRAFT, Draft, DraftConfig, DraftSource, NgramDrafter,
                       settings_from_table)
from .metrics import RequestMetrics
from .model import LoadedModel, cache_keyword
from .policy import DraftLengthPolicy, RunClock, sampling_band, step_kind
from .remote import DaemonLink
from .sampling import SamplingParams, greedy_accept, processed_probs, sample, speculative_accept

log = logging.getLogger(__name__)


# -------------------------------------------------------------------------------------------
# the model and its cache
# -------------------------------------------------------------------------------------------
def new_cache(model):
    """An empty KV cache for ``model`` (transformers ``DynamicCache``)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def forward(model, tokens: torch.Tensor, cache, n_logits: int) -> torch.Tensor:
    """Run ``tokens`` ([1, T] int64) after what ``cache`` holds; returns logits ``[n_logits, V]``
    of the last ``n_logits`` positions.  The cache grows by T.

    ``logits_to_keep`` matters: full logits of an 800-token prefill are ~0.5 GB at Qwen3's
    vocabulary.  Positions come from the cache length (batch 1, no padding).
    """
    out = model(input_ids=tokens, use_cache=True, logits_to_keep=n_logits,
                **{cache_keyword(model): cache})
    return out.logits[0, -n_logits:]


def crop_cache(cache, keep: int) -> None:
    """Keep the first ``keep`` positions of ``cache``.

    transformers 5 ``Cache.crop(n)`` takes a *negative* n: the number of positions to remove
    (a positive n is rejected); 4.x read a negative n the same way.
    """
    extra = cache.get_seq_length() - keep
    if extra > 0:
        cache.crop(-extra)


# -------------------------------------------------------------------------------------------
# stop strings
# -------------------------------------------------------------------------------------------
class StopStrings:
    """Finds where a stop string completes in the decoded output.

    Decodes the output once per step; only when a stop string shows up in the new text does it
    look for the exact token that completed it.
    """

    def __init__(self, tokenizer, stops: Sequence[str]):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        if self.stops and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")

    def text(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def find(self, tokens: list[int], new_from: int) -> tuple[int, int] | None:
        """``(tokens to keep, characters of text to keep)`` if a stop string completed in
        ``tokens[new_from:]``, else None."""
        if not self.stops:
            return None
        start = max(len(self.text(tokens[:new_from])) - self.longest, 0)
        if self._first(self.text(tokens), start) is None:
            return None
        for end in range(new_from + 1, len(tokens) + 1):  # rare path: which token completed it
            cut = self._first(self.text(tokens[:end]), start)
            if cut is not None:
                return end, cut
        return None  # unreachable: the full text matched

    def _first(self, text: str, start: int) -> int | None:
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else None


# -------------------------------------------------------------------------------------------
# the generator
# -------------------------------------------------------------------------------------------
@dataclass
class Generation:
    """The result of one request: new token ids (EOS included when it ended the request)."""

    tokens: list[int]
    text: str
    finish_reason: str  # "eos", "length" or "stop"
    metrics: RequestMetrics
    prompt_tokens: list[int] = field(default_factory=list, repr=False)


class Generator:
    """Runs requests on one loaded model, drafting from ``source``.

    ``source`` defaults to an :class:`NgramDrafter` over ``link``; ``policy`` chooses how many
    draft tokens to verify (None: all of them, which is what tests that inject drafts want).
    After each speculative request ``link`` receives its output (and the prompt too when
    ``ingest_prompt``, which defaults to the table's ``learn_prompts``) and per-order counts,
    without waiting.

    Drafting settings two processes must agree on (``draft_config.rules``: orders, stop rules,
    ``max_draft_len``) come from the daemon's ``info()`` when ``link`` connects
    (``settings_from_table``): ``draft_config`` holds the values used without a daemon and the
    local-only ones; ``overrides`` are explicit
    local settings (CLI flags) that win, logged once.  They are fixed at construction.

    Plain requests (the baseline) send nothing, so a ``--compare`` baseline never warms the
    table for the speculative run after it.
    """

    def __init__(self, lm: LoadedModel, source: DraftSource | None = None, *,
                 policy: DraftLengthPolicy | None = None, link: DaemonLink | None = None,
                 draft_config: DraftConfig = DraftConfig(), ingest_prompt: bool | None = None,
                 overrides: dict | None = None):
        self.lm = lm
        self.model = lm.model
        self.device = lm.device
        self.link = link
        if link is not None and not link.available:
            link.connect()  # logs once when the daemon is absent; generation goes on locally
        info = link.info if link is not None and link.available else {}
        self.draft_config = settings_from_table(info, draft_config, overrides)
        self.source = source if source is not None else NgramDrafter(self.draft_config, link)
        self.policy = policy
        self.max_draft = self.draft_config.rules.max_draft_len
        self.ingest_prompt = ingest_prompt  # None: as the table says (link.learn_prompts)
        self.eos = lm.eos_token_ids
        self.vocab_size = lm.vocab_size
        self.step_clock = RunClock()  # verify steps timed without the host's contention

    # -- setup -----------------------------------------------------------------------------
    @torch.inference_mode()
    def calibrate(self, sizes: Sequence[int] | None = None, context: int = 64,
                  repeats: int = 5) -> dict[int, float]:
        """Warm the model up and measure a forward over n new tokens (seconds, median of
        ``repeats``) after a ``context``-token prefill; feeds the policy's cost model.

        ``sizes`` defaults to 1, 2, 3, 5, 9 and ``max_draft + 1`` tokens.  Sizes are measured
        round-robin, so a burst of load from other processes hits them alike.  One untimed
        round first: first forwards allocate and pick kernels.
        """
        sizes = list(sizes or sorted({1, 2, 3, 5, 9, self.max_draft + 1}))
        ids = torch.arange(context, device=self.device).remainder(self.vocab_size)[None]
        cache = new_cache(self.model)
        forward(self.model, ids, cache, 1)
        step = torch.arange(max(sizes), device=self.device).remainder(self.vocab_size)[None]
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for r in range(repeats + 1):
            for n in sizes:
                t = self.step_clock()
                forward(self.model, step[:, :n], cache, n)
                self._sync()
                if r:
                    times[n].append(self.step_clock() - t)
                crop_cache(cache, context)
        measured = {n: float(np.median(ts)) for n, ts in times.items()}
        if self.policy is not None:
            for n, ts in times.items():
                for s in ts:
                    self.policy.cost.observe(n, s)
        log.info("verify cost (ms) by tokens: %s",
                 ", ".join(f"{n}: {s * 1e3:.1f}" for n, s in measured.items()))
        return measured

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- one request -----------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompt: Sequence[int], *, max_new_tokens: int = 128,
                 sampling: SamplingParams = SamplingParams(), stop: Sequence[str] = (),
                 speculative: bool = True) -> Generation:
        """Generate up to ``max_new_tokens`` after ``prompt`` (token ids).

        ``speculative=False`` is plain decoding through the same code, with no drafting at all.
        Stop strings end the request at the token that completes them; the returned text is cut
        before the stop string.
        """
        prompt = self._checked(prompt, max_new_tokens)
        stops = StopStrings(self.lm.tokenizer, stop)
        m = RequestMetrics(mode="spec" if speculative else "plain", prompt_tokens=len(prompt))
        rng = self._rng(sampling)
        source = self.source if speculative else None

        t0 = time.perf_counter()
        if source is not None:
            if self.link is not None:
                self.link.refresh()
            source.start(np.asarray(prompt, np.uint32), expected_new=max_new_tokens)
            m.draft_s += time.perf_counter() - t0  # the local table learns the prompt
        cache = new_cache(self.model)
        logits = forward(self.model, torch.tensor([prompt], device=self.device), cache, 1)
        token = self._choose(logits[0], sampling, rng)
        t_first = time.perf_counter()
        m.ttft_s = t_first - t0
        out: list[int] = []
        finish, cut = self._emit(out, [token], max_new_tokens, stops)
        cache_len = len(prompt)  # the last emitted token is never in the cache yet
        emitted = [token]

        policy = self.policy  # plain requests still teach it the cost of a one-token step
        # a sampled request's drafts are priced by its temperature band's acceptance, its
        # steps by the cost of a sampled step (ngram_generator.policy)
        kind = step_kind([sampling.temperature], sampling.top_p < 1 or sampling.top_k > 0)
        scorer = policy and policy.scorer(sampling_band(sampling.temperature))
        while finish is None:
            draft = EMPTY_DRAFT
            if source is not None:
                t = time.perf_counter()
                source.extend(emitted)
                draft = self._draft(source, max_new_tokens - len(out) - 1, scorer,
                                    len(prompt) + len(out), kind)
                m.draft_s += time.perf_counter() - t
            k = len(draft)
            proposal = draft.tokens.tolist()
            t = self.step_clock()
            logits = forward(self.model, torch.tensor([[token] + proposal], device=self.device),
                             cache, k + 1)
            if sampling.greedy:
                n, token = greedy_accept(proposal, logits.argmax(-1).tolist())
            else:
                n, token = speculative_accept(proposal, processed_probs(logits, sampling), rng)
            if policy is not None:  # the step cost at this host's load; the drafts' outcomes
                self._learn(policy, scorer, draft, n, token, self.step_clock() - t,
                            len(prompt) + len(out), kind)
            m.verify_forwards += 1
            if k:
                m.count_draft(draft.orders, draft.tiers, n)
                source.accepted(draft, n)
            cache_len += 1 + n  # the token fed first and the accepted drafts
            crop_cache(cache, cache_len)
            emitted = proposal[:n] + [token]
            finish, cut = self._emit(out, emitted, max_new_tokens, stops)

        end = time.perf_counter()
        m.new_tokens = len(out)
        m.finish_reason = finish
        m.decode_s = end - t_first
        m.total_s = end - t0
        if source is not None:
            source.finish()
            self._feedback(prompt, out, m)
        text = self._text(out)
        if cut is not None:
            text = text[:cut]
        return Generation(out, text, finish, m, prompt)

    # -- pieces of the loop ------------------------------------------------------------------
    def _checked(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("the prompt is empty")
        if max(prompt) >= self.vocab_size or min(prompt) < 0:
            raise ValueError(f"prompt ids must be in [0, {self.vocab_size})")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        return prompt

    def _rng(self, sampling: SamplingParams) -> torch.Generator | None:
        if sampling.greedy:
            return None
        rng = torch.Generator(device=self.device)
        if sampling.seed is not None:
            rng.manual_seed(sampling.seed)
        else:
            rng.seed()
        return rng

    def _choose(self, logits: torch.Tensor, sampling: SamplingParams,
                rng: torch.Generator | None) -> int:
        """The token after a prefill: argmax, or a sample of the processed distribution."""
        if sampling.greedy:
            return int(logits.argmax(-1).item())
        return sample(processed_probs(logits, sampling), rng)

    def _draft(self, source: DraftSource, limit: int, scorer=None, at: int = 0,
               kind: int = 0) -> Draft:
        """A draft of at most ``limit`` tokens, cut before any id the model cannot emit (a table
        built with another tokenizer), then to the prefix the policy verifies in a step of
        ``kind`` (the draft is scored in full by ``scorer``: it follows the request's first
        ``at`` tokens)."""
        limit = min(limit, self.max_draft)
        if limit <= 0:
            return EMPTY_DRAFT
        draft = source.draft(limit)
        if len(draft) > limit:
            draft = draft.truncate(limit)
        bad = np.flatnonzero((draft.tokens < 0) | (draft.tokens >= self.vocab_size))
        if bad.size:
            draft = draft.truncate(int(bad[0]))
        if scorer is not None and len(draft):
            scorer.drafted(draft, at)
            draft = draft.truncate(self.policy.choose(draft, scorer.history, scorer.band,
                                                      kind))
        return draft

    @staticmethod
    def _learn(policy, scorer, draft: Draft, n: int, token: int, seconds: float,
               at: int, kind: int = 0) -> None:
        """What one step (of ``kind``) teaches the policy: the cost of ``len(draft) + 1``
        tokens, and the tokens emitted at position ``at`` (the ``n`` accepted, then
        ``token``)."""
        policy.timed(len(draft) + 1, seconds, kind=kind)
        policy.verified(draft, n)
        scorer.emitted(draft.tokens[:n].tolist() + [token], at)

    def _emit(self, out: list[int], new: list[int], max_new: int,
              stops: StopStrings) -> tuple[str | None, int | None]:
        """Append ``new`` to ``out`` up to EOS, the token limit or a stop string.

        Returns ``(finish_reason or None, characters of text to keep or None)``.
        """
        before = len(out)
        finish = None
        for t in new:
            out.append(t)
            if t in self.eos:
                finish = "eos"
                break
            if len(out) >= max_new:
                finish = "length"
                break
        hit = stops.find(out, before)
        if hit is not None:
            del out[hit[0]:]
            return "stop", hit[1]
        return finish, None

    def _text(self, tokens: list[int]) -> str:
        tok = self.lm.tokenizer
        return tok.decode(tokens, skip_special_tokens=True) if tok is not None else ""

    def _feedback(self, prompt: list[int], out: list[int], m: RequestMetrics) -> None:
        """Hand the output (and the prompt when ``ingest_prompt``, by default when the table
        says ``learn_prompts``) and per-order counts to the daemon.  The link queues them while
        the daemon is down and sends them when it answers again (``DaemonLink.feedback``)."""
        link = self.link
        if link is None or link.state in ("off", "refused"):
            return
        learn = link.learn_prompts if self.ingest_prompt is None else self.ingest_prompt
        seq = prompt + out if learn else out
        link.feedback([np.asarray(seq, np.uint32)], m.drafted_by_order, m.accepted_by_order,
                      keys=self.source.used_keys(),
                      policy=self.policy.figures() if self.policy is not None else None)
