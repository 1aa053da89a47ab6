"""The wire protocol alone: encode/decode round trips and every malformed input we refuse."""

import msgpack
import numpy as np
import pytest

from ngramd.wire import errors as E
from ngramd.wire import protocol as P

VOCAB = 151_936


def _batch_frames(seqs):
    return P.encode_request("draft", 1, {"max_len": 4}, P.pack_batch(seqs))


def _decode(frames):
    return P.decode_request(frames)


def _code(fn, *a, **kw):
    with pytest.raises(E.NgramError) as ei:
        fn(*a, **kw)
    return ei.value.code


def test_request_round_trip_is_zero_copy_raw_frames():
    seqs = [np.array([1, 2, 3], np.uint32), [7], np.arange(10, 20, dtype=np.int64)]
    frames = _batch_frames(seqs)
    assert len(frames) == 3
    head = msgpack.unpackb(frames[0])
    assert head == {"v": 1, "op": "draft", "id": 1, "max_len": 4}
    assert bytes(frames[1]) == np.concatenate([np.asarray(s, "<u4") for s in seqs]).tobytes()
    assert bytes(frames[2]) == np.array([0, 3, 4, 14], "<i8").tobytes()
    req = _decode([bytes(f) for f in frames])
    tokens, offsets = req.batch(VOCAB, max_batch=8, max_tokens=100)
    assert tokens.dtype == np.uint32 and offsets.dtype == np.int64
    assert offsets.tolist() == [0, 3, 4, 14]
    assert tokens[offsets[2]:offsets[3]].tolist() == list(range(10, 20))


def test_reply_round_trip_with_arrays():
    arrays = {"tok": np.arange(6, dtype=np.uint32).reshape(2, 3),
              "order": np.array([[1, 2, 3], [4, 5, 6]], np.uint8),
              "conf": np.array([[0.5, 1, 0], [0, 0, 0]], np.float32),
              "length": np.array([3, 0], np.int32)}
    frames = P.encode_reply(9, {"x": 1}, arrays)
    assert len(frames) == 2  # all arrays in one aligned data frame
    r = P.decode_reply([bytes(f) for f in frames])
    assert r.ok and r.id == 9 and r.fields["x"] == 1
    for k, a in arrays.items():
        assert r.arrays[k].dtype == a.dtype and np.array_equal(r.arrays[k], a)


def test_error_reply():
    r = P.decode_reply(P.encode_error(3, E.BAD_INPUT, "nope"))
    assert not r.ok and r.id == 3 and r.fields["code"] == "bad_input" and r.fields["msg"] == "nope"


@pytest.mark.parametrize("body, code", [
    ([], E.MALFORMED),
    ([b"garbage that is not msgpack"], E.MALFORMED),
    ([msgpack.packb({"v": 1, "op": "ping", "id": 1})[:-3]], E.MALFORMED),  # truncated
    ([msgpack.packb([1, 2, 3])], E.MALFORMED),
    ([msgpack.packb({"v": 1, "op": "ping", "id": "x"})], E.MALFORMED),
    ([msgpack.packb({"v": 2, "op": "ping", "id": 1})], E.VERSION),
    ([msgpack.packb({"op": "ping", "id": 1})], E.VERSION),
    ([msgpack.packb({"v": 1, "op": "drop_tables", "id": 1})], E.UNKNOWN_OP),
    ([msgpack.packb({"v": 1, "op": "draft", "id": 1, "max_len": 2})], E.BAD_INPUT),  # no frames
    ([msgpack.packb({"v": 1, "op": "ping", "id": 1})] + [b""] * 10, E.MALFORMED),
    ([b"\x81\xa1a\xdb" + (10**9).to_bytes(4, "big") + b"xy"], E.MALFORMED),  # lying length
    ([b"\xc1" * (P.MAX_HEADER_BYTES + 1)], E.TOO_LARGE),
])
def test_malformed_requests_get_stable_codes(body, code):
    assert _code(_decode, body) == code


