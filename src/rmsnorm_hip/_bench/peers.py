"""Implementations to benchmark, as factories.

A factory imports its library and returns a callable with the op's argument list that returns the
op's outputs (ops.py), or raises (ImportError when the library is missing); the runner records the
error and goes on. Libraries are imported inside the factories so that a missing or broken peer
never stops the others, and this module imports without torch.
"""

# ---- ours ----


def ours_rms_norm():
    """The array API (docs/api.md): DLPack in and out, on torch's current stream."""
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
    return _compiled(torch_rms_norm())


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


def on_host(factory):
    """A torch peer for the CPU mode, whose inputs and outputs are NumPy arrays: the arrays go
    to torch and back without a copy (bfloat16 and float8 through their bits), so what is timed
    is torch's CPU kernel and two views per array."""
    def host_factory():
        import numpy as np
        import torch

        fn = factory()

        bits = {"bfloat16": (np.int16, torch.int16), "float8_e4m3fn": (np.uint8, torch.uint8)}

        def to_torch(a):
            if not isinstance(a, np.ndarray):
                return a
            name = a.dtype.name
            if name in bits:
                return torch.from_numpy(a.view(bits[name][0])).view(getattr(torch, name))
            return torch.from_numpy(a)

        def to_numpy(t):
            name = str(t.dtype).replace("torch.", "")
            if name in bits:
                import ml_dtypes
                return t.view(bits[name][1]).numpy().view(getattr(ml_dtypes, name))
            return t.numpy()

        def call(*args):
            out = fn(*(to_torch(a) for a in args))
            return tuple(map(to_numpy, out)) if isinstance(out, tuple) else to_numpy(out)

        return call

    return host_factory


def numpy_rms_norm():
    import numpy as np

    def rms_norm(x, weight, eps):
        x32 = x.astype(np.float32)
        rstd = 1.0 / np.sqrt(np.mean(x32 * x32, axis=-1, keepdims=True) + np.float32(eps))
        return (x32 * rstd * weight.astype(np.float32)).astype(x.dtype)

    return rms_norm


# ---- backward: (dy, x, weight, rstd) -> (dx, dweight) ----


def ours_rms_norm_backward():
    import rmsnorm_hip

    def backward(dy, x, weight, rstd):
        return rmsnorm_hip.rms_norm_backward(dy, x, weight, rstd)

    return backward


def ours_rms_norm_backward_dres():
    import rmsnorm_hip

    def backward(dy, x, weight, rstd, dresidual):
        return rmsnorm_hip.rms_norm_backward(dy, x, weight, rstd, dresidual=dresidual)

    return backward


def torch_rms_norm_backward():
    """aten._fused_rms_norm_backward: what F.rms_norm's autograd runs in eager mode."""
    import torch

    def backward(dy, x, weight, rstd):
        return tuple(torch.ops.aten._fused_rms_norm_backward(
            dy, x, [x.shape[-1]], rstd.unsqueeze(-1), weight, [True, True]))

    return backward


def torch_rms_norm_backward_dres():
    import torch

    def backward(dy, x, weight, rstd, dresidual):
        dx, dw = torch.ops.aten._fused_rms_norm_backward(
            dy, x, [x.shape[-1]], rstd.unsqueeze(-1), weight, [True, True])
        return dx + dresidual, dw

    return backward


def _backward_formula(dy, x, weight, rstd, dresidual=None):
    """The backward graph of F.rms_norm written out (what inductor fuses for torch.compile)."""
    xf, r = x.float(), rstd.unsqueeze(-1)
    x_hat = xf * r
    wdy = dy.float() * weight.float()
    c1 = (x_hat * wdy).mean(-1, keepdim=True)
    dx = (wdy - x_hat * c1) * r
    if dresidual is not None:
        dx = dx + dresidual.float()
    dw = (dy.float() * x_hat).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


def torch_eager_rms_norm_backward():
    """The backward graph in eager torch operators: torch's CPU build has no
    ``_fused_rms_norm_backward`` kernel (F.rms_norm's CPU autograd runs these operators)."""
    return lambda dy, x, weight, rstd: _backward_formula(dy, x, weight, rstd)


def torch_eager_rms_norm_backward_dres():
    return _backward_formula


def _compiled(fn):
    import torch

    _raise_recompile_limit(torch)
    return torch.compile(fn, dynamic=False, fullgraph=True)


def torch_compile_rms_norm_backward():
    return _compiled(lambda dy, x, weight, rstd: _backward_formula(dy, x, weight, rstd))


def torch_compile_rms_norm_backward_dres():
    return _compiled(_backward_formula)


def liger_rms_norm_backward():
    """Liger's backward kernel (rms_norm_backward), with the block size, warps and casting mode
    its forward picks for the shape (found once per shape, outside the timed call)."""
    from liger_kernel.ops.rms_norm import rms_norm_backward, rms_norm_forward

    settings = {}

    def backward(dy, x, weight, rstd):
        key = (tuple(x.shape), x.dtype)
        if key not in settings:
            _, _, _, block, warps, mode = rms_norm_forward(x, weight, 1e-6, 0.0, "llama", None)
            settings[key] = (block, warps, mode)
        block, warps, mode = settings[key]
        return tuple(rms_norm_backward(dy, x, weight, rstd, 0.0, mode, block, warps, False, None))

    return backward


