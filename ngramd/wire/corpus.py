"""Which files of a corpus are counted: one rule for ``ngramd warm`` and ``ngram-client ingest``.

Both take files and directories.  A directory is walked recursively in sorted order, skipping
hidden entries (names starting with ``.``: ``.git``, editor state).  Every file must be UTF-8
text (or a ``.npy`` array of token ids, one sequence per file):

* **binary** -- a NUL byte in its first ``SNIFF_BYTES``, as git and grep decide;
* **not UTF-8** -- any byte that does not decode (checked in 1 MiB reads, so memory stays flat).

Why refuse rather than decode with replacement characters (what ``ngramd warm`` used to do):
``/bin/ls`` went in as 118k tokens of NUL and U+FFFD contexts that only dilute the table, and a
file of another encoding is better converted than guessed at.

A file named on the command line that is not text is *refused*: the run counts nothing unless
told to skip it (``--skip-bad``), each such file named.  A file found by walking a directory
that is not text is *skipped* and counted in one summary line (a source tree holds many
``.pyc`` files; naming each one buried the summary).

``import ngramd.wire.corpus`` loads neither numba nor RocksDB (the client imports it).
"""

from __future__ import annotations

import codecs
import collections
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from .errors import BadInput

log = logging.getLogger("ngramd.corpus")

#: bytes read to decide that a file is binary (a NUL among them)
SNIFF_BYTES = 8192
#: files taken as token ids already (a 1-D integer array per file), not as text
IDS_SUFFIX = ".npy"


def refuse_reason(f: Path) -> str | None:
    """Why ``f`` is not text to count, or None when it is UTF-8 text (module doc)."""
    dec = codecs.getincrementaldecoder("utf-8")()
    done = 0
    try:
        with open(f, "rb") as fh:
            chunk = fh.read(SNIFF_BYTES)
            if b"\0" in chunk:
                return f"binary (a NUL byte in its first {SNIFF_BYTES} bytes)"
            while chunk:
                dec.decode(chunk)
                done += len(chunk)
                chunk = fh.read(1 << 20)
            dec.decode(b"", final=True)
    except UnicodeDecodeError:
        return f"not UTF-8 (an invalid byte at or after offset {done})"
    except OSError as e:
        return f"unreadable ({e.strerror})"
    return None


@dataclass
class Corpus:
    """The files of one run: ``files`` to count, in order; ``refused``: named on the command
    line but not text; ``skipped``: found in a directory but not text (``(path, reason)``)."""

    files: list[Path] = field(default_factory=list)
    refused: list[tuple[Path, str]] = field(default_factory=list)
    skipped: list[tuple[Path, str]] = field(default_factory=list)

    def skipped_summary(self) -> str:
        """One line for the files skipped in directories, by reason and suffix, e.g.
        ``29 files in directories are not text, skipped: 29 binary (.pyc 29)``; "" if none."""
        if not self.skipped:
            return ""
        kinds: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for f, why in self.skipped:
            kinds[why.split(" (")[0]][f.suffix or "no suffix"] += 1
        parts = [f"{sum(c.values())} {kind} ("
                 + ", ".join(f"{sfx} {n}" for sfx, n in c.most_common(4))
                 + (", ..." if len(c) > 4 else "") + ")" for kind, c in kinds.items()]
        return (f"{len(self.skipped)} file(s) in directories are not text, skipped: "
                + "; ".join(parts))

    def refusal(self, skip_bad: bool) -> str | None:
        """Log what is left out (each refused file by name, the skipped ones in one line, their
        names at debug level); return why the run must stop (refused files without
        ``skip_bad``), or None."""
        for f, why in self.refused:
            log.warning("%s: %s: %s", "skipped" if skip_bad else "refused", f, why)
        if self.skipped:
            log.info("%s", self.skipped_summary())
            for f, why in self.skipped:
                log.debug("skipped %s: %s", f, why)
        if self.refused and not skip_bad:
            names = ", ".join(str(f) for f, _ in self.refused[:5])
            # the kinds as the lines above name them: a binary file is "binary" in every line
            kinds = collections.Counter(why.split(" (")[0] for _, why in self.refused)
            said = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
            return (f"not counting anything: {len(self.refused)} file(s) are not text ({said}: "
                    f"{names}{', ...' if len(self.refused) > 5 else ''}); --skip-bad counts "
                    f"the others")
        return None


def collect(paths, *, check_text: bool = True) -> Corpus:
    """The corpus named by ``paths`` (files and directories, module doc).  ``BadInput`` for a
    path that does not exist.  ``check_text=False`` skips the UTF-8 check (a caller that has
    checked already)."""
    out = Corpus()
    for p in map(Path, paths):
        if p.is_dir():
            found, not_text = _walk(p), out.skipped
        elif p.is_file():
            found, not_text = [p], out.refused
        else:
            raise BadInput(f"no such file or directory: {p}")
        for f in found:
            why = _why_not(f, check_text)
            if why is None:
                out.files.append(f)
            else:
                not_text.append((f, why))
    return out


def _why_not(f: Path, check_text: bool) -> str | None:
    if f.suffix == IDS_SUFFIX or not check_text:
        return None
    return refuse_reason(f)


def _walk(root: Path):
    """Regular files under ``root``, recursively, in sorted order, hidden entries left out;
    symbolic links to directories are not followed (a link loop cannot hang a run)."""
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        for name in sorted(files):
            f = Path(d) / name
            if not name.startswith(".") and f.is_file():
                yield f


def text_blocks(f: Path, start: int, block_bytes: int):
    """Yield ``(end_offset, text)`` blocks of about ``block_bytes`` of a text file from byte
    ``start``, cut after a newline so a multi-byte character or a line is never split (offsets
    stay resumable); the reader of both ``ngram-client ingest`` and ``ngramd warm``.
    ``collect`` has checked that the bytes are UTF-8; a file changed since decodes with
    replacement characters rather than failing half way."""
    with open(f, "rb") as fh:
        fh.seek(start)
        pos = start
        carry = b""
        while True:
            chunk = fh.read(block_bytes)
            if not chunk:
                if carry:
                    yield pos + len(carry), carry.decode("utf-8", errors="replace")
                return
            data = carry + chunk
            cut = data.rfind(b"\n") + 1
            if cut == 0:  # no newline in the block: keep reading (bounded by the file)
                carry = data
                continue
            carry = data[cut:]
            pos += cut
            yield pos, data[:cut].decode("utf-8", errors="replace")


def load_ids(f: Path, vocab_size: int):
    """A ``.npy`` file of token ids (one 1-D integer array, never unpickled) as uint32;
    ``BadInput`` naming the file when it is anything else or holds ids outside the vocab."""
    import numpy as np

    try:
        a = np.load(f, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise BadInput(f"{f}: not a .npy array of token ids ({e})") from None
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise BadInput(f"{f}: expected a 1-D integer array of token ids")
    if a.size and (int(a.min()) < 0 or int(a.max()) >= vocab_size):
        raise BadInput(f"{f}: token ids outside 0..{vocab_size - 1}")
    return a.astype(np.uint32)
