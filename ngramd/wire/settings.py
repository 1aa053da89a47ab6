"""Settings files: a TOML file read, and a frozen dataclass built from it with every key checked.

The daemon's config (``ngramd.config``: ``[table]``, ``[table.cold]``, ``[server]``,
``[fleet]``) and the vLLM proposer's (``ngram_generator.vllm``: ``[proposer]``) are read the
same way, so that a typo or a value of the wrong kind gets the same clear error on both sides:
a ``BadInput`` naming the section as the file spells it and the key, never a default used in
silence or a traceback from deep in a comparison.  It lives in the contract because the
proposer, a client, may import neither the daemon's config module nor what that imports.
"""

from __future__ import annotations

import difflib
from dataclasses import fields, is_dataclass

from .errors import BadInput


def read_toml(path, label: str | None = None) -> dict:
    """The TOML file at ``path`` as a dict.  ``BadInput`` naming ``label`` (default: the path)
    when it cannot be read, is not UTF-8 or is not TOML."""
    import tomllib

    label = label or str(path)
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise BadInput(f"cannot read {label}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise BadInput(f"{label}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except tomllib.TOMLDecodeError as e:
        raise BadInput(f"{label}: not TOML ({e})") from None


def from_dict(cls, data: dict, where: str = ""):
    """Build dataclass ``cls`` from a dict, recursing into nested dataclasses.  Errors are a
    ``BadInput`` that names the section as the file spells it (``[table.cold]``) and the key:
    unknown sections or keys (with the nearest known name), values of the wrong type."""
    if not isinstance(data, dict):
        raise BadInput(f"[{where}]: expected a table of settings, got {_kind(data)}" if where
                       else f"the config must be a table of sections, got {_kind(data)}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        what = f"key(s) in [{where}]" if where else "section(s) in the config"
        near = {u: difflib.get_close_matches(u, list(known), n=1) for u in unknown}
        hints = [f"{u!r}" + (f" (did you mean {m[0]!r}?)" if m else "") for u, m in near.items()]
        rest = "" if all(near.values()) else f"; known: {', '.join(known)}"
        raise BadInput(f"unknown {what}: {', '.join(hints)}{rest}")
    kwargs = {}
    for k, v in data.items():
        f = known[k]
        default = f.default_factory() if callable(f.default_factory) else f.default
        if is_dataclass(default):
            v = from_dict(type(default), v, f"{where}.{k}" if where else k)
        else:
            _check_type(f"[{where}] {k}" if where else k, f.type, v)
        kwargs[k] = v
    try:
        return cls(**kwargs)
    except (TypeError, AttributeError, OverflowError, ValueError) as e:  # what the types let
        # through (max_batch = inf, ...): the operator gets a message, not a trace
        raise BadInput(f"[{where or cls.__name__}]: a value is out of range ({e})") from None


#: what a field's annotation accepts from TOML (``from __future__ import annotations``: the
#: annotations are strings; ``X | None`` accepts what ``X`` does, TOML having no null): bools
#: are not numbers here, though Python says they are ints
_ACCEPTS = {
    "int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "float": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "tuple": ("a list (or one string)", lambda v: isinstance(v, (list, tuple, str))),
    "Any": ("a number or a list of numbers, one per order", lambda v: _number_or_list(v)),
}


def _number_or_list(v) -> bool:
    num = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)  # noqa: E731
    return num(v) or (isinstance(v, (list, tuple)) and all(num(x) for x in v))


def _check_type(where: str, annotation: str, value) -> None:
    """``BadInput`` naming ``where`` (``[section] key``) when ``value`` is not of the kind its
    field's annotation says (``int``: ``n_min = "3"`` is refused here, not deep in a
    comparison that reported "'<=' not supported")."""
    rule = _ACCEPTS.get(str(annotation).removesuffix(" | None"))
    if rule is not None and not rule[1](value):
        raise BadInput(f"{where}: expected {rule[0]}, got {_kind(value)} ({value!r:.60})")


def _kind(v) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a table"}.get(type(v), type(v).__name__)
