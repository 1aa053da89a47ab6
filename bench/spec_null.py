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


class OneWrongToken(NullProposer):
    """Drafts the vocabulary's last id for the first row of every step (module doc)."""

    EVERY_ROW = False

    def __init__(self, vllm_config, *args, **kwargs):
        super().__init__(vllm_config, *args, **kwargs)
        self.token = int(vllm_config.model_config.get_vocab_size()) - 1

    def propose(self, sampled_token_ids, *args, **kwargs) -> list[list[int]]:
        n = len(sampled_token_ids)
        return [[self.token] if self.EVERY_ROW or i == 0 else [] for i in range(n)]


class WrongTokenEveryRow(OneWrongToken):
    """Drafts the vocabulary's last id for every row of every step (module doc)."""

    EVERY_ROW = True
