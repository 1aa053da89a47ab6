"""The converted-checkpoint cache of GGUF models: a GGUF file is converted once, then read as a
Hugging Face safetensors directory.

transformers loads a GGUF file by converting it: the embedded SmolLM2-135M-Instruct (Q4_1)
takes ~17 s on the 2-core dev VM, nearly all of it transformers' GGUF machinery (the metadata
parsed three times, a tensor-name map built ~400 times), not the weights.  The same model
written as a safetensors directory loads in 0.3 s.  So :func:`ngram_generator.model.load_model`
writes the converted checkpoint on a GGUF's first load and reads it on later loads of the same
file:

* **where** -- ``$NGRAM_MODEL_CACHE`` when set, else the ``models`` directory of Flash Nest's
  cache (``ngramd.wire.identity.cache_dir``, shared with the daemon's tokenizer fingerprints):
  ``$CACHE_DIRECTORY/models`` (systemd's ``CacheDirectory=``), else
  ``$XDG_CACHE_HOME/flash-nest/models`` (``~/.cache/flash-nest/models``).  One directory per
  entry, named after the GGUF file and its key.
* **size** -- the weights as transformers dequantises them, fp32: 517 MB for SmolLM2-135M
  (4 bytes a parameter; the GGUF itself is 92 MB).  The dtype a load asks for is applied when
  the entry is read, as it is when a GGUF is read.
* **off** -- ``NGRAM_MODEL_CACHE=off`` (or ``0``, ``no``, ``false``), ``ngram-generate
  --no-model-cache``, ``load_model(model_cache=False)``.  A model whose weights transformers
  keeps packed in their GGUF blocks (``GgufLinear``, with the ``kernels`` package on a device its
  kernels read) is never written (:func:`save_hf` refuses it, logged): a dequantised copy would
  be another model.  It used to be off whenever ``kernels`` was installed; transformers 5.25
  requires that package, and on a CPU it still dequantises every weight (checked: SmolLM2 loads
  with no packed module, all float32), so the check is of the model, not of the package.
* **key** -- the GGUF's resolved path, size, mtime (ns) and inode, the transformers version and
  :data:`FORMAT_VERSION`: a file changed or replaced in place misses, and writing its new entry
  removes the older ones of the same path (same transformers, same format).
* **atomic** -- an entry is written into a temporary directory beside it and renamed into place
  last, with a manifest (:data:`MANIFEST`: the key and the weights' size) written before the
  rename; so a crash, or two generators converting at once, never leave a half entry under an
  entry's name (the second rename finds the first's entry and drops its own copy).  Loads of
  the same file that miss at the same time convert it once: each takes an exclusive
  ``flock`` on the entry's lock file (:func:`converting`) and looks again once it holds it, so
  the second finds the first's entry (generators started together on a host, or test
  workers; a conversion is ~20 s of CPU and ~1 GB of memory for SmolLM2).  An entry
  whose manifest is missing or disagrees, whose weights have another size (truncated), or which
  fails to load is ignored (logged), converted again and replaced -- never a failed load.
* **failures** -- a cache that cannot be written (read-only, full disk) logs a warning and the
  model loads from the GGUF as without a cache.

Nothing else of ours is imported here (``model`` and ``export`` import this module).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from ngramd.wire.identity import cache_dir

log = logging.getLogger(__name__)

#: the environment variable naming the cache directory (or turning it off)
ENV = "NGRAM_MODEL_CACHE"
OFF = frozenset({"off", "0", "no", "false"})
#: bumped when what an entry holds or how it is written changes: older entries then miss
FORMAT_VERSION = 1
#: the manifest file of an entry, written last before the rename
MANIFEST = "flash-nest-entry.json"
WEIGHTS = "model.safetensors"
#: a temporary directory older than this is a crashed writer's and is removed
STALE_TMP_S = 3600


def cache_root(enabled: bool | None = None) -> Path | None:
    """The cache directory, or None when the cache is off (module doc): ``enabled=False``,
    ``$NGRAM_MODEL_CACHE`` off, or no home directory."""
    env = os.environ.get(ENV, "").strip()
    if enabled is False or env.lower() in OFF:
        return None
    return Path(env).expanduser() if env else cache_dir("models")


def source_key(gguf: Path) -> dict[str, Any]:
    """What an entry is valid for: the GGUF's resolved path and stat, the transformers
    version and the format (module doc)."""
    import transformers

    path = gguf.resolve()
    st = path.stat()
    return {"format": FORMAT_VERSION, "transformers": transformers.__version__,
            "gguf": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "inode": st.st_ino}


def entry_dir(root: Path, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return root / f"{Path(key['gguf']).stem}-{digest}"


def valid_entry(entry: Path, key: dict[str, Any]) -> bool:
    """True when ``entry`` holds a complete conversion for ``key``: its manifest matches and
    its weights have the size the manifest recorded.  A missing entry is False quietly; a
    damaged one is False with a log line."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        if entry.exists():
            log.warning("model cache entry %s has no manifest: ignored, converting again", entry)
        return False
    except (OSError, ValueError) as e:
        log.warning("model cache entry %s: unreadable manifest (%s): ignored", entry, e)
        return False
    try:
        files_ok = all((entry / f).stat().st_size == n for f, n in manifest["files"].items())
    except (OSError, KeyError, AttributeError, TypeError):
        files_ok = False
    if manifest.get("key") != key or not files_ok:
        log.warning("model cache entry %s is incomplete or stale: ignored, converting again",
                    entry)
        return False
    return True


