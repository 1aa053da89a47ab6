"""The op declarations (ngramd/wire/commands.py) and their handlers (ngramd/handlers.py): field
validation, what the client, the CLI and the server derive from them, and the CURVE key loader
both sides share (ngramd/wire/curve.py)."""

from __future__ import annotations

import subprocess
import sys

import msgpack
import numpy as np
import pytest

from ngramd.wire import protocol as P
from ngramd.wire.commands import COMMANDS, INGEST, INLINE, POOL, Field
from ngramd.wire.curve import load_key_file
from ngramd.wire.constants import MAX_DRAFT_LEN
from ngramd.wire.errors import BadInput, NgramError
from ngramd.handlers import HANDLERS


def test_fields_take_their_type_bounds_and_defaults():
    draft = COMMANDS["draft"]
    assert draft.parse({"max_len": 4}) == {"max_len": 4, "budget_us": None}
    assert draft.parse({"max_len": 4, "budget_us": 2.5})["budget_us"] == 2.5
    for bad in (0, MAX_DRAFT_LEN + 1, 2.0, True, "4", None):  # one bound: MAX_DRAFT_LEN
        with pytest.raises(BadInput, match=f"max_len must be an integer in 1..{MAX_DRAFT_LEN}"):
            draft.parse({"max_len": bad})
    for bad in (-1, float("nan"), float("inf"), True, "1"):
        with pytest.raises(BadInput, match="budget_us must be a number"):
            draft.parse({"max_len": 4, "budget_us": bad})
    assert COMMANDS["rebuild_hot"].parse({}) == {"full": False}
    with pytest.raises(BadInput, match="full must be true or false"):
        COMMANDS["rebuild_hot"].parse({"full": 1})
    assert COMMANDS["ingest"].parse({"key": "k"}) == {"key": "k"}
    with pytest.raises(BadInput, match="key must be a string of at most 256"):
        COMMANDS["ingest"].parse({"key": "x" * 300})
    report = COMMANDS["report"]
    assert report.parse({"drafted": {"4": 3}}) == {"drafted": {4: 3}, "accepted": {},
                                                   "policy": {}}
    with pytest.raises(BadInput, match="drafted: order"):
        report.parse({"drafted": {"1e3": 1}})
    with pytest.raises(BadInput, match="a map"):
        Field("m", "counts").parse({"m": [1]})


def test_ascii_and_blob_fields_take_only_what_they_declare():
    """``save_policy``'s key is a name a person may type, its state opaque bytes: a string is
    refused (a client's encoding could alter it), and each error names the field, the limit
    and what came."""
    from ngramd.wire.commands import (MAX_POLICY_KEY_BYTES as KEY, MAX_POLICY_STATE_BYTES as MAX,
                                      SavePolicy)

    save, load = COMMANDS["save_policy"], COMMANDS["load_policy"]
    assert isinstance(save, SavePolicy) and MAX == 1 << 20 and KEY == 128
    ok = {"key": "cpu:/models/qwen3-0.6b", "state": b"\x00\xff" * 10}
    assert save.parse(ok) == ok
    assert save.parse({"key": "k" * KEY, "state": b""})["state"] == b""
    assert save.parse({"key": " ~", "state": bytes(MAX)})["state"] == bytes(MAX)
    assert load.parse({"key": "k"}) == {"key": "k"}
    for key, msg in [("", "key must be 1..128 bytes of printable ASCII, got 0 characters"),
                     ("k" * (KEY + 1), "key must be 1..128 bytes of printable ASCII, got 129"),
                     ("a\tb", r"key must be printable ASCII \(' ' to '~'\), got 'a\\tb'"),
                     ("qwen3-é", "key must be printable ASCII"),
                     (b"k", "key must be a string, got bytes"), (None, "key must be a string"),
                     (7, "key must be a string, got int")]:
        for spec in (save, load):
            with pytest.raises(BadInput, match=msg):
                spec.parse({**ok, "key": key})
    for state, msg in [(bytes(MAX + 1), "state must be at most 1048576 bytes, got 1048577 bytes"),
                       ("text", r"state must be bytes \(a msgpack bin\), got str"),
                       (None, "state must be bytes"), ([1, 2], "state must be bytes")]:
        with pytest.raises(BadInput, match=msg):
            save.parse({**ok, "state": state})
    # the client's message keeps bytes as bytes (a bytearray too), a str as it is given
    assert save.message("k", bytearray(b"ab")).fields == {"key": "k", "state": b"ab"}
    assert save.message("k", "ab").fields["state"] == "ab"
    assert Field("b", "blob", 2, 4).parse({"b": b"abc"}) == b"abc"
    with pytest.raises(BadInput, match="b must be 2..4 bytes, got 1 bytes"):
        Field("b", "blob", 2, 4).parse({"b": b"a"})


def test_the_declarations_are_the_protocol_table():
    """``protocol.OPS`` is derived from the declarations; every op runs somewhere known and
    names its reply arrays once; the client module imports them without the engine."""
    assert list(P.OPS) == list(COMMANDS)
    for name, spec in COMMANDS.items():
        assert P.OPS[name] == (spec.batch, spec.idempotent)
        assert spec.runs in (INLINE, POOL, INGEST)
        assert len(set(spec.arrays)) == len(spec.arrays)
        if spec.runs != INGEST:  # ingest is the ingest thread's group commit
            assert name in HANDLERS, name
    # a resend would count twice (ingest, report) or take a second snapshot
    assert {n for n, s in COMMANDS.items() if not s.idempotent} == {"ingest", "report",
                                                                     "snapshot"}