def test_a_blob_op_may_send_a_header_of_its_blob_plus_64_kib_of_scalars():
    """``save_policy``'s state travels in its header: up to ``MAX_BLOB_HEADER_BYTES`` for an op
    with a blob field, as a map of scalar fields (checked before they are unpacked: a header of
    nested containers costs far more to unpack than its size says); any other op, or any other
    shape, past ``MAX_HEADER_BYTES`` is ``too_large`` as before."""
    assert P.BLOB_OPS == {"save_policy"}
    assert P.MAX_BLOB_HEADER_BYTES == P.MAX_HEADER_BYTES + (1 << 20)
    state = bytes(range(256)) * 4096  # 1 MiB
    head = {"v": 1, "op": "save_policy", "id": 9, "key": "cpu:m", "state": state}
    req = _decode([msgpack.packb(head, use_bin_type=True)])
    assert req.op == "save_policy" and req.header["state"] == state and req.id == 9
    over = msgpack.packb({**head, "state": state + b"x"}, use_bin_type=True)
    assert _decode([over]).header["state"] == state + b"x"  # the field's bound says no
    with pytest.raises(E.NgramError) as ei:  # another op: too large, with its id
        _decode([msgpack.packb({**head, "op": "ping"}, use_bin_type=True)])
    assert ei.value.code == E.TOO_LARGE and ei.value.req_id == 9
    assert "exceeds 65536" in str(ei.value)
    pad = "x" * 70_000  # one of the fuzz suite's odd headers: still too large for ping
    assert _code(_decode, [msgpack.packb({"v": 1, "op": "ping", "id": 1, "pad": pad})]) \
        == E.TOO_LARGE
    for bad in [{**head, "state": state * 2},                    # over the blob header bound
                {**head, "extra": [[]] * 70_000},               # a container
                {**head, "extra": {"a": b"x" * 70_000}},
                {**head, **{f"f{i}": 0 for i in range(64)}},    # more than 64 fields
                [head["state"]]]:                               # not a map
        raw = msgpack.packb(bad, use_bin_type=True)
        assert len(raw) > P.MAX_HEADER_BYTES
        with pytest.raises(E.NgramError, match="an op with a blob field may send up to") as ei:
            _decode([raw])
        assert ei.value.code == E.TOO_LARGE and getattr(ei.value, "req_id", None) is None
    raw = msgpack.packb(head, use_bin_type=True)
    for cut in (raw[:-1], raw + b"\xc0"):  # truncated, trailing bytes
        assert _code(_decode, [cut]) == E.TOO_LARGE


def test_error_keeps_the_request_id_when_the_header_was_readable():
    with pytest.raises(E.NgramError) as ei:
        _decode([msgpack.packb({"v": 1, "op": "nope", "id": 42})])
    assert ei.value.req_id == 42


def _head(**kw):
    return msgpack.packb({"v": 1, "op": "draft", "id": 1, "max_len": 2, **kw})


@pytest.mark.parametrize("tokens, offsets, code", [
    (np.array([1, 2], "<u4").tobytes(), np.array([0, 2], "<i8").tobytes(), None),
    (b"\x01\x00\x00", np.array([0, 1], "<i8").tobytes(), E.BAD_INPUT),      # not 4-byte ids
    (np.array([1, 2], "<u4").tobytes(), np.array([0, 3], "<i8").tobytes(), E.BAD_INPUT),
    (np.array([1, 2], "<u4").tobytes(), np.array([1, 2], "<i8").tobytes(), E.BAD_INPUT),
    (np.array([1, 2], "<u4").tobytes(), np.array([0, 2, 1, 2], "<i8").tobytes(), E.BAD_INPUT),
    (np.array([1, 2], "<u4").tobytes(), b"\x00" * 12, E.BAD_INPUT),          # not int64
    (np.array([1, VOCAB], "<u4").tobytes(), np.array([0, 2], "<i8").tobytes(), E.BAD_INPUT),
    (np.array([1, 2], "<u4").tobytes(), np.array([0, 0, 2], "<i8").tobytes(), E.BAD_INPUT),
    (b"", np.array([0, 0], "<i8").tobytes(), E.BAD_INPUT),                  # empty
    (np.arange(5, dtype="<u4").tobytes(), np.array([0, 1, 2, 3, 4, 5], "<i8").tobytes(),
     E.TOO_LARGE),                                                          # > max_batch 4
    (np.arange(101, dtype="<u4").tobytes(), np.array([0, 101], "<i8").tobytes(), E.TOO_LARGE),
])
def test_batch_validation(tokens, offsets, code):
    req = _decode([_head(), tokens, offsets])

    def run():
        return req.batch(VOCAB, max_batch=4, max_tokens=100)
    if code is None:
        t, o = run()
        assert t.tolist() == [1, 2] and o.tolist() == [0, 2]
    else:
        assert _code(run) == code


def test_declared_dtype_other_than_uint32_is_refused():
    f = np.array([1.0, 2.0], "<f4").tobytes()
    req = _decode([_head(dtype="<f4"), f, np.array([0, 2], "<i8").tobytes()])
    assert _code(req.batch, VOCAB, max_batch=4, max_tokens=100) == E.BAD_INPUT


def test_req_socket_envelope_is_kept():
    env, body = P.split_envelope([b"peer", b"", b"head", b"x"])
    assert env == [b"peer", b""] and body == [b"head", b"x"]
    env, body = P.split_envelope([b"peer", b"head"])
    assert env == [b"peer"] and body == [b"head"]


