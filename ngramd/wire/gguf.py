"""The tokenizer inside a GGUF file, as a tokenizer.json, without the gguf or transformers packages.

A GGUF file (llama.cpp's format) has no tokenizer.json: it stores the vocabulary, the merges
and the token types as metadata under llama.cpp's key names (``tokenizer.ggml.*``).  A table
records the fingerprint of the tokenizer a generator uses (``ngramd.wire.identity``), and a
generator that loads a GGUF model gets its tokenizer from ``transformers``, which builds one
from that metadata.  So a daemon given the same GGUF file must build the *same* tokenizer, or
the fingerprints differ and every generator is refused.

The daemon's install has neither ``transformers`` nor ``gguf`` (no torch beside ngramd), so
this module reads the metadata itself (:func:`read_metadata`: the header and key-value section
only, never a tensor) and rebuilds the byte-level BPE tokenizer (``tokenizer.ggml.model =
"gpt2"``: SmolLM2, Qwen2/2.5/3, Llama 3 and most recent models) the way transformers 5.24 does
(``transformers/integrations/gguf/gguf_tokenizer_mapping.py``: ``byte_level_tokenizer``,
``add_gguf_special_tokens``, ``set_split_regex``), with the ``tokenizers`` package.
``tests/test_identity.py`` checks that the fingerprints and the ids agree with transformers'
on the embedded SmolLM2 file and on small GGUF files of every pre-tokenizer in its table.

Other tokenizer types (sentencepiece ``llama``, ``t5``, Gemma's) are handed to transformers
when it is installed (the generator's extra), and refused with what to do when it is not.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

from .errors import BadInput

#: the GGUF versions read here (v1 counted in 32 bits; no file in use still has it)
VERSIONS = (2, 3)
#: fixed-size value types of the metadata section: struct format per type id
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
#: llama.cpp's token types (``tokenizer.ggml.token_type``)
CONTROL, USER_DEFINED = 3, 4

# The pre-tokenizer splits transformers 5.24 applies per ``tokenizer.ggml.pre`` (its
# ``GGUF_PRE_TOKENIZER_SPLITS``, Apache-2.0); a type not listed keeps GPT-2's ByteLevel regex,
# as there.  tests/test_identity.py fails when transformers lists a type this table lacks.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3),
    "tekken": _TEKKEN,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2),
    "qwen35": _QWEN35,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
}


def is_gguf(path: Path) -> bool:
    """True when ``path`` is a file that starts with the GGUF magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def read_metadata(path: str | Path, string_arrays: tuple = ()) -> dict:
    """The metadata section of a GGUF file as a dict (no tensor is read).  Arrays of strings
    are returned in full only for the keys in ``string_arrays`` (a vocabulary is 50-250k
    strings), others as their length; arrays of numbers always in full."""
    p = Path(path)
    try:
        with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            return _Reader(blob, p, frozenset(string_arrays)).metadata()
    except (OSError, ValueError) as e:
        raise BadInput(f"cannot read GGUF file {p}: {e}") from None


class _Reader:
    """A cursor over the mapped file; every read is bounds-checked by ``struct``."""

    def __init__(self, blob, path: Path, keep: frozenset):
        self.blob, self.path, self.keep, self.pos = blob, path, keep, 0

    def _unpack(self, fmt: str):
        try:
            v = struct.unpack_from(fmt, self.blob, self.pos)
        except struct.error:
            raise BadInput(f"{self.path}: truncated GGUF metadata at byte {self.pos}") from None
        self.pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        if self.pos + n > len(self.blob):
            raise BadInput(f"{self.path}: truncated GGUF string at byte {self.pos}")
        raw = self.blob[self.pos:self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def _value(self, kind: int, keep: bool):
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])[0]
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise BadInput(f"{self.path}: GGUF value of unknown type {kind}")
        elem, count = self._unpack("<IQ")
        if elem in _SCALARS:
            fmt = _SCALARS[elem]
            return list(self._unpack(f"<{count}{fmt[1]}"))
        if elem != _STRING:
            raise BadInput(f"{self.path}: GGUF array of type {elem} is not supported")
        if keep:
            return [self._string() for _ in range(count)]
        for _ in range(count):
            (n,) = self._unpack("<Q")
            self.pos += n
        return count

    def metadata(self) -> dict:
        if self.blob[:4] != b"GGUF":
            raise BadInput(f"{self.path} is not a GGUF file (no GGUF magic bytes)")
        self.pos = 4
        version, _tensors, n_kv = self._unpack("<IQQ")
        if version not in VERSIONS:
            raise BadInput(f"{self.path}: GGUF version {version} (read: {VERSIONS})")
        out = {}
        for _ in range(n_kv):
            key = self._string()
            (kind,) = self._unpack("<I")
            out[key] = self._value(kind, key in self.keep)
        return out


def tokenizer_json(path: str | Path) -> dict:
    """The tokenizer of a GGUF file as a parsed tokenizer.json (module doc): byte-level BPE
    files are converted here; other types through transformers when it imports."""
    p = Path(path)
    meta = read_metadata(p, ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    kind = meta.get("tokenizer.ggml.model")
    if kind is None or not isinstance(meta.get("tokenizer.ggml.tokens"), list):
        raise BadInput(f"{p}: the GGUF file holds no tokenizer (no tokenizer.ggml.model/tokens)")
    if kind == "gpt2" and isinstance(meta.get("tokenizer.ggml.merges"), list):
        return json.loads(_byte_level(meta).to_str())
    return _via_transformers(p, kind)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (as in transformers and tiktoken)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _byte_level(meta: dict):
    """A ``tokenizers.Tokenizer`` for a ``gpt2`` GGUF vocabulary, built as transformers builds
    it: tokens not spelled in the byte alphabet are respelled byte by byte, the merges as
    given, control tokens (and the bos/eos/unk/pad tokens the file names) added as special,
    user-defined ones as plain added tokens, and the split regex of the file's pre-tokenizer."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {}
    for i, t in enumerate(tokens):
        # a later duplicate wins, as in transformers' dict comprehension
        vocab[t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))] = i
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                               continuing_subword_prefix="", end_of_word_suffix=""))
    split = PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or []
    named = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown",
                                                                 "padding")]
    special = {i for i in named if isinstance(i, int) and 0 <= i < len(tokens)}
    special |= {i for i, k in enumerate(types) if k == CONTROL and set(tokens[i]) <= alphabet}
    tok.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True)
                            for i in sorted(special)])
    plain = [i for i, k in enumerate(types) if k == USER_DEFINED and tokens[i] in vocab]
    tok.add_tokens([AddedToken(tokens[i], normalized=False, special=False) for i in plain])
    return tok


def _via_transformers(path: Path, kind) -> dict:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise BadInput(
            f"{path}: its tokenizer ({kind!r}) is converted by transformers, which is not "
            f"installed here; run `ngram-client tokenizer {path} > tokenizer.json` where the "
            f"generator is installed (pip install 'flash-nest[generator]') and give that "
            f"tokenizer.json instead") from None
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return json.loads(tok.backend_tokenizer.to_str())
    except Exception as e:  # transformers' own errors: unsupported type, broken file
        raise BadInput(f"{path}: transformers cannot build its tokenizer: {e}") from None
