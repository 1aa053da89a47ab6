"""Proposers for ``bench/bench_spec_overhead.py`` (vLLM ``custom_class``), kept in a module of
their own: vLLM builds the proposer in its engine process, which imports it by name.

* :class:`NullProposer` never drafts and does nothing else: what vLLM's speculative path costs
  by itself, with no draft to verify.
* :class:`DiscardingProposer` is ngramd's proposer at its defaults whose drafts are thrown
  away: everything ``NgramdProposer.propose`` does (tracking the rows, the request-local
  tables, the daemon's asks, the policy, the feedback), with no draft to verify.
* :class:`PlainChoosingProposer` is ngramd's proposer at its defaults whose policy believes a
  draft token costs a thousand plain steps: it chooses plain at every step (and never probes),
  so it costs what ngramd costs where drafting cannot pay, its back-off included;
  :class:`PlainChoosingNoBackOff` is the same without the back-off.
* :class:`DiscardingEveryAsk` is :class:`DiscardingProposer` whose every short draft asks the
  daemon (``ask_backoff`` 1: no ``AskGate`` back-off), as the proposer did before the gate.
* :class:`OneWrongToken` drafts one token no model emits (the vocabulary's last id) for the
  first row of every step, and :class:`WrongTokenEveryRow` one for every row: steps that take
  vLLM's verifying path with one and with ``rows`` draft tokens that are never accepted, so
  against :class:`NullProposer` (the same steps, nothing verified) they measure what a step
  that verifies a draft costs beyond its tokens (the "draft jump" of bench/RESULTS.md).
  :class:`WrongTokens2`, ``4`` and ``8`` draft that many for every row: with them, what a
  step of ``R`` rows costs against its draft tokens ``D`` (``f(R, D) / f(R, 0)``), to set
  beside the policy's one curve in ``T = R + D``.
* :class:`RightTokens8` drafts the next 8 tokens each row will emit, read from a plain
  engine's recorded outputs (``SPEC_NULL_REPLAY``): every draft accepted, so a step verifies
  what :class:`WrongTokens8`'s does and emits nine times the tokens.  Against it, what the
  engine's handling of emitted tokens adds to the seconds a step clock reads.

These proposers (:class:`NullProposer` and the ones built on it) time the engine's steps when
``SPEC_NULL_STEPS`` names a folder: the seconds from the end of one ``propose()`` to the start
of the next (the clock ngramd's policy learns from), with the step's rows, the draft tokens it
verified, the tokens it emitted and those the step before it emitted, and the milliseconds
from the start of the target model's forward pass to ``propose()`` (the forward, the logits,
the sampler; none of the engine's bookkeeping between steps), written to
``<folder>/<class>-<pid>.json``, a JSON line ``[rows, drafted, emitted, emitted before, ms,
forward ms]`` a step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np

from ngram_generator.policy import StepCost
from ngram_generator.vllm import NgramdProposer, ProposerSettings


class NullProposer:
    """A ``custom_class`` proposer that proposes nothing (and times the steps: module doc)."""

    def __init__(self, vllm_config, *args, **kwargs):
        self.num_speculative_tokens = int(vllm_config.speculative_config.num_speculative_tokens)
        folder = os.environ.get("SPEC_NULL_STEPS")
        self._steps_file = (os.path.join(folder, f"{type(self).__name__}-{os.getpid()}.json")
                            if folder else None)
        self._end = None  # when the last propose() returned
        self._last = (0, 0, 0)  # its rows, the draft tokens it returned, the tokens emitted
        self._forward_start = None  # when the target's last forward pass began (load_model)

    def load_model(self, target=None, *args, **kwargs) -> None:
        """vLLM asks every proposer to load its model, passing the target model; this one has
        none, and times the target's forward passes when it times steps (module doc)."""
        if self._steps_file is not None and hasattr(target, "register_forward_pre_hook"):
            target.register_forward_pre_hook(self._forward_hook)

    def _forward_hook(self, *args) -> None:
        self._forward_start = time.perf_counter()

    def propose(self, sampled_token_ids, *args, **kwargs) -> list[list[int]]:
        start = time.perf_counter()
        drafts = self.drafts(sampled_token_ids, *args, **kwargs)
        if self._steps_file is not None:
            self._time(start, sampled_token_ids, drafts)
        return drafts

    def drafts(self, sampled_token_ids, *args, **kwargs) -> list[list[int]]:
        """This step's drafts, one a row."""
        return [[] for _ in sampled_token_ids]

    def _time(self, start: float, sampled, drafts) -> None:
        rows, emitted = len(sampled), sum(len(t) for t in sampled)
        last_rows, drafted, before = self._last
        if self._end is not None and rows == last_rows:  # rows joining or leaving: not kept
            fwd = self._forward_start
            step = [rows, drafted, emitted, before, round((start - self._end) * 1e3, 3),
                    round((start - fwd) * 1e3, 3) if fwd is not None and fwd > self._end
                    else None]
            with open(self._steps_file, "a") as f:  # a line a step: the engine is not closed
                f.write(json.dumps(step) + "\n")  # gracefully, so nothing waits for the end
        self._last = (rows, sum(len(d) for d in drafts), emitted)
        self._end = time.perf_counter()


