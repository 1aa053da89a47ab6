"""The wire protocol between ``ngramd`` and its clients: one module, imported by both sides.

Transport: ZeroMQ multipart messages; the daemon binds a ROUTER, clients connect DEALERs and may
pipeline any number of requests (replies can come back out of order, matched by ``id``).

Request ``[header, *frames]``
    ``header`` is a msgpack map of at most ``MAX_HEADER_BYTES``::

        {"v": 1, "op": "draft", "id": 17, ...op fields}

    An op with a ``blob`` field (``save_policy``: opaque bytes up to 1 MiB) may send up to
    ``MAX_BLOB_HEADER_BYTES``, as a map of at most ``MAX_BIG_HEADER_FIELDS`` fields whose
    values are all scalars (``decode_request`` checks that before unpacking: a 1 MiB header of
    nested empty lists took 164 ms to unpack, a 1 MiB bin 0.1 ms).

    Ops that take token sequences (``draft``, ``lookup``, ``ingest``) send them as exactly two
    raw frames after the header (ARCHITECTURE §6: never pickle, no msgpack lists of tokens,
    which cost hundreds of µs a round trip: §13)::

        tokens   all sequences concatenated, little-endian uint32 (4 bytes a token)
        offsets  B + 1 bounds, little-endian int64: sequence i is tokens[offsets[i]:offsets[i+1]]

    A header may say ``"dtype": "<u4"``; any other declared dtype is refused.

Reply ``[header]`` or ``[header, data]``
    ``{"v": 1, "id": 17, "ok": true, ...fields, "arrays": [[name, dtype, shape], ...]}``
    and, when ``arrays`` is present, ONE raw frame holding them all, little-endian, in that
    order, each starting at a multiple of 8 bytes (zero padding), so the client reads them as
    aligned zero-copy views.  One frame, not one per array: every frame costs ~10 µs a round
    trip here (a draft reply has five arrays: 75 µs as frames, 25 µs joined).
    Errors: ``{"v": 1, "id": 17 or None, "ok": false, "code": <errors.py code>, "msg": str}``.

A REQ socket may talk to the daemon too: its empty delimiter frame is kept in the envelope and
echoed.  Ops, their fields, frames and replies are declared in ``commands.py`` (``OPS`` here
is derived from it); the README repeats them for humans.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any, Sequence

import msgpack
import numpy as np

from .commands import COMMANDS
from .errors import BAD_INPUT, MALFORMED, TOO_LARGE, UNKNOWN_OP, VERSION, BadInput, NgramError, TooLarge
from .validate import as_batch, as_offsets, as_tokens

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 64 << 10  # a header is a few hundred bytes; this bounds msgpack's work
#: ops with a ``blob`` field: their header may be larger (module doc), by their largest blob
BLOB_OPS = frozenset(n for n, c in COMMANDS.items() if any(f.kind == "blob" for f in c.fields))
MAX_BLOB_HEADER_BYTES = MAX_HEADER_BYTES + max(
    (int(f.hi) for c in COMMANDS.values() for f in c.fields if f.kind == "blob"), default=0)
MAX_BIG_HEADER_FIELDS = 64
MAX_FRAMES = 8  # header + at most two array frames today; slack for future ops
TOKEN_DTYPE = "<u4"
OFFSET_DTYPE = "<i8"
KEY_DTYPE = "<u8"
# dtypes a reply may carry (a client never builds arrays of types it did not expect); parsed
# once: np.dtype("<u4") per frame costs more than the frame itself for a small reply
REPLY_DTYPES = {s: np.dtype(s) for s in ("<u1", "<u4", "<i4", "<i8", "<u8", "<f4", "<f8")}
_U32 = np.dtype(np.uint32)

#: op -> (takes a token batch, safe to resend after a timeout), derived from the one
#: declaration of each op in ``commands.py`` (its fields, frames and reply arrays).
#: ``ingest`` and ``report`` add counts, so a blind resend could count twice: clients never
#: retry them (see client.py).
OPS: dict[str, tuple[bool, bool]] = {n: (c.batch, c.idempotent) for n, c in COMMANDS.items()}
IDEMPOTENT = frozenset(op for op, (_, idem) in OPS.items() if idem)

_packer_opts = dict(use_bin_type=True)


def _unpack(raw) -> Any:
    # strict_map_key=False: report maps are keyed by order (int).  Sizes are bounded by the
    # frame (MAX_HEADER_BYTES), so msgpack's own limits (derived from the buffer) are enough.
    return msgpack.unpackb(raw, raw=False, strict_map_key=False, use_list=True)


@dataclass
class Request:
    """A decoded request.  ``tokens``/``offsets`` are zero-copy views of the frames (validated
    later, by ``batch``, against the table's vocab size and the server's limits)."""

    op: str
    id: Any
    header: dict
    frames: list = field(default_factory=list)

    def batch(self, vocab_size: int, *, max_batch: int, max_tokens: int,
              min_len: int = 1) -> tuple[np.ndarray, np.ndarray]:
        return unpack_batch(self.frames, vocab_size, max_batch=max_batch,
                            max_tokens=max_tokens, min_len=min_len,
                            dtype=self.header.get("dtype", TOKEN_DTYPE))


@dataclass
class Reply:
    id: Any
    ok: bool
    fields: dict
    arrays: dict


def default_runtime_dir(env=None, uid: int | None = None) -> str:
    """The directory of the default ipc socket: the same for the daemon and every client of
    one user, whatever their working directory (it was ``./var/run``: a client started
    elsewhere looked for another socket).

    ``$RUNTIME_DIRECTORY`` (systemd's ``RuntimeDirectory=``, first entry), else
    ``/run/ngramd`` for root (where the systemd unit puts it), else
    ``$XDG_RUNTIME_DIR/ngramd`` (per user, e.g. ``/run/user/1000/ngramd``), else
    ``/tmp/ngramd-<uid>``.  ``env``/``uid``: the environment and effective uid (tests)."""
    env = os.environ if env is None else env
    uid = os.geteuid() if uid is None else uid
    if env.get("RUNTIME_DIRECTORY"):
        return env["RUNTIME_DIRECTORY"].split(":")[0]
    if uid == 0:
        return "/run/ngramd"
    if env.get("XDG_RUNTIME_DIR"):
        return os.path.join(env["XDG_RUNTIME_DIR"], "ngramd")
    return f"/tmp/ngramd-{uid}"


def default_endpoint(name: str = "default", runtime_dir: str | None = None) -> str:
    """The ipc endpoint a daemon with default settings binds (``<runtime dir>/<table
    name>.sock``): the client's default as well, for the default table name (``--endpoint``
    and ``$NGRAMD_ENDPOINT`` override it on the client side)."""
    return f"ipc://{runtime_dir or default_runtime_dir()}/{name}.sock"


def connect_refusal(endpoint: str, timeout_s: float = 0.2) -> str | None:
    """Why nothing can accept a connection at ``endpoint``, found at once with a plain socket
    connect instead of after a client's ``tries x timeout``: a missing ipc socket file, nothing
    listening (a daemon that exited, killed or not), no permission.  None when something may be
    there: a daemon that is alive, if slow (the kernel accepts for it while it is stopped), a
    probe that timed out (``timeout_s``, seconds) or hit an unreachable network, and endpoints
    only a round trip can tell (a Linux abstract socket ``ipc://@name``, ``inproc://``).

    Used by ``ngram-client`` (exit 4 at once, naming the path) and by the generator's
    ``DaemonLink`` (a request that could not even be sent: dead daemon, or one kept from
    running?)."""
    scheme, _, rest = endpoint.partition("://")
    try:
        if scheme == "ipc" and not rest.startswith("@"):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout_s)
                s.connect(rest)
        elif scheme == "tcp":
            host, _, port = rest.rpartition(":")
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except FileNotFoundError:
        return f"socket file {rest} does not exist (is ngramd running?)"
    except ConnectionRefusedError:
        return f"nothing listens on {rest}" + (
            " (a daemon that exited without removing it?)" if scheme == "ipc" else "")
    except PermissionError:
        return f"no permission to connect to {rest} (is this user in the daemon's group?)"
    except (OSError, ValueError):  # a timeout, an unreachable network, a path too long for
        return None  # AF_UNIX, a malformed port: let ZeroMQ try and report
    return None


# ---------------------------------------------------------------------------------------------
# token batches
# ---------------------------------------------------------------------------------------------
def pack_batch(seqs: Sequence, vocab_size: int = 0xFFFFFFFF, *, max_batch: int = 1 << 30,
               max_tokens: int = 1 << 40) -> tuple[np.ndarray, np.ndarray]:
    """Client side: a list of token sequences -> ``(tokens uint32, offsets int64)``.

    Validation here is only what the wire needs (integers that fit uint32); the daemon checks
    the vocab size and its limits and answers ``bad_input``/``too_large``.
    """
    seqs = list(seqs)
    if vocab_size == 0xFFFFFFFF and seqs and all(
            type(s) is np.ndarray and s.dtype == _U32 and s.ndim == 1 and s.size for s in seqs):
        # fast path (generators pass uint32 arrays): any uint32 id fits the wire; ~3 µs, where
        # the general validation costs ~20 µs for one short context
        offsets = np.zeros(len(seqs) + 1, np.int64)
        np.cumsum([s.size for s in seqs], out=offsets[1:])
        return (seqs[0] if len(seqs) == 1 else np.concatenate(seqs)), offsets
    return as_batch(seqs, vocab_size, max_batch=max_batch, max_tokens=max_tokens)


def unpack_batch(frames: Sequence, vocab_size: int, *, max_batch: int, max_tokens: int,
                 min_len: int = 1, dtype: str = TOKEN_DTYPE) -> tuple[np.ndarray, np.ndarray]:
    """Server side: the two batch frames -> validated ``(tokens, offsets)`` without copying.

    Raises ``BadInput`` (wrong dtype or sizes, inconsistent offsets, ids >= vocab_size,
    sequences shorter than ``min_len``) or ``TooLarge`` (above ``max_batch``/``max_tokens``).
    """
    if dtype != TOKEN_DTYPE:
        raise BadInput(f"tokens must be little-endian uint32 ({TOKEN_DTYPE!r}), got {dtype!r}")
    if len(frames) != 2:
        raise BadInput(f"expected 2 frames (tokens, offsets), got {len(frames)}")
    tok_buf, off_buf = (_buffer(f) for f in frames)
    if off_buf.nbytes % 8 or off_buf.nbytes < 16:
        raise BadInput(f"offsets: expected >= 2 little-endian int64 (got {off_buf.nbytes} bytes)")
    offsets = np.frombuffer(off_buf, dtype=OFFSET_DTYPE)
    n_seq = offsets.size - 1
    if n_seq > max_batch:
        raise TooLarge(f"batch: {n_seq} sequences exceeds the limit of {max_batch}")
    if tok_buf.nbytes % 4:
        raise BadInput(f"tokens: raw bytes must be a multiple of 4 (got {tok_buf.nbytes})")
    n_tok = tok_buf.nbytes // 4
    if n_tok > max_tokens:
        raise TooLarge(f"batch: {n_tok} tokens exceeds the limit of {max_tokens}")
    offsets = as_offsets(offsets, n_tok, min_len=min_len)
    tokens = as_tokens(tok_buf, vocab_size, what="tokens")
    return tokens, offsets


def _buffer(frame) -> memoryview:
    """A zero-copy view of a zmq Frame, bytes or array."""
    buf = getattr(frame, "buffer", None)
    return memoryview(frame) if buf is None else buf


# ---------------------------------------------------------------------------------------------
# requests
# ---------------------------------------------------------------------------------------------
def encode_request(op: str, req_id: int, fields: dict | None = None,
                   batch: tuple[np.ndarray, np.ndarray] | None = None,
                   keys: np.ndarray | None = None) -> list:
    """Frames of one request; ``batch`` is ``pack_batch``'s ``(tokens, offsets)``; ``keys``
    (``report`` only) are the kernel keys of hot entries a generator drafted from, one raw
    little-endian uint64 frame."""
    head = {"v": PROTOCOL_VERSION, "op": op, "id": req_id}
    if fields:
        head.update(fields)
    frames = [msgpack.packb(head, **_packer_opts)]
    if batch is not None:
        tokens, offsets = batch
        frames += [_le(np.asarray(tokens, TOKEN_DTYPE)), _le(np.asarray(offsets, OFFSET_DTYPE))]
    if keys is not None:
        frames.append(_le(np.ascontiguousarray(keys, KEY_DTYPE)))
    return frames


def unpack_keys(frames: Sequence, max_keys: int) -> np.ndarray | None:
    """Server side: the optional keys frame of a ``report`` (None when absent)."""
    if not frames:
        return None
    if len(frames) != 1:
        raise BadInput(f"report: expected at most one keys frame, got {len(frames)}")
    buf = _buffer(frames[0])
    if buf.nbytes % 8:
        raise BadInput(f"report keys: raw bytes must be a multiple of 8 (got {buf.nbytes})")
    if buf.nbytes // 8 > max_keys:
        raise TooLarge(f"report: {buf.nbytes // 8} keys exceeds the limit of {max_keys}")
    return np.frombuffer(buf, KEY_DTYPE).astype(np.uint64)


def split_envelope(frames: list) -> tuple[list, list]:
    """ROUTER side: ``[identity, (b"" if REQ), header, ...]`` -> (envelope, body)."""
    if len(frames) > 1 and len(frames[1]) == 0:
        return frames[:2], frames[2:]
    return frames[:1], frames[1:]


def decode_request(body: list) -> Request:
    """Parse a request body (frames after the envelope).

    Raises ``NgramError`` with ``code`` malformed/version/unknown_op/too_large; ``err.req_id``
    carries the request id whenever the header was readable, so the error reply can name it.
    """
    if not body:
        raise _err(MALFORMED, "empty message: expected a msgpack header frame")
    raw = _buffer(body[0])
    big = raw.nbytes > MAX_HEADER_BYTES
    if big:
        head = _unpack_big(raw)
    else:
        try:
            head = _unpack(raw)
        except Exception as e:  # msgpack raises several types (ExtraData, ValueError, ...)
            raise _err(MALFORMED, f"header is not valid msgpack ({type(e).__name__})") from None
    if not isinstance(head, dict):
        raise _err(MALFORMED, f"header must be a map, got {type(head).__name__}")
    req_id = head.get("id")
    if not (isinstance(req_id, int) and not isinstance(req_id, bool)) and req_id is not None:
        raise _err(MALFORMED, "id must be an integer")
    if head.get("v") != PROTOCOL_VERSION:
        raise _err(VERSION, f"protocol version {head.get('v')!r} not supported "
                            f"(daemon speaks {PROTOCOL_VERSION})", req_id)
    op = head.get("op")
    if not isinstance(op, str) or op not in OPS:  # a list or map is unhashable: check the type
        if not isinstance(op, (str, bytes, int, float, bool, type(None))):
            op = type(op).__name__
        raise _err(UNKNOWN_OP, f"unknown op {str(op)[:64]!r}", req_id)
    if big and op not in BLOB_OPS:
        raise _err(TOO_LARGE, f"header of {raw.nbytes} bytes exceeds {MAX_HEADER_BYTES}", req_id)
    if len(body) > MAX_FRAMES:
        raise _err(MALFORMED, f"{len(body)} frames (at most {MAX_FRAMES})", req_id)
    if OPS[op][0] and len(body) != 3:
        raise _err(BAD_INPUT, f"{op}: expected header + tokens + offsets frames, "
                              f"got {len(body)} frames", req_id)
    return Request(op, req_id, head, body[1:])


#: first bytes of the msgpack types a header over ``MAX_HEADER_BYTES`` may hold: nil, bool,
#: bin, float, int, str (no array, map or ext: the cost of unpacking them is not bounded by size)
_SCALAR = frozenset([*range(0x00, 0x80), *range(0xa0, 0xc1), 0xc2, 0xc3, 0xc4, 0xc5, 0xc6,
                     *range(0xca, 0xd4), 0xd9, 0xda, 0xdb, *range(0xe0, 0x100)])
_MAP16, _MAP32 = 0xde, 0xdf


def _unpack_big(raw: memoryview) -> dict:
    """A header over ``MAX_HEADER_BYTES`` (module doc): a map of at most
    ``MAX_BIG_HEADER_FIELDS`` scalar fields, ``MAX_BLOB_HEADER_BYTES`` in all, read field by
    field with each value's type checked before it is unpacked; anything else is
    ``too_large`` (its id is not read)."""
    n = raw.nbytes
    why = (f"header of {n} bytes exceeds {MAX_HEADER_BYTES} (an op with a blob field may send "
           f"up to {MAX_BLOB_HEADER_BYTES}, as a map of at most {MAX_BIG_HEADER_FIELDS} scalar "
           f"fields)")
    if n > MAX_BLOB_HEADER_BYTES or not (0x80 <= raw[0] <= 0x8f or raw[0] in (_MAP16, _MAP32)):
        raise _err(TOO_LARGE, why)
    u = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=n)
    u.feed(raw)
    try:
        fields = u.read_map_header()
        if fields > MAX_BIG_HEADER_FIELDS:
            raise ValueError
        head = {}
        for _ in range(fields):
            if raw[u.tell()] not in _SCALAR:
                raise ValueError
            k = u.unpack()
            if raw[u.tell()] not in _SCALAR:
                raise ValueError
            head[k] = u.unpack()
    except Exception:  # a container, a truncated or invalid field: msgpack's own types
        raise _err(TOO_LARGE, why) from None
    if u.tell() != n:
        raise _err(TOO_LARGE, why)
    return head


# ---------------------------------------------------------------------------------------------
# replies
# ---------------------------------------------------------------------------------------------
def encode_reply(req_id, fields: dict | None = None, arrays: dict | None = None) -> list:
    """Frames of a success reply; ``arrays`` values travel as raw little-endian frames."""
    head = {"v": PROTOCOL_VERSION, "id": req_id, "ok": True}
    if fields:
        head.update(fields)
    if not arrays:
        return [msgpack.packb(head, **_packer_opts)]
    desc, parts, pos = [], [], 0
    for name, a in arrays.items():
        a = _le(np.asarray(a))
        if pos % 8:
            parts.append(bytes(8 - pos % 8))
            pos += 8 - pos % 8
        desc.append([name, "<" + a.dtype.str[1:], a.shape])  # "|u1" -> "<u1"
        parts.append(a)
        pos += a.nbytes
    head["arrays"] = desc
    return [msgpack.packb(head, **_packer_opts), b"".join(parts)]


def encode_error(req_id, code: str, msg: str, retry_ms: int | None = None) -> list:
    """An error reply; ``retry_ms``: when a resend may succeed (``busy``)."""
    head = {"v": PROTOCOL_VERSION, "id": req_id, "ok": False, "code": code, "msg": msg}
    if retry_ms is not None:
        head["retry_ms"] = int(retry_ms)
    return [msgpack.packb(head, **_packer_opts)]


def decode_reply(frames: list) -> Reply:
    """Parse a reply; arrays are zero-copy read-only views of the frames.  Raises ``NgramError``
    (malformed) for anything a daemon of this protocol version would not send."""
    if not frames:
        raise _err(MALFORMED, "empty reply")
    try:
        head = _unpack(_buffer(frames[0]))
    except Exception as e:
        raise _err(MALFORMED, f"reply header is not valid msgpack ({type(e).__name__})") from None
    if not isinstance(head, dict) or "ok" not in head:
        raise _err(MALFORMED, "reply header must be a map with 'ok'")
    if head.get("v") != PROTOCOL_VERSION:
        raise _err(VERSION, f"daemon speaks protocol {head.get('v')!r}, "
                            f"this client {PROTOCOL_VERSION}")
    arrays = {}
    desc = head.pop("arrays", None) or []
    if len(frames) != (2 if desc else 1):
        raise _err(MALFORMED, f"reply with {len(desc)} arrays has {len(frames)} frames")
    if desc:
        buf = _buffer(frames[1])
        pos = 0
        for name, dt, shape in desc:
            dtype = REPLY_DTYPES.get(dt)
            if dtype is None:
                raise _err(MALFORMED, f"reply array {name!r} has unexpected dtype {dt!r}")
            n = 1
            for d in shape:  # plain ints: np.prod costs ~7 µs a call
                n *= d
            pos += -pos % 8
            if n < 0 or pos + n * dtype.itemsize > buf.nbytes:
                raise _err(MALFORMED, f"reply array {name!r} {shape} overruns the data frame")
            arrays[name] = np.frombuffer(buf, dtype, n, pos).reshape(shape)
            pos += n * dtype.itemsize
    return Reply(head.get("id"), bool(head["ok"]), head, arrays)


# ---------------------------------------------------------------------------------------------
def _le(a: np.ndarray) -> np.ndarray:
    """``a`` as a C-contiguous little-endian array (no copy on little-endian hosts): its buffer
    is the raw frame."""
    if a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and np.little_endian is False):
        a = a.astype(a.dtype.newbyteorder("<"))
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def _err(code: str, msg: str, req_id=None) -> NgramError:
    e = NgramError(msg, code)
    e.req_id = req_id
    return e
