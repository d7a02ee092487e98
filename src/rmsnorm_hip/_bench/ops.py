"""The op registry: for each op, what it must move, how to call it, and its reference.

An `Op` holds everything the runner needs to benchmark one entry point against its peers:

- `bytes_moved(M, N, itemsize)`: the fewest bytes the op must move through memory (each input read
  once, each output written once), from which GB/s are computed; `bytes_formula` says it in words.
- `make_inputs(target, M, N, dtype, seed)`: the positional arguments every implementation gets.
  It may use seeds `seed` to `seed + 99`.
- `reference(target, *args)`: the float64 result computed from the same (rounded) inputs.
- `ours` and `peers`: `{target name: {implementation name: factory}}` (peers.py).
- `tolerance`: `{dtype: largest relative error ||out - ref|| / ||ref|| that passes}`.
- `in_place`: an implementation may write its inputs, so each is checked on fresh copies
  (`fresh_inputs`); timings run on the case's inputs, whose values then drift (times do not).

An op with several outputs returns a tuple from its implementations and its reference; the error is
the largest over the outputs.
"""
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

from . import peers

EPS = 1e-6
TOLERANCE = {"bfloat16": 1e-2, "float16": 1e-2, "float32": 1e-5}


@dataclass(frozen=True)
class Op:
    name: str
    summary: str
    bytes_formula: str
    bytes_moved: Callable[[int, int, int], int]
    make_inputs: Callable
    reference: Callable
    ours: Mapping[str, Mapping[str, Callable]]
    peers: Mapping[str, Mapping[str, Callable]]
    tolerance: Mapping[str, float] = field(default_factory=lambda: dict(TOLERANCE))
    in_place: bool = False

    def max_rel_err(self, target, outputs, reference):
        """Largest relative error over the outputs; NaN (which fails every check) on a mismatch."""
        if not isinstance(reference, tuple):
            outputs, reference = (outputs,), (reference,)
        if not isinstance(outputs, tuple) or len(outputs) != len(reference):
            return float("nan")
        errors = [target.rel_err(out, ref) for out, ref in zip(outputs, reference)]
        return float("nan") if any(math.isnan(e) for e in errors) else max(errors)

    def passes(self, dtype, rel_err):
        return rel_err < self.tolerance[dtype]  # False for NaN

    def fresh_inputs(self, args):
        """args, or copies of its arrays for an op that writes its inputs."""
        if not self.in_place:
            return args
        return tuple(a.clone() if hasattr(a, "clone") else a.copy() if hasattr(a, "copy") else a
                     for a in args)


def _rms_norm_inputs(target, M, N, dtype, seed):
    x = target.randn((M, N), dtype, seed)
    weight = target.randn((N,), dtype, seed + 1, mean=1.0, std=0.1)
    return x, weight, EPS


def _rows(a, keepdim=False):
    """Sum over the last axis with the call torch tensors and NumPy arrays share."""
    return a.sum(-1, keepdim=True) if hasattr(a, "amax") else a.sum(-1, keepdims=True)


def _row_amax(a):
    return a.abs().amax(-1, keepdim=True) if hasattr(a, "amax") else abs(a).max(-1, keepdims=True)


def _rstd64(target, x, eps):
    x = target.float64(x)
    return (_rows(x * x) / x.shape[-1] + eps) ** -0.5


def _rms_norm_reference(target, x, weight, eps):
    # Only operators that torch tensors and NumPy arrays share (see targets.py).
    return target.float64(x) * _rstd64(target, x, eps) * target.float64(weight)


def _bwd_inputs(target, M, N, dtype, seed):
    """(dy, x, weight, rstd): rstd as the forward stores it (float32, from our rms_norm)."""
    import rmsnorm_hip

    x = target.randn((M, N), dtype, seed)
    weight = target.randn((N,), dtype, seed + 1, mean=1.0, std=0.1)
    rstd = rmsnorm_hip.rms_norm(x, weight, EPS, return_rstd=True)[1]
    return target.randn((M, N), dtype, seed + 2), x, weight, rstd


def _bwd_dres_inputs(target, M, N, dtype, seed):
    return _bwd_inputs(target, M, N, dtype, seed) + (target.randn((M, N), dtype, seed + 3),)