class DiscardingProposer(NgramdProposer):
    """``NgramdProposer`` whose drafts are dropped after it made them."""

    def propose(self, sampled_token_ids, *args, **kwargs) -> list[list[int]]:
        super().propose(sampled_token_ids, *args, **kwargs)
        return [[] for _ in sampled_token_ids]


class DiscardingEveryAsk(DiscardingProposer):
    """``DiscardingProposer`` with ``ask_backoff`` 1: every short draft asks the daemon."""

    def __init__(self, vllm_config, *args, **kwargs):
        kwargs.setdefault("settings", dataclasses.replace(ProposerSettings.load(), ask_backoff=1))
        super().__init__(vllm_config, *args, **kwargs)


class SteepCost(StepCost):
    """A step cost of a thousand plain steps a draft token, that learns nothing."""

    def __init__(self):
        super().__init__(slope=1000.0)

    def observe(self, tokens: int, seconds: float, rows: int = 1) -> None:
        pass


class PlainChoosingProposer(NgramdProposer):
    """``NgramdProposer`` whose policy always chooses plain (module doc)."""

    BACK_OFF = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        policy = self.drafter.policy
        policy.costs[:] = [SteepCost()] * len(policy.costs)  # every kind of step
        if not self.BACK_OFF:
            policy.BACKOFF_AFTER = 1 << 62  # never backs off


class PlainChoosingNoBackOff(PlainChoosingProposer):
    """``PlainChoosingProposer`` without the back-off: it drafts every row every step."""

    BACK_OFF = False


class OneWrongToken(NullProposer):
    """Drafts the vocabulary's last id for the first row of every step (module doc)."""

    EVERY_ROW = False
    PER_ROW = 1

    def __init__(self, vllm_config, *args, **kwargs):
        super().__init__(vllm_config, *args, **kwargs)
        self.token = int(vllm_config.model_config.get_vocab_size()) - 1

    def drafts(self, sampled_token_ids, *args, **kwargs) -> list[list[int]]:
        n = len(sampled_token_ids)
        draft = [self.token] * self.PER_ROW
        return [draft if self.EVERY_ROW or i == 0 else [] for i in range(n)]


class WrongTokenEveryRow(OneWrongToken):
    """Drafts the vocabulary's last id for every row of every step (module doc)."""

    EVERY_ROW = True


class WrongTokens2(WrongTokenEveryRow):
    """Drafts the vocabulary's last id twice for every row of every step."""

    PER_ROW = 2


class WrongTokens4(WrongTokenEveryRow):
    """Drafts the vocabulary's last id four times for every row of every step."""

    PER_ROW = 4


class WrongTokens8(WrongTokenEveryRow):
    """Drafts the vocabulary's last id eight times for every row of every step."""

    PER_ROW = 8


class RightTokens8(NullProposer):
    """Drafts the next 8 tokens of each row as a plain engine emitted them (module doc):
    ``SPEC_NULL_REPLAY`` names a JSON list of token sequences (prompt and output), read once
    it exists (the bench records it after the engines' warm-up).  A row is found by its
    length and its last 8 tokens."""

    def __init__(self, vllm_config, *args, **kwargs):
        super().__init__(vllm_config, *args, **kwargs)
        self._index: dict | None = None  # (length, last 8 tokens) -> the sequence

    def _load(self) -> dict | None:
        path = os.environ.get("SPEC_NULL_REPLAY")
        if not path or not os.path.exists(path):
            return None
        with open(path) as f:
            seqs = [np.asarray(s, np.int64) for s in json.load(f)]
        return {(n, s[n - 8:n].tobytes()): s for s in seqs for n in range(8, len(s))}

    def drafts(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, *args, **kwargs):
        if self._index is None:
            self._index = self._load()
        index = self._index or {}
        k = self.num_speculative_tokens
        out = []
        for r in range(len(sampled_token_ids)):
            n = int(num_tokens_no_spec[r])
            seq = index.get((n, np.asarray(token_ids_cpu[r, n - 8:n], np.int64).tobytes()))
            out.append([] if seq is None else seq[n:n + k].tolist())
        return out
