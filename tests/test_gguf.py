"""The tokenizer of a GGUF file, read without transformers (``ngramd.wire.gguf``), is the tokenizer
transformers builds from it: the same fingerprint and the same ids, so a table made from a GGUF
model's file admits a generator running that model (issue 19: ``ngramd --tokenizer X.gguf``
failed with "is not JSON")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ngramd.wire import gguf
from ngramd.wire.errors import BadInput
from ngramd.wire.identity import (fingerprint_json, open_tokenizer, tokenizer_file,
                             tokenizer_fingerprint, tokenizer_json)

gguf_writer = pytest.importorskip("gguf", reason="the gguf package (generator extra) writes "
                                  "the test files")
transformers_gguf = pytest.importorskip(
    "transformers.integrations.gguf.gguf_tokenizer_mapping",
    reason="transformers (generator extra) is the reference")

TEXT = ("the thing is in the ring <|im_start|>user\nthinking <think> of €5 and 12345\n\n"
        "  the\tend<|endoftext|>")


def _byte_alphabet() -> list[str]:
    return list(gguf._bytes_to_unicode().values())


def write_gguf(path, pre: str | None, *, merges: bool = True) -> None:
    """A small byte-level BPE GGUF file: the 256 byte characters, a few merges, control and
    user-defined tokens, one token spelled outside the byte alphabet (respelled) and one
    control token outside it (which transformers leaves out)."""
    base = _byte_alphabet()
    merged = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("in", "g"), ("t", "h")]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + base + ["".join(m)
                                                                      for m in merged]
    tokens += ["<think>", "€", "<|控制|>"]
    types = [3, 3, 3] + [1] * (len(tokens) - 6) + [4, 1, 3]
    w = gguf_writer.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges:
        w.add_token_merges([" ".join(m) for m in merged])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def reference_json(path) -> dict:
    """What transformers builds from the file (the generator's tokenizer)."""
    m = transformers_gguf
    arch, tok, _ = m.get_gguf_tokenizer(str(path))
    backend, _ = m.convert_gguf_tokenizer(arch, tok)
    return json.loads(backend.to_str())


@pytest.mark.parametrize("pre", [None, "smollm", "qwen2", "llama-bpe", "qwen35", "gpt-4o",
                                 "tekken"])
def test_a_byte_level_gguf_tokenizer_matches_transformers(tmp_path, pre):
    from tokenizers import Tokenizer

    path = tmp_path / "m.gguf"
    write_gguf(path, pre)
    ours, ref = tokenizer_json(path), reference_json(path)
    assert fingerprint_json(ours) == fingerprint_json(ref)
    assert tokenizer_fingerprint(path) == fingerprint_json(ref)
    got = open_tokenizer(path).encode(TEXT, add_special_tokens=False).ids
    want = Tokenizer.from_str(json.dumps(ref)).encode(TEXT, add_special_tokens=False).ids
    assert got == want and len(got) > 10


def test_every_pre_tokenizer_split_transformers_knows_is_ours_too():
    """A ``tokenizer.ggml.pre`` transformers splits with a regex of its own, and this module
    did not, would give another tokenizer: the tables must agree entry for entry."""
    theirs = transformers_gguf.GGUF_PRE_TOKENIZER_SPLITS
    assert {k: gguf.PRE_TOKENIZER_SPLITS.get(k) for k in theirs} == dict(theirs)


def test_a_model_directory_names_its_gguf_and_bad_files_are_refused_clearly(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    write_gguf(d / "m.gguf", "qwen2")
    assert tokenizer_file(d) == d / "m.gguf"
    assert tokenizer_fingerprint(d) == tokenizer_fingerprint(d / "m.gguf")
    write_gguf(d / "n.gguf", "qwen2")
    with pytest.raises(BadInput, match="several .gguf files"):
        tokenizer_file(d)
    raw = (d / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(raw[:len(raw) // 2])
    with pytest.raises(BadInput, match="truncated"):
        tokenizer_json(tmp_path / "cut.gguf")
    (tmp_path / "text.gguf").write_text("not a gguf file\n")
    with pytest.raises(BadInput, match="not a GGUF file"):
        tokenizer_json(tmp_path / "text.gguf")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadInput, match="no tokenizer.json and no .gguf file"):
        tokenizer_file(tmp_path / "empty")


def test_ngram_client_tokenizer_writes_a_file_with_the_models_fingerprint(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama-bpe")
    out = subprocess.run([sys.executable, "-m", "ngram_client.cli", "tokenizer", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    (tmp_path / "tokenizer.json").write_text(out.stdout)
    fp = fingerprint_json(reference_json(path))
    assert tokenizer_fingerprint(tmp_path / "tokenizer.json") == fp and fp in out.stderr
    bad = subprocess.run([sys.executable, "-m", "ngram_client.cli", "tokenizer",
                          str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "not found" in bad.stderr and bad.stdout == ""


def test_ngramd_check_config_takes_a_gguf_tokenizer(tmp_path):
    """``ngramd --tokenizer X.gguf`` (here through --check-config, which resolves the
    tokenizer as the daemon does) prints the fingerprint the generator will prove."""
    path = tmp_path / "m.gguf"
    write_gguf(path, "qwen2")
    out = subprocess.run([sys.executable, "-m", "ngramd.service", "--check-config",
                          "--tokenizer", str(path), "--runtime-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert fingerprint_json(reference_json(path)) in out.stdout