def _bwd_reference(target, dy, x, weight, rstd, dresidual=None):
    """float64 dx and dweight from x (rstd recomputed in float64: independent of ours)."""
    dy, w, n = target.float64(dy), target.float64(weight), x.shape[-1]
    x_hat = target.float64(x) * _rstd64(target, x, EPS)
    wdy = dy * w
    dx = (wdy - x_hat * (_rows(x_hat * wdy) / n)) * _rstd64(target, x, EPS)
    if dresidual is not None:
        dx = dx + target.float64(dresidual)
    return dx, (dy * x_hat).sum(0)


def _fused_inputs(target, M, N, dtype, seed):
    x, weight, eps = _rms_norm_inputs(target, M, N, dtype, seed)
    return x, target.randn((M, N), dtype, seed + 2), weight, eps


def _fused_reference(target, x, residual, weight, eps):
    h = target.float64(x) + target.float64(residual)
    return h * (_rows(h * h) / h.shape[-1] + eps) ** -0.5 * target.float64(weight), h


def _quant_inputs(target, M, N, dtype, seed):
    x, weight, eps = _rms_norm_inputs(target, M, N, dtype, seed)
    return x, weight, eps, target.randn((N,), "float32", seed + 2, mean=1.0, std=0.2)


def _quant_reference(quant_dtype):
    def reference(target, x, weight, eps, xscale):
        """(y / yscale, yscale): q before rounding to a level, so the error counts rounding."""
        y = _rms_norm_reference(target, x, weight, eps) * target.float64(xscale)
        amax = _row_amax(y)
        yscale = amax / QMAX[quant_dtype] + (amax == 0)
        return y / yscale, yscale[:, 0]
    return reference


QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}
# q against y / yscale: rounding to a level (int8: +-0.5 of ~30 rms levels; e4m3: 3 mantissa
# bits) dominates the relative error; yscale itself is float32-exact.
QUANT_TOLERANCE = {"int8": 3e-2, "float8_e4m3fn": 6e-2}


def _quant_op(name, quant_dtype):
    return Op(
        name=name,
        summary=f"(q, yscale) = rms_norm_quant(x, weight, eps, xscale=xscale, "
                f"quant_dtype={quant_dtype!r}): SmoothQuant, dynamic per-token scale",
        bytes_formula="M*N*e + N*e + N*4 + M*N + M*4 (read x, weight, float32 xscale; write "
                      "8-bit q and float32 yscale)",
        bytes_moved=lambda M, N, e: M * N * e + N * e + N * 4 + M * N + M * 4,
        make_inputs=_quant_inputs,
        reference=_quant_reference(quant_dtype),
        ours={"cuda": {"ours": peers.ours_rms_norm_quant(quant_dtype)},
              "cpu": {"ours": peers.ours_rms_norm_quant(quant_dtype)}},
        peers={"cuda": {"torch": peers.torch_rms_norm_quant(quant_dtype),
                        "torch_compile": peers.torch_compile_rms_norm_quant(quant_dtype)},
               "cpu": {"numpy": peers.numpy_rms_norm_quant(quant_dtype),
                       "torch": peers.on_host(peers.torch_rms_norm_quant(quant_dtype))}},
        tolerance={dtype: QUANT_TOLERANCE[quant_dtype] for dtype in TOLERANCE},
    )


_FUSED = Op(
    name="fused",
    summary="(y, residual_out) = fused_add_rms_norm(x, residual, weight, eps)",
    bytes_formula="4*M*N*e + N*e (read x, residual, weight; write y, residual_out)",
    bytes_moved=lambda M, N, e: 4 * M * N * e + N * e,
    make_inputs=_fused_inputs,
    reference=_fused_reference,
    ours={"cuda": {"ours": peers.ours_fused_add_rms_norm},
          "cpu": {"ours": peers.ours_fused_add_rms_norm}},
    peers={"cuda": {"torch": peers.torch_fused_add_rms_norm,
                    "torch_compile": peers.torch_compile_fused_add_rms_norm,
                    "liger": peers.liger_fused_add_rms_norm,
                    "quack": peers.quack_fused_add_rms_norm},
           "cpu": {"numpy": peers.numpy_fused_add_rms_norm,
                   "torch": peers.on_host(peers.torch_fused_add_rms_norm)}},
)

