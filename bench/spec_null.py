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
"""

from __future__ import annotations

import dataclasses

from ngram_generator.policy import StepCost
from ngram_generator.vllm import NgramdProposer, ProposerSettings


class NullProposer:
    """A ``custom_class`` proposer that proposes nothing."""

    def __init__(self, vllm_config, *args, **kwargs):
        self.num_speculative_tokens = int(vllm_config.speculative_config.num_speculative_tokens)

    def load_model(self, *args, **kwargs) -> None:
        """vLLM asks every proposer to load its model; this one has none."""

    def propose(self, sampled_token_ids, *args, **kwargs) -> list[list[int]]:
        return [[] for _ in sampled_token_ids]


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

    def observe(self, tokens: int, seconds: float) -> None:
        pass


class PlainChoosingProposer(NgramdProposer):
    """``NgramdProposer`` whose policy always chooses plain (module doc)."""

    BACK_OFF = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        policy = self.drafter.policy
        policy.cost = policy.tally.cost = SteepCost()
        if not self.BACK_OFF:
            policy.BACKOFF_AFTER = 1 << 62  # never backs off


class PlainChoosingNoBackOff(PlainChoosingProposer):
    """``PlainChoosingProposer`` without the back-off: it drafts every row every step."""

    BACK_OFF = False
