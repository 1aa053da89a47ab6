"""Client of ``ngramd`` (import name ``ngram_client``): ``NgramClient`` and its exceptions.

    from ngram_client import NgramClient
    with NgramClient("ipc:///run/ngramd/qwen3.sock") as c:
        c.ingest([tokens])
        drafts = c.draft([context], max_len=8)
"""

from ngramd.wire.errors import IdentityMismatch, TooLarge

from .client import DaemonError, DaemonUnavailable, Draft, DraftResult, NgramClient, Timeout

__all__ = ["NgramClient", "Draft", "DraftResult", "DaemonError", "DaemonUnavailable", "Timeout",
           "IdentityMismatch", "TooLarge"]