def test_reply_decoder_refuses_inconsistent_arrays():
    head = msgpack.packb({"v": 1, "id": 1, "ok": True, "arrays": [["a", "<u4", [3]]]})
    assert _code(P.decode_reply, [head, b"\x00" * 8]) == E.MALFORMED  # too short
    assert _code(P.decode_reply, [head]) == E.MALFORMED  # no data frame
    head2 = msgpack.packb({"v": 1, "id": 1, "ok": True,
                           "arrays": [["a", "<u1", [1]], ["b", "<u8", [1]]]})
    assert P.decode_reply([head2, b"\x07" + bytes(15)]).arrays["b"][0] == 0  # aligned at 8
    assert _code(P.decode_reply, [head2, b"\x07" + bytes(8)]) == E.MALFORMED
    head = msgpack.packb({"v": 1, "id": 1, "ok": True, "arrays": [["a", "|O", [1]]]})
    assert _code(P.decode_reply, [head, b"\x00" * 8]) == E.MALFORMED
    assert _code(P.decode_reply, [msgpack.packb({"v": 7, "ok": True})]) == E.VERSION


def test_every_op_is_declared_once_and_ingest_is_not_idempotent():
    assert {"ping", "info", "draft", "lookup", "ingest", "report", "stats", "rebuild_hot",
            "flush"} <= set(P.OPS)
    assert "ingest" not in P.IDEMPOTENT and "report" not in P.IDEMPOTENT
    assert "draft" in P.IDEMPOTENT


def test_the_default_endpoint_does_not_depend_on_the_working_directory(tmp_path, monkeypatch):
    """The daemon and its clients meet at the same socket wherever each was started (it was
    ``ipc://./var/run/default.sock``: a client run from another directory found nothing)."""
    from ngram_client.cli import resolve_endpoint
    from ngramd.config import load_daemon_config
    from ngramd.config import resolve

    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.delenv("NGRAMD_ENDPOINT", raising=False)
    seen = set()
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        monkeypatch.chdir(tmp_path / d)
        seen.add((resolve(load_daemon_config()).server.endpoints[0], resolve_endpoint(None)[0]))
    (daemon, client), = seen
    assert daemon == client and daemon.startswith("ipc:///"), seen
    assert P.default_runtime_dir({}, 0) == "/run/ngramd"
    assert P.default_runtime_dir({"XDG_RUNTIME_DIR": "/run/user/1000"}, 1000) == \
        "/run/user/1000/ngramd"
    assert P.default_runtime_dir({}, 1000) == "/tmp/ngramd-1000"
    assert P.default_runtime_dir({"RUNTIME_DIRECTORY": "/run/ngramd:/x",
                                  "XDG_RUNTIME_DIR": "/run/user/0"}, 0) == "/run/ngramd"


def test_a_socket_directory_others_can_write_to_is_refused(tmp_path):
    import os

    from ngramd.wire.errors import NgramError
    from ngramd.server import _check_socket_dir

    d = tmp_path / "sock"
    d.mkdir()
    os.chmod(d, 0o777)
    _check_socket_dir(d)  # ours: fine
    os.chmod(d, 0o1777)
    _check_socket_dir(d)  # sticky: fine whoever owns it
    if os.geteuid() == 0:
        os.chown(d, 12345, 12345)
        os.chmod(d, 0o777)
        with pytest.raises(NgramError, match="belongs to uid 12345"):
            _check_socket_dir(d)


def test_connect_refusal_tells_a_dead_endpoint_from_one_that_may_answer(tmp_path, monkeypatch):
    """One probe for the client (exit 4 at once) and the generator's link (down at once): a
    missing socket file, a stale one (a daemon killed -9) and a closed tcp port are refusals,
    named; a listening socket, an abstract one and inproc are not (only a round trip tells)."""
    import socket

    missing = tmp_path / "none.sock"
    assert P.connect_refusal(f"ipc://{missing}") == \
        f"socket file {missing} does not exist (is ngramd running?)"
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()
    assert P.connect_refusal(f"ipc://{stale}").startswith(f"nothing listens on {stale} (")
    live = tmp_path / "live.sock"
    with socket.socket(socket.AF_UNIX) as srv, socket.socket() as tcp:
        srv.bind(str(live))
        srv.listen()
        tcp.bind(("127.0.0.1", 0))
        tcp.listen()
        port = tcp.getsockname()[1]
        assert P.connect_refusal(f"ipc://{live}") is None
        assert P.connect_refusal(f"tcp://127.0.0.1:{port}") is None
    assert P.connect_refusal(f"tcp://127.0.0.1:{port}") == f"nothing listens on 127.0.0.1:{port}"
    for maybe in ("ipc://@ngramd-abstract", "inproc://x", "tcp://127.0.0.1:notaport"):
        assert P.connect_refusal(maybe) is None, maybe

    def denied(self, address):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(socket.socket, "connect", denied)  # root here: no real EACCES
    assert P.connect_refusal(f"ipc://{live}") == \
        f"no permission to connect to {live} (is this user in the daemon's group?)"