OPS = {
    "fwd": Op(
        name="fwd",
        summary="y = rms_norm(x, weight, eps), x (M, N), weight (N,) in x's dtype",
        bytes_formula="2*M*N*e + N*e (read x and weight, write y)",
        bytes_moved=lambda M, N, e: 2 * M * N * e + N * e,
        make_inputs=_rms_norm_inputs,
        reference=_rms_norm_reference,
        ours={
            "cuda": {"ours": peers.ours_rms_norm, "ours_torch": peers.ours_torch_rms_norm},
            "cpu": {"ours": peers.ours_rms_norm},
        },
        peers={
            "cuda": {
                "torch": peers.torch_rms_norm,
                "torch_compile": peers.torch_compile_rms_norm,
                "liger": peers.liger_rms_norm,
                "quack": peers.quack_rms_norm,
            },
            "cpu": {"numpy": peers.numpy_rms_norm, "torch": peers.on_host(peers.torch_rms_norm)},
        },
    ),
    "bwd": Op(
        name="bwd",
        summary="(dx, dweight) = rms_norm_backward(dy, x, weight, rstd), x (M, N), weight (N,) "
                "in x's dtype, rstd float32 (M,) from the forward",
        bytes_formula="3*M*N*e + 2*N*e (read dy, x, weight; write dx, dweight; rstd not counted)",
        bytes_moved=lambda M, N, e: 3 * M * N * e + 2 * N * e,
        make_inputs=_bwd_inputs,
        reference=_bwd_reference,
        ours={"cuda": {"ours": peers.ours_rms_norm_backward},
              "cpu": {"ours": peers.ours_rms_norm_backward}},
        peers={"cuda": {"torch": peers.torch_rms_norm_backward,
                        "torch_compile": peers.torch_compile_rms_norm_backward,
                        "liger": peers.liger_rms_norm_backward,
                        "quack": peers.quack_rms_norm_backward},
               "cpu": {"numpy": peers.numpy_rms_norm_backward,
                       "torch": peers.on_host(peers.torch_eager_rms_norm_backward)}},
    ),
    "bwd_dres": Op(
        name="bwd_dres",
        summary="(dx, dweight) = rms_norm_backward(dy, x, weight, rstd, dresidual=dres): the "
                "fused-add backward (dx is also the residual's gradient)",
        bytes_formula="4*M*N*e + 2*N*e (read dy, x, dresidual, weight; write dx, dweight)",
        bytes_moved=lambda M, N, e: 4 * M * N * e + 2 * N * e,
        make_inputs=_bwd_dres_inputs,
        reference=_bwd_reference,
        ours={"cuda": {"ours": peers.ours_rms_norm_backward_dres},
              "cpu": {"ours": peers.ours_rms_norm_backward_dres}},
        peers={"cuda": {"torch": peers.torch_rms_norm_backward_dres,
                        "torch_compile": peers.torch_compile_rms_norm_backward_dres,
                        "quack": peers.quack_rms_norm_backward_dres},
               "cpu": {"numpy": peers.numpy_rms_norm_backward,
                       "torch": peers.on_host(peers.torch_eager_rms_norm_backward_dres)}},
    ),
    "fused": _FUSED,
    # vLLM's in-place contract (x <- y, residual <- residual_out). No peer has an in-place form:
    # the peers are the out-of-place "fused" ones, timed again in these cases, so that the table
    # says what the in-place call saves over the calls a model would otherwise make.
    "fused_inplace": replace(
        _FUSED,
        name="fused_inplace",
        summary="fused_add_rms_norm_(x, residual, weight, eps): residual <- x + residual, "
                "x <- rms_norm(residual), in place; peers: the out-of-place fused_add_rms_norm",
        bytes_formula="4*M*N*e + N*e (read x, residual, weight; write x, residual)",
        ours={"cuda": {"ours": peers.ours_fused_add_rms_norm_inplace},
              "cpu": {"ours": peers.ours_fused_add_rms_norm_inplace}},
        in_place=True,
    ),
    "quant": _quant_op("quant", "int8"),
    "quant_fp8": _quant_op("quant_fp8", "float8_e4m3fn"),
}
# `--op all` runs these in order; fused_inplace only when named (`--op`, `--decode`)
ALL = ("fwd", "bwd", "bwd_dres", "fused", "quant", "quant_fp8")
