"""A correctness fix for vLLM's CPU build that sampled speculative decoding needs.

vLLM's rejection sampler spreads each request's temperature, top-k and top-p over its draft
positions with ``expand_batch_to_tokens``, a Triton kernel that vLLM's CPU build replaces by a
C++ one taking int64 tensors (``vllm.utils.cpu_triton_utils._expand_kernel_impl``).  The
wrapper converts the float32 (and int32) buffers it is given to an int64 copy, the kernel fills
the copy, and the caller's buffer is never written: the sampler then divides the draft
positions' logits by uninitialised memory and filters them with garbage top-k/top-p (vLLM
issue #55005, open for 0.32).  Every proposer's sampled speculative decoding on the CPU is
then neither distributed as plain sampling nor accepted at the rate it should be; greedy is
not touched (it never expands).

:func:`apply` checks the CPU kernel on three values and, only where it is broken, replaces
the rejection sampler's ``expand_batch_to_tokens`` by the same arithmetic in torch.  It runs
as a vLLM general plugin (``vllm.general_plugins`` entry point ``flash_nest_cpu_expand``: every
vLLM process where this package is installed, whatever the proposer, so peers benchmarked
beside ngramd are fixed alike; ``VLLM_PLUGINS`` selects plugins) and again when the proposer
starts.  A vLLM whose kernel works, or that is not the CPU build, is left alone.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_FIXED = "_flash_nest_fixed"


def register() -> None:
    """vLLM's general-plugin entry point."""
    apply()


def apply() -> bool:
    """Fix vLLM's CPU ``expand_batch_to_tokens`` where it is broken; whether it is fixed now
    (False: not vLLM's CPU build, or its kernel works)."""
    try:
        import torch
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return False
        from vllm.v1.sample import rejection_sampler as rs
    except Exception:  # no vLLM here, or another layout: nothing to fix
        return False
    if getattr(rs.expand_batch_to_tokens, _FIXED, False):
        return True
    if not _kernel_broken(torch):
        return False
    rs.expand_batch_to_tokens = expand_batch_to_tokens
    log.warning("vLLM's CPU expand kernel leaves its float output unwritten (vLLM issue "
                "#55005): sampled speculative decoding would use uninitialised temperatures; "
                "its rejection sampler now expands them in torch")
    return True


def _kernel_broken(torch) -> bool:
    """Whether the CPU build's expand kernel fails to spread ``[0.8, 0.3]`` over 1 + 2 tokens
    (not written, or truncated to integers)."""
    try:
        from vllm.platforms import current_platform
        from vllm.utils import cpu_triton_utils as cpu_tl

        # the kernels as vLLM loads them (torch.ops._C): the build for this CPU (_C_AVX2,
        # _C_AVX512 or _C).  ``import vllm._C`` beside _C_AVX2 registers the library twice,
        # which aborts the process, and _C alone is AVX-512 code (SIGILL on an AVX2-only host)
        current_platform.import_kernels()

        out = torch.full((3,), -1.0)
        cpu_tl._expand_kernel_impl(out, torch.tensor([0.8, 0.3]),
                                   torch.tensor([1, 3], dtype=torch.int32), 0, 1)
    except Exception as e:  # the kernel moved or failed: say so, change nothing
        log.debug("vLLM's CPU expand kernel not checked: %s", e)
        return False
    return not torch.allclose(out, torch.tensor([0.8, 0.3, 0.3]))


def expand_batch_to_tokens(x, cu_num_tokens, num_tokens: int, replace_from=0, replace_to=0):
    """vLLM's ``expand_batch_to_tokens`` in torch: ``x[i]`` repeated over request ``i``'s
    tokens (``cu_num_tokens``: their cumulative counts), values equal to ``replace_from``
    replaced by ``replace_to``; ``num_tokens`` long, in ``x``'s dtype."""
    import torch

    counts = torch.diff(cu_num_tokens.to(torch.long),
                        prepend=torch.zeros(1, dtype=torch.long, device=x.device))
    out = torch.repeat_interleave(x, counts, output_size=num_tokens)
    if replace_from != replace_to:
        out = torch.where(out == replace_from, torch.tensor(replace_to, dtype=x.dtype), out)
    return out


setattr(expand_batch_to_tokens, _FIXED, True)
