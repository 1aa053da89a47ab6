"""ngram_generator — speculative decoding for causal LMs, drafting from n-gram tables.

Read ``spec.py`` first (the loop), then ``sampling.py`` (lossless acceptance) and
``drafting.py`` (where drafts come from and how many tokens to verify).  ``model.py`` loads
checkpoints, ``remote.py`` is the only module that talks to the daemon, ``cli.py`` is
``ngram-generate``.
"""

from .drafting import Draft, DraftConfig, DraftLengthPolicy, DraftSource, NgramDrafter, VerifyCost
from .metrics import RequestMetrics, summarize
from .model import LoadedModel, ModelLoadError, load_model
from .remote import DaemonLink
from .sampling import SamplingParams
from .spec import Generation, Generator

__all__ = [
    "DaemonLink", "Draft", "DraftConfig", "DraftLengthPolicy", "DraftSource", "Generation",
    "Generator", "LoadedModel", "ModelLoadError", "NgramDrafter", "RequestMetrics",
    "SamplingParams", "VerifyCost", "load_model", "summarize",
]