def test_cli_has_a_subcommand_per_declared_op_with_typed_options():
    from ngram_client.cli import LOCAL_COMMANDS, build_parser

    ap = build_parser()
    sub = next(a for a in ap._actions if a.dest == "cmd")
    # one subcommand per op, and the local ones (no daemon: tokenizer)
    assert set(sub.choices) == ({n.replace("_", "-") for n in COMMANDS} - {"report"}
                                | set(LOCAL_COMMANDS))
    args = ap.parse_args(["top", "--order", "3"])
    assert (args.order, args.n, args.op) == (3, 20, "top")
    assert ap.parse_args(["draft", "x"]).budget_us == 200_000.0
    with pytest.raises(SystemExit):
        ap.parse_args(["top", "--order", "99"])  # the declaration's bound, 1..32


_NEW_OP = r"""
import inspect, json
import numpy as np
from ngramd.wire.commands import Command, Field, Message

class Echo(Command):
    '''Repeat the contexts' lengths ``times`` times.'''
    name = "echo"
    batch = True
    fields = (Field("times", "int", 1, 8, 1),)
    arrays = ("lengths",)
    help = "echo the context lengths"

    def message(self, contexts, times=1):
        return Message({"times": int(times)}, contexts)

    def decode(self, reply):
        return reply.arrays["lengths"].tolist()

from ngramd.handlers import handles

@handles("echo")
def echo(srv, tokens, offsets, times):
    return {"n": int(offsets.size - 1), "lengths": np.tile(np.diff(offsets), times)}

from ngramd.wire import protocol as P
from ngramd.config import ServerConfig
from ngramd.server import Server
from ngram_client import NgramClient
from ngram_client.cli import build_parser

class Table:
    class identity:
        vocab_size = 100
    writes = None  # the ingest front's write path: no ingest here
    def health(self):
        return {"state": "ok"}

class Sock:
    def send_multipart(self, frames, copy=True):
        self.sent = frames

def ask(req_id, times, seqs):
    body = P.encode_request("echo", req_id, {"times": times}, P.pack_batch(seqs))
    srv._handle([b"peer"] + [f if isinstance(f, bytes) else f.tobytes() for f in body], sock)
    return P.decode_reply(sock.sent[1:])

srv, sock = Server(Table(), ServerConfig()), Sock()
ok = ask(7, 2, [[1, 2, 3], [4]])
bad = ask(8, 9, [[1]])
args = build_parser().parse_args(["echo", "hello", "--times", "3"])
print(json.dumps({"ops": "echo" in P.OPS, "client": hasattr(NgramClient, "echo"),
                  "ok": [ok.fields["n"], ok.arrays["lengths"].tolist()],
                  "bad": [bad.fields["code"], bad.fields["msg"]],
                  "cli": [args.times, args.text, args.op]}))
srv.close_sockets()
"""


def test_a_new_op_is_one_declaration():
    """The module doc's promise: declaring a class (and the daemon's handler of it) is all it
    takes for the protocol, the daemon's dispatch and validation, and the CLI subcommand.  The
    client's method pair is written out by hand (IDEs see it): until it is, NgramClient has
    none, and tests/test_client_ops.py names the op."""
    import json

    out = subprocess.run([sys.executable, "-c", _NEW_OP], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["ops"] and r["client"] is False
    assert r["ok"] == [2, [3, 1, 3, 1]]
    assert r["bad"] == ["bad_input", "times must be an integer in 1..8, got 9"]
    assert r["cli"] == [3, "hello", "echo"]


def test_one_curve_key_loader_names_the_file_and_the_problem(tmp_path):
    import zmq.auth

    public, secret = zmq.auth.create_certificates(str(tmp_path), "k")
    pub, sec = load_key_file(secret, "client key", secret=True)
    assert pub and sec and load_key_file(public, "server key")[1] is None
    with pytest.raises(BadInput, match=f"client key {public} holds no secret key"):
        load_key_file(public, "client key", secret=True, error=BadInput)
    with pytest.raises(NgramError, match=f"curve_secret_key {tmp_path}/nope: no such file"):
        load_key_file(str(tmp_path / "nope"), "curve_secret_key", secret=True)
    junk = tmp_path / "junk.key"
    junk.write_text("not a certificate\n")
    with pytest.raises(BadInput, match="server key .*junk.key: not a CurveZMQ key file"):
        load_key_file(str(junk), "server key", error=BadInput)
    # the client names its key files the same way
    from ngram_client import NgramClient

    with pytest.raises(BadInput, match="server key .*nope"):
        NgramClient("tcp://127.0.0.1:1", server_key=str(tmp_path / "nope"))
    with pytest.raises(BadInput, match="client key .* holds no secret key"):
        NgramClient("tcp://127.0.0.1:1", server_key=public, client_key=public)


def test_reply_arrays_keep_their_wire_order():
    """The server sends a handler's arrays in declaration order: a draft reply is byte for
    byte what it was before the declarations (tok, order, tier, conf, length)."""
    from ngramd.server import Server

    out = {"tok": np.zeros((1, 2), np.uint32), "order": np.zeros((1, 2), np.uint8),
           "tier": np.zeros((1, 2), np.uint8), "conf": np.zeros((1, 2), np.float32),
           "length": np.zeros(1, np.int32)}
    frames = Server._reply(5, COMMANDS["draft"], dict(out))
    assert frames == P.encode_reply(5, None, out)
    head = msgpack.unpackb(frames[0])
    assert [a[0] for a in head["arrays"]] == list(COMMANDS["draft"].arrays)
