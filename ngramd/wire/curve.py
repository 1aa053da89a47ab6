"""CurveZMQ key files, loaded one way for the daemon and the client, and the keys a client
socket uses (``client_keys``).

Key files are pyzmq's certificate format, as ``ngramd keygen`` writes them: ``NAME.key`` (the
public key) and ``NAME.key_secret`` (both keys, mode 600).  Imports zmq only (the client
loads this module).
"""

from __future__ import annotations

import logging
import os

from .errors import BadInput, NgramError

log = logging.getLogger("ngramd.curve")


def load_key_file(path: str, what: str, *, secret: bool = False,
                  error: type[NgramError] = NgramError) -> tuple[bytes, bytes | None]:
    """``(public, secret)`` keys of the key file ``path``; ``what`` names it in messages
    (``curve_secret_key``, ``client key``, ...).  With ``secret=True`` the file must hold the
    secret key too (a ``.key_secret`` file), and one readable by others is warned about.
    Raises ``error`` (the daemon: ``NgramError``, a config problem; the client: ``BadInput``)
    saying which file and why."""
    import zmq.auth

    if not os.path.isfile(path):  # pyzmq would say "Invalid certificate file"
        raise error(f"{what} {path}: no such file")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except OSError as e:
        raise error(f"{what} {path}: cannot read it ({e.strerror or e})") from None
    except ValueError:  # no key in it, or a malformed one
        raise error(f"{what} {path}: not a CurveZMQ key file (`ngramd keygen` writes "
                    f"them)") from None
    if secret:
        if secret_key is None:
            raise error(f"{what} {path} holds no secret key: give the .key_secret file "
                        f"`ngramd keygen --name NAME` wrote")
        try:
            if os.stat(path).st_mode & 0o007:
                log.warning("%s %s is readable by others: chmod 600 it", what, path)
        except OSError:
            pass
    return public, secret_key


def client_keys(endpoint: str, server_key: str | None, client_key: str | None):
    """``(server public, client public, client secret)`` for a ``tcp://`` endpoint given the
    server's key file, else None (ipc is never encrypted; a plain tcp client is allowed for a
    daemon run with ``insecure = true``).  Without a client key file a fresh key pair is
    made: enough for a daemon that admits any client knowing its key."""
    if not endpoint.startswith("tcp://"):
        return None
    if not server_key:
        if client_key:
            raise BadInput("a client key needs the daemon's public key too (server_key, "
                           "--server-key or NGRAM_SERVER_KEY)")
        return None
    import zmq

    server_public, _ = load_key_file(server_key, "server key", error=BadInput)
    if not client_key:
        return (server_public, *zmq.curve_keypair())
    public, secret = load_key_file(client_key, "client key", secret=True, error=BadInput)
    return server_public, public, secret
