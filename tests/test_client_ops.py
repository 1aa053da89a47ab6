"""``NgramClient``'s op methods against the op declarations (``ngramd/wire/commands.py``).

The methods are written out in ``client/client.py`` so that IDEs and static tools see them; this
test is what keeps them the declarations': every declared op has a method pair with the
declared parameters (names, order, defaults, annotations), value and docstring, and no public
method lacks a declaration."""

from __future__ import annotations

import inspect

from ngram_client import NgramClient
from ngramd.wire.commands import COMMANDS, Command, Message

#: ops whose synchronous method adds something of the client's own (module doc of client.py):
#: its value or docstring is not the declaration's, its parameters are
OWN = {"ping", "info", "ingest"}
#: public methods that are no op
NOT_OPS = {"close", "asker"}  # the connection itself, and its per-thread draft asks

_SELF = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
_TIMEOUT = inspect.Parameter("timeout_ms", inspect.Parameter.KEYWORD_ONLY, default=None,
                             annotation="int | None")


def problems(cls, commands: dict) -> list[str]:
    """How ``cls``'s methods differ from the declarations in ``commands``, one line each
    (``method: what``); empty when they agree."""
    out = []
    for name, spec in commands.items():
        declared = list(inspect.signature(spec.message).parameters.values())
        for meth, sync in ((name, True), (name + "_async", False)):
            m = cls.__dict__.get(meth)
            if m is None:
                out.append(f"{meth}: no method for the declared op {name!r}")
                continue
            if m.__code__.co_name != meth:
                out.append(f"{meth}: not written out (its code is {m.__code__.co_name!r})")
            sig = inspect.signature(m)
            if list(sig.parameters.values()) != [_SELF, *declared, _TIMEOUT]:
                out.append(f"{meth}: parameters {sig} are not the declaration's "
                           f"{inspect.signature(spec.message)} plus timeout_ms")
            doc = inspect.getdoc(m) or ""
            if sync and name not in OWN:
                if sig.return_annotation != inspect.signature(spec.decode).return_annotation:
                    out.append(f"{meth}: value {sig.return_annotation!r} is not the "
                               f"declaration's")
                if doc != inspect.getdoc(spec):
                    out.append(f"{meth}: docstring is not the declaration's")
            if not sync and (sig.return_annotation != "cf.Future"
                             or not doc.startswith(f"Future of ``{name}``")):
                out.append(f"{meth}: not a future of {name!r}")
    ops = {n for name in commands for n in (name, name + "_async")}
    for attr, value in vars(cls).items():
        if callable(value) and not attr.startswith("_") and attr not in ops | NOT_OPS:
            out.append(f"{attr}: a public method without a declaration")
    return out


def test_every_declared_op_is_a_written_out_method_pair_and_every_method_an_op():
    assert problems(NgramClient, COMMANDS) == []
    assert str(inspect.signature(NgramClient.top)) == \
        "(self, order: 'int', n: 'int' = 20, *, timeout_ms: 'int | None' = None) -> 'list'"


class _Echo(Command):  # no name: not registered in COMMANDS
    """Repeat the contexts' lengths ``times`` times."""

    def message(self, contexts, times: int = 1):
        return Message({"times": int(times)}, contexts)


def test_the_check_finds_a_missing_method_a_drifted_one_and_one_without_a_declaration():
    ns = {k: v for k, v in vars(NgramClient).items() if k not in ("__dict__", "__weakref__")}
    del ns["top_async"]
    ns["top"] = lambda self, order, n=10, *, timeout_ms=None: None
    ns["bogus"] = lambda self: None
    broken = type("Broken", (), ns)
    found = problems(broken, {**COMMANDS, "echo": _Echo()})
    assert [p.split(":")[0] for p in found] == [
        "top", "top", "top", "top", "top_async", "echo", "echo_async", "bogus"], found
    assert found[0] == "top: not written out (its code is '<lambda>')"
    assert found[4] == "top_async: no method for the declared op 'top'"


class _Recorder(NgramClient):
    """A client without sockets that records what its op methods hand to ``_invoke``."""

    def __init__(self):
        self.calls = []
        self.tokenizer_fingerprint, self._warned_unproven = "fp", True

    def _invoke(self, spec, args, kw, timeout_ms, sync):
        self.calls.append((spec, args, kw, timeout_ms, sync))
        return "value"


def test_each_method_sends_its_own_op_with_its_arguments_in_order():
    """Written out by hand, a method could pass another op's declaration or its arguments in
    another order: each method hands its own, as given, to the one call path."""
    for name, spec in COMMANDS.items():
        args = tuple(f"{name}.{p}" for p in inspect.signature(spec.message).parameters)
        methods = [(name + "_async", False)] + ([] if name in OWN else [(name, True)])
        if name in ("ping", "info"):  # their own call paths (the round trip, the identity)
            continue
        for meth, sync in methods:
            c = _Recorder()
            assert getattr(c, meth)(*args, timeout_ms=7) == "value"
            assert c.calls == [(spec, args, {}, 7, sync)], meth
