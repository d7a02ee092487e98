"""Implementations to benchmark, as factories.

A factory imports its library and returns a callable with the op's argument list that returns the
op's outputs (ops.py), or raises (ImportError when the library is missing); the runner records the
error and goes on. Libraries are imported inside the factories so that a missing or broken peer
never stops the others, and this module imports without torch.
"""

# ---- ours ----


def ours_rms_norm():
    """The array API (API.md): DLPack in and out, on torch's current stream."""
    import rmsnorm_hip

    return rmsnorm_hip.rms_norm


def ours_torch_rms_norm():
    """The torch adapter (autograd custom op), what a torch user calls."""
    from rmsnorm_hip.torch import rms_norm

    return rms_norm


# ---- torch ----


def torch_rms_norm():
    import torch.nn.functional as F

    def rms_norm(x, weight, eps):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    return rms_norm


def torch_compile_rms_norm():
    import torch

    # One graph per (shape, dtype) with dynamic=False; past the recompile limit (8 by default)
    # dynamo silently runs eager, which would time torch eager under torch.compile's name.
    config = torch._dynamo.config
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, limit):
            setattr(config, limit, max(getattr(config, limit), 256))
    return torch.compile(torch_rms_norm(), dynamic=False, fullgraph=True)


# ---- Liger-Kernel (Triton) ----


def liger_rms_norm():
    # The submodule, not liger_kernel.ops: that package may swap in another backend at import.
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    def rms_norm(x, weight, eps):
        return LigerRMSNormFunction.apply(x, weight, eps)  # offset 0, casting_mode "llama"

    return rms_norm


# ---- QuACK (CuTe DSL) ----


def quack_rms_norm():
    # rmsnorm_fwd is the direct path (no autograd wrapper); it returns (out, residual_out, rstd).
    from quack.rmsnorm import rmsnorm_fwd

    def rms_norm(x, weight, eps):
        return rmsnorm_fwd(x, weight, eps=eps)[0]

    return rms_norm


# ---- NumPy (CPU mode) ----


def numpy_rms_norm():
    import numpy as np

    def rms_norm(x, weight, eps):
        x32 = x.astype(np.float32)
        rstd = 1.0 / np.sqrt(np.mean(x32 * x32, axis=-1, keepdims=True) + np.float32(eps))
        return (x32 * rstd * weight.astype(np.float32)).astype(x.dtype)

    return rms_norm