def convert(directory: str, gguf: str | None, attn: str | None = None):
    """``(model, tokenizer)`` as transformers reads the checkpoint, in fp32 on the CPU: the
    conversion the cache keeps and :func:`ngram_generator.export.export_hf` writes."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    extra = {"gguf_file": gguf} if gguf else {}
    tokenizer = AutoTokenizer.from_pretrained(directory, **extra)
    if attn:
        extra["attn_implementation"] = attn
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **extra)
    return model, tokenizer


def save_hf(model, tokenizer, out: Path) -> None:
    """Write ``model`` (a converted GGUF's, or any transformers causal LM) and its tokenizer
    into ``out`` as a Hugging Face safetensors directory: weights, config, generation config,
    tokenizer files.  ``model`` is changed: the GGUF quantizer transformers attached (its
    weights are dequantised) and its ``quantization_config`` are dropped, because
    ``save_pretrained`` refuses a GGUF model and the written checkpoint is a plain one."""
    if packed_modules(model):
        raise ValueError("the model keeps GGUF weights packed: it has no plain checkpoint")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def packed_modules(model) -> list[str]:
    """Names of the modules that hold GGUF blocks rather than plain weights."""
    return [n for n, m in model.named_modules()
            if type(m).__module__.startswith("transformers.integrations.gguf")]


@contextlib.contextmanager
def converting(root: Path, key: dict[str, Any], wait_s: float = 600.0):
    """Held while this process converts and writes the entry for ``key``: an exclusive
    ``flock`` on ``root/.lock-<entry name>``, waited for up to ``wait_s`` (another process
    converting the same file; the caller then looks for its entry again).  Where the lock
    cannot be taken (the cache not writable, a lock file that cannot be made, a holder past
    ``wait_s``) it yields all the same: the conversion goes on unserialised, as it would
    without this lock (:func:`reserve` and the rename keep that safe)."""
    import fcntl

    lock = root / f".lock-{entry_dir(root, key).name}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    log.warning("model cache: %s still held after %.0f s; converting "
                                "without it", lock, wait_s)
                    break
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)  # releases the lock


def reserve(root: Path, key: dict[str, Any]) -> Path | None:
    """A new temporary directory in ``root`` to write the entry for ``key`` into (made before
    the conversion, so an unwritable cache costs no conversion); None after a warning when it
    cannot be made."""
    tmp = root / f".tmp-{entry_dir(root, key).name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale(root)
        tmp.mkdir()
    except OSError as e:
        log.warning("model cache: cannot write in %s (%s); loading from the GGUF file, "
                    "uncached", root, e)
        return None
    return tmp


def write_entry(tmp: Path, key: dict[str, Any], model, tokenizer) -> Path | None:
    """Write the converted ``model`` and ``tokenizer`` into ``tmp`` (from :func:`reserve`) and
    publish it as the entry for ``key`` (atomically, module doc); the entry, or None after a
    warning when it cannot be written."""
    root = tmp.parent
    entry = entry_dir(root, key)
    t0 = time.perf_counter()
    try:
        save_hf(model, tokenizer, tmp)
        files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
        (tmp / MANIFEST).write_text(json.dumps({"key": key, "files": files}, indent=1),
                                    encoding="utf-8")
        _publish(tmp, entry, key)
    except (OSError, ValueError) as e:
        log.warning("model cache: cannot write %s (%s); loading from the GGUF file, uncached",
                    entry, e)
        remove_dir(tmp)
        return None
    mb = sum(p.stat().st_size for p in entry.iterdir()) / 1e6
    log.info("model cache: wrote %s (%.0f MB, %.1f s)", entry, mb, time.perf_counter() - t0)
    _remove_superseded(root, entry, key)
    return entry


def _publish(tmp: Path, entry: Path, key: dict[str, Any]) -> None:
    """Rename ``tmp`` to ``entry``; an invalid entry already there is moved aside first, a
    valid one (another process's, just written) is kept and ``tmp`` dropped."""
    if entry.exists():
        if valid_entry(entry, key):
            remove_dir(tmp)
            return
        remove_dir(entry)
    try:
        os.rename(tmp, entry)
    except OSError:
        if not valid_entry(entry, key):  # lost a race to a writer whose entry is broken
            raise
        remove_dir(tmp)


def remove_dir(path: Path) -> None:
    """Remove a directory: renamed aside first, so no reader meets it half removed."""
    aside = path.with_name(f".tmp-removed-{path.name}-{uuid.uuid4().hex[:8]}")
    with contextlib.suppress(OSError):
        os.rename(path, aside)
        shutil.rmtree(aside, ignore_errors=True)


def _remove_stale(root: Path) -> None:
    """Temporary directories of writers that died (older than STALE_TMP_S)."""
    now = time.time()
    for p in root.glob(".tmp-*"):
        with contextlib.suppress(OSError):
            if now - p.stat().st_mtime > STALE_TMP_S:
                shutil.rmtree(p, ignore_errors=True)


def _remove_superseded(root: Path, entry: Path, key: dict[str, Any]) -> None:
    """Older entries of the same GGUF path, format and transformers: the file changed since."""
    same = {k: key[k] for k in ("format", "transformers", "gguf")}
    for other in root.iterdir():
        if other == entry or other.name.startswith("."):
            continue
        try:
            old = json.loads((other / MANIFEST).read_text(encoding="utf-8"))["key"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(old, dict) and {k: old.get(k) for k in same} == same:
            log.info("model cache: removed %s (its GGUF file changed)", other)
            remove_dir(other)
