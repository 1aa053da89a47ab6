"""Error codes of Flash Nest, defined once and shared by the daemon, the client and the tools.

Every error reply on the wire carries one of the ``code`` strings below; they are stable (clients
and dashboards match on them), the human message is not.  In-process APIs raise the matching
exception class; ``BadInput`` is also a ``ValueError`` so callers can catch it the usual way.
"""

from __future__ import annotations

# stable codes ---------------------------------------------------------------------------------
BAD_INPUT = "bad_input"  # wrong dtype/width, ids out of range, empty or oversized batches, ...
MALFORMED = "malformed"  # frames that are not a valid request (garbage, truncated msgpack)
UNKNOWN_OP = "unknown_op"
VERSION = "version"  # protocol version the daemon does not speak
TOO_LARGE = "too_large"  # message or batch above the configured limits
IDENTITY = "identity_mismatch"  # table identity / tokenizer fingerprint differs
STORAGE = "storage"  # RocksDB / disk errors (disk full, I/O error)
UNAVAILABLE = "unavailable"  # daemon down or not answering
TIMEOUT = "timeout"
INTERNAL = "internal"  # a bug: logged with a traceback on the daemon side
#: the ingest log's backlog is over its bound: resend the same request (same dedup key) after
#: the reply's ``retry_ms``; nothing of it was written
BUSY = "busy"

ALL_CODES = (
    BAD_INPUT, MALFORMED, UNKNOWN_OP, VERSION, TOO_LARGE, IDENTITY, STORAGE, UNAVAILABLE,
    TIMEOUT, INTERNAL, BUSY,
)


class NgramError(Exception):
    """Base class of every error Flash Nest raises on purpose; ``code`` is one of the above."""

    code = INTERNAL

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class BadInput(NgramError, ValueError):
    code = BAD_INPUT


class TooLarge(BadInput):
    code = TOO_LARGE


class IdentityMismatch(NgramError):
    code = IDENTITY


class StorageError(NgramError):
    code = STORAGE


def error_for(code: str, message: str) -> NgramError:
    """The exception class that matches a wire error code (used by the client)."""
    cls = {BAD_INPUT: BadInput, TOO_LARGE: TooLarge, IDENTITY: IdentityMismatch,
           STORAGE: StorageError}.get(code, NgramError)
    return cls(message, code)
