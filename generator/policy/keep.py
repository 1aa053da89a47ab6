"""What a draft-length policy keeps in the table between generators (``ngramd``'s
``save_policy``/``load_policy``): the state's layout, the key it is kept under, and taking it
up at start (``DraftLengthPolicy.state``/``restore`` make and read the state itself)."""

from __future__ import annotations

import hashlib
import time

import numpy as np

from ngramd.wire.commands import MAX_POLICY_KEY_BYTES, Field
from ngramd.wire.errors import BadInput

#: The layout of ``DraftLengthPolicy.state``: 2 keeps a part per sampling band and kind of
#: step; 1 (one model, one curve: greedy) is read as band 0 and kind 0; others are refused
STATE_VERSION = 2
#: The most cells of outcome counts a state holds (16 bytes each: within the daemon's 1 MiB a
#: state, ``MAX_POLICY_STATE_BYTES``, beside the cost fit's 12 KiB of steps); the model has
#: ~279k, a run fills a few thousand
STATE_CELLS = 1 << 15


def read_array(d: dict, name: str, dtype: str, size: int | None = None) -> np.ndarray:
    """Field ``name`` of a state part: bytes read as a flat ``dtype`` array (of ``size``
    values when given); a ``ValueError`` when it is not."""
    raw = d.get(name)
    item = np.dtype(dtype).itemsize
    if not isinstance(raw, bytes) or len(raw) % item:
        raise ValueError(f"{name}: expected bytes of {dtype} values")
    a = np.frombuffer(raw, dtype).astype(np.dtype(dtype).newbyteorder("="))
    if size is not None and a.size != size:
        raise ValueError(f"{name}: {a.size} values where {size} were expected")
    return a


#: a key the daemon takes (``save_policy``'s field, checked by the same parser)
_POLICY_KEY = Field("policy_key", "ascii", 1, MAX_POLICY_KEY_BYTES)


def checked_key(key: str) -> str:
    """``key`` when the daemon takes it as a policy state's key; ``BadInput`` naming what is
    wrong with it otherwise."""
    return _POLICY_KEY.parse({"policy_key": key})


def state_key(device: str, model: str) -> str:
    """Where a generator keeps its policy's state in the table (``DraftLengthPolicy.state``):
    ``<device>:<model>`` (the step cost is the model's on that kind of device; the acceptance,
    the model's against the table), with a digest of the model in place of a name longer
    than the daemon takes or not printable ASCII."""
    try:
        return checked_key(f"{device}:{model}")
    except BadInput:
        return f"{device}:sha1:{hashlib.sha1(model.encode()).hexdigest()}"


def take_up(policy, link, key: str) -> str:
    """Start ``policy`` from the state the table keeps under ``key`` (``link``: a
    ``DaemonLink``; ``DraftLengthPolicy.restore``), or leave it at its priors when the daemon
    is not up or keeps none, or what it keeps is unusable; returns what happened, for the
    log."""
    blob, saved_at = link.load_policy(key) if link.available else (None, None)
    if blob is None:
        return f"no draft-length policy kept under {key!r}: starting from the priors"
    try:
        got = policy.restore(blob)
    except ValueError as e:
        return f"the draft-length policy kept under {key!r} is unusable ({e}): starting " \
               f"from the priors"
    age = time.time() - saved_at if isinstance(saved_at, (int, float)) else float("nan")
    refused = "".join(f"; its {part} refused: {why}" for part, why in got["refused"].items())
    return (f"took up the draft-length policy kept under {key!r} (saved {age:.0f} s ago): "
            f"{got['outcomes']} outcomes, {got['steps']} timed steps{refused}")