def quack_rms_norm_backward():
    from quack.rmsnorm import rmsnorm_bwd

    def backward(dy, x, weight, rstd):
        dx, dw, _, _ = rmsnorm_bwd(x, weight, dy, rstd)
        return dx, dw

    return backward


def quack_rms_norm_backward_dres():
    from quack.rmsnorm import rmsnorm_bwd

    def backward(dy, x, weight, rstd, dresidual):
        dx, dw, _, _ = rmsnorm_bwd(x, weight, dy, rstd, dresidual_out=dresidual,
                                   has_residual=True)
        return dx, dw

    return backward


def numpy_rms_norm_backward():
    import numpy as np

    def backward(dy, x, weight, rstd, dresidual=None):
        xf, r = x.astype(np.float32), rstd[:, None]
        x_hat = xf * r
        wdy = dy.astype(np.float32) * weight.astype(np.float32)
        dx = (wdy - x_hat * (x_hat * wdy).mean(-1, keepdims=True)) * r
        if dresidual is not None:
            dx = dx + dresidual.astype(np.float32)
        return dx.astype(x.dtype), (dy.astype(np.float32) * x_hat).sum(0).astype(weight.dtype)

    return backward


# ---- fused residual add: (x, residual, weight, eps) -> (y, residual_out) ----


def ours_fused_add_rms_norm():
    import rmsnorm_hip

    return rmsnorm_hip.fused_add_rms_norm


def ours_fused_add_rms_norm_inplace():
    """In place (vLLM's contract); returns the written arrays for the check."""
    import rmsnorm_hip

    def fused_(x, residual, weight, eps):
        rmsnorm_hip.fused_add_rms_norm_(x, residual, weight, eps)
        return x, residual

    return fused_


def _fused_add_composite(x, residual, weight, eps):
    import torch.nn.functional as F

    h = x + residual
    return F.rms_norm(h, (x.shape[-1],), weight, eps), h


def torch_fused_add_rms_norm():
    return _fused_add_composite


def torch_compile_fused_add_rms_norm():
    return _compiled(_fused_add_composite)


def liger_fused_add_rms_norm():
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

    def fused(x, residual, weight, eps):
        return tuple(LigerFusedAddRMSNormFunction.apply(x, residual, weight, eps, 0.0, "llama",
                                                        False))

    return fused


def quack_fused_add_rms_norm():
    from quack.rmsnorm import rmsnorm_fwd

    def fused(x, residual, weight, eps):
        out, residual_out, _ = rmsnorm_fwd(x, weight, residual=residual, eps=eps)
        return out, residual_out

    return fused


def numpy_fused_add_rms_norm():
    def fused(x, residual, weight, eps):
        h = (x.astype("float32") + residual.astype("float32")).astype(x.dtype)
        return numpy_rms_norm()(h, weight, eps), h

    return fused


# ---- dynamic per-token quantisation, SmoothQuant: (x, weight, eps, xscale) -> (q, yscale) ----

QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}


def ours_rms_norm_quant(quant_dtype):
    def factory():
        import rmsnorm_hip

        def quant(x, weight, eps, xscale):
            return rmsnorm_hip.rms_norm_quant(x, weight, eps, xscale=xscale,
                                              quant_dtype=quant_dtype)

        return quant

    return factory


def _quant_composite(quant_dtype):
    """RMSNorm, SmoothQuant scale and dynamic per-token quantisation in torch operators (no
    peer library ships this on NVIDIA)."""
    import torch

    qmax, out_dtype = QMAX[quant_dtype], getattr(torch, quant_dtype)

    def quant(x, weight, eps, xscale):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        y = xf * rstd * weight.float() * xscale
        amax = y.abs().amax(-1, keepdim=True)
        scale = torch.where(amax == 0, torch.ones_like(amax), amax / qmax)
        q = (y / scale).clamp(-qmax, qmax)
        q = q.round().to(out_dtype) if quant_dtype == "int8" else q.to(out_dtype)
        return q, scale.squeeze(-1)

    return quant


def torch_rms_norm_quant(quant_dtype):
    return lambda: _quant_composite(quant_dtype)


def torch_compile_rms_norm_quant(quant_dtype):
    return lambda: _compiled(_quant_composite(quant_dtype))


def numpy_rms_norm_quant(quant_dtype):
    def factory():
        import numpy as np

        qmax = QMAX[quant_dtype]

        def quant(x, weight, eps, xscale):
            xf = x.astype(np.float32)
            rstd = 1 / np.sqrt((xf * xf).mean(-1, keepdims=True) + np.float32(eps))
            y = xf * rstd * weight.astype(np.float32) * xscale
            amax = np.abs(y).max(-1, keepdims=True)
            scale = np.where(amax == 0, np.float32(1), amax / np.float32(qmax))
            q = np.clip(y / scale, -qmax, qmax)
            if quant_dtype == "int8":
                q = np.rint(q).astype(np.int8)
            else:
                import ml_dtypes
                q = q.astype(ml_dtypes.float8_e4m3fn)
            return q, scale[:, 0].astype(np.float32)

        return quant

    return factory


def _raise_recompile_limit(torch):
    # One graph per (shape, dtype) with dynamic=False; past the recompile limit (8 by default)
    # dynamo silently runs eager, which would time torch eager under torch.compile's name.
    config = torch._dynamo.config
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, limit):
            setattr(config, limit, max(getattr(config, limit), 256))
