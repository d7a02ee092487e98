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
  (`fresh_inputs`); timings run on the case's inputs, whose values then drift (times do not:
  the QK-norm weights are signs, so that heads keep their magnitude).
- `copy_inputs`: for an in-place op whose inputs are views into one buffer (qk: q and k of a QKV
  buffer), how to copy them so that the copies are such views again (default: each array
  copied on its own, contiguous).
- `unpack`: for an op whose outputs are format bits (the MX ops) or must have a layout, maps an
  implementation's outputs to arrays comparable with the reference (may raise: the check fails).
- `scale_tolerance`: for the quantised ops whose scales are checked tighter than q, the largest
  relative error of the outputs after the first (the scales); `tolerance` then holds for q.

The shapes are `M x N` for every op; for the QK-norm ops M is the number of tokens T and N the
head size D, with Hq = 32 query and Hk = 8 key heads per token (`QK_HEADS`, Llama-3-8B's).

An op with several outputs returns a tuple from its implementations and its reference; the error is
the largest over the outputs.
"""
import functools
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Optional

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
    copy_inputs: Optional[Callable] = None
    unpack: Optional[Callable] = None
    scale_tolerance: Optional[float] = None

    def max_rel_err(self, target, outputs, reference):
        """Largest relative error over the outputs; NaN (which fails every check) on a mismatch.
        With `scale_tolerance`, q's error alone, and scales over theirs raise (the check fails
        with the error)."""
        if self.unpack is not None:
            outputs = self.unpack(outputs)
        if not isinstance(reference, tuple):
            outputs, reference = (outputs,), (reference,)
        if not isinstance(outputs, tuple) or len(outputs) != len(reference):
            return float("nan")
        errors = [target.rel_err(out, ref) for out, ref in zip(outputs, reference)]
        if any(math.isnan(e) for e in errors):
            return float("nan")
        if self.scale_tolerance is not None and len(errors) > 1:
            scales = max(errors[1:])
            if not scales < self.scale_tolerance:
                raise ValueError(f"scales: rel err {scales:.3g}, tolerance "
                                 f"{self.scale_tolerance:g}")
            errors = errors[:1]
        return max(errors)

    def passes(self, dtype, rel_err):
        return rel_err < self.tolerance[dtype]  # False for NaN

    def fresh_inputs(self, args):
        """args, or copies of its arrays for an op that writes its inputs."""
        if not self.in_place:
            return args
        if self.copy_inputs is not None:
            return self.copy_inputs(args)
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


# ---- scaled quantisation, no xscale: one scale per group of columns, a static scale, the OCP MX
# formats (MXFP8, MXFP4); run by name only ----

GROUP, MX_BLOCK, E4M3_MAX = peers.GROUP, peers.MX_BLOCK, peers.E4M3_MAX
E2M1_MAX = 6.0
STATIC_SCALE = 0.025    # levels y / 0.025: a few hundred at most for these unit-rms rows, < 448
# q (values) against the levels before rounding: 1.5x the rounding error (RNE) of each format on
# these inputs, under the truncation's (e4m3 2.6% / 5.0%, int8 0.64% / 1.3%, e2m1 10.4% / 18.9%).
SCALED_TOLERANCE = {"float8_e4m3fn": 4e-2, "int8": 1e-2, "mxfp8_e4m3": 4e-2, "mxfp4_e2m1": 1.5e-1}
# the scales: float32 ones are within ~4e-7 of float64's; a power of two may flip where amax sits
# within float32 rounding of one (one block flipped of the 4M in an MX 32768x4096 case: 5e-4); a
# QMAX 1% off fails
SCALES_TOLERANCE = 5e-3


def _blocks(a, size):
    """(M, N) as (M, N // size, size)."""
    return a.reshape(a.shape[0], -1, size)


def _frexp(a):
    """(mantissa in [0.5, 1), exponent) of float64 a: exact, where log2 rounds to an integer
    next to a power of two."""
    if hasattr(a, "amax"):
        import torch
        return tuple(torch.frexp(a))
    import numpy as np
    return np.frexp(a)


def _group_reference(quant_dtype, scale_format):
    qmax = QMAX[quant_dtype]

    def reference(target, x, weight, eps):
        """(y / yscale, yscale) per group of 128 columns: q before rounding (clamped to +-QMAX
        as q is); ue8m0: yscale rounded up to a power of two."""
        y = _blocks(_rms_norm_reference(target, x, weight, eps), GROUP)
        amax = _row_amax(y)
        yscale = amax / qmax + (amax == 0)
        if scale_format == "ue8m0":
            mantissa, exponent = _frexp(yscale)
            yscale = 2.0 ** target.float64(exponent - 1 + (mantissa > 0.5))
        return (y / yscale).clip(-qmax, qmax).reshape(x.shape), yscale[..., 0]

    return reference


def _static_inputs(target, M, N, dtype, seed):
    """The rms_norm inputs and the scale, a float32 (1,) array on x's device."""
    import numpy as np

    return _rms_norm_inputs(target, M, N, dtype, seed) + (
        _from_host(target, np.full(1, STATIC_SCALE, np.float32)),)


def _static_reference(target, x, weight, eps, scale):
    """y / scale, clamped to +-448 as q is: q before rounding."""
    y = _rms_norm_reference(target, x, weight, eps)
    return (y / target.float64(scale)).clip(-E4M3_MAX, E4M3_MAX)


def _mx_reference(fmt):
    emax = peers.MX_EMAX[fmt]
    fmax = E4M3_MAX if fmt == "mxfp8_e4m3" else E2M1_MAX

    def reference(target, x, weight, eps):
        """(y / 2**e, 2**e) per block of 32 columns, e = floor(log2(amax)) - emax clamped to
        [-127, 127] (-127 for amax 0): the elements before rounding (saturated as they are)
        and the E8M0 scales as values."""
        y = _blocks(_rms_norm_reference(target, x, weight, eps), MX_BLOCK)
        amax = _row_amax(y)
        e = (_frexp(amax)[1] - 1 - emax - 1000 * (amax == 0)).clip(-127, 127)
        scale = 2.0 ** target.float64(e)
        return (y / scale).clip(-fmax, fmax).reshape(x.shape), scale[..., 0]

    return reference


@functools.lru_cache(maxsize=None)
def _mx_tables():
    """float64 values of each byte: e4m3fn, e2m1 pairs (low nibble first), E8M0."""
    import ml_dtypes
    import numpy as np

    codes = np.arange(256, dtype=np.uint8)
    e2m1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    e2m1 = np.concatenate((e2m1, -e2m1))
    return {"mxfp8_e4m3": codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64),
            "mxfp4_e2m1": np.stack((e2m1[codes & 15], e2m1[codes >> 4]), -1),
            "e8m0": np.where(codes == 255, np.nan, 2.0 ** (codes - 127.0))}


def _lookup(a, table):
    """table[bits of a] (a of 1-byte elements, any dtype: torch's float8 / float4 / e8m0 or
    uint8) on a's library and device."""
    if hasattr(a, "amax"):
        import torch
        bits = a.view(torch.uint8)
        return torch.as_tensor(table, device=bits.device)[bits.long()]
    import numpy as np
    return table[np.asarray(a).view(np.uint8)]


def _mx_unpack(fmt):
    def unpack(outputs):
        """(elements, scales) as float64 values from their bits."""
        q, scales = outputs
        tables = _mx_tables()
        values = _lookup(q, tables[fmt])
        return values.reshape(values.shape[0], -1), _lookup(scales, tables["e8m0"])

    return unpack


def _column_major_checked(outputs):
    """The outputs, once yscale is found column-major with its column stride M rounded up to
    4 (DeepGEMM's layout): a row-major yscale is not what a DeepGEMM GEMM reads."""
    q, yscale = outputs
    m = yscale.shape[0]
    if hasattr(yscale, "amax"):
        strides = tuple(yscale.stride())
    else:
        strides = tuple(s // yscale.itemsize for s in yscale.strides)
    expected = (1, m + -m % peers.COLUMN_PAD)
    if any(n > 1 and s != w for n, s, w in zip(yscale.shape, strides, expected)):
        raise ValueError(f"yscale strides {strides}, column-major expects {expected}")
    return outputs


def _residual_inputs(make_inputs):
    """make_inputs with a residual (x's shape and dtype) after x."""
    def inputs(target, M, N, dtype, seed):
        x, *rest = make_inputs(target, M, N, dtype, seed)
        return (x, target.randn((M, N), dtype, seed + 50), *rest)

    return inputs


def _residual_reference(reference):
    """reference on h = x + residual (rounded to x's dtype, as residual_out is), and h."""
    def with_residual(target, x, residual, *rest):
        h = x + residual
        out = reference(target, h, *rest)
        return (*out, target.float64(h)) if isinstance(out, tuple) else (out, target.float64(h))

    return with_residual


def _residual_unpack(unpack):
    """unpack for the outputs before residual_out, which is compared as it is."""
    if unpack is None:
        return None
    return lambda outputs: (*unpack(outputs[:-1]), outputs[-1])


def _scaled_op(name, summary, bytes_formula, bytes_moved, make_inputs, reference, ours,
               torch_peer, numpy_peer, tolerance, residual, **options):
    """A quantising op; with ``residual``, its fused-add form: x + residual rounded to x's
    dtype, stored as residual_out and quantised (each peer adds first, torch.compile in the
    same graph)."""
    if residual:
        summary = f"{summary}; residual= (h = x + residual, residual_out returned last)"
        bytes_formula = f"{bytes_formula}, + 2*M*N*e (read residual, write residual_out)"
        plain_bytes = bytes_moved
        bytes_moved = lambda M, N, e: plain_bytes(M, N, e) + 2 * M * N * e  # noqa: E731
        make_inputs, reference = _residual_inputs(make_inputs), _residual_reference(reference)
        options["unpack"] = _residual_unpack(options.get("unpack"))
        add = peers.residual_added
        cuda_peers = {"torch": add(torch_peer), "torch_compile": add(torch_peer, compiled=True)}
        cpu_peers = {"numpy": add(numpy_peer), "torch": add(peers.on_host(torch_peer))}
    else:
        cuda_peers = {"torch": torch_peer, "torch_compile": peers.compiled(torch_peer)}
        cpu_peers = {"numpy": numpy_peer, "torch": peers.on_host(torch_peer)}
    return Op(name=name, summary=summary, bytes_formula=bytes_formula, bytes_moved=bytes_moved,
              make_inputs=make_inputs, reference=reference,
              ours={"cuda": {"ours": ours}, "cpu": {"ours": ours}},
              peers={"cuda": cuda_peers, "cpu": cpu_peers},
              tolerance=dict.fromkeys(TOLERANCE, tolerance), **options)


def _group_quant_op(name, quant_dtype, scale_format="float32", scale_layout="row",
                    residual=False):
    spec = (quant_dtype, scale_format, scale_layout)
    deepgemm = scale_layout == "column"
    extra = ", scale_format='ue8m0', scale_layout='column'" if deepgemm else ""
    return _scaled_op(
        name,
        summary=f"(q, yscale) = rms_norm_quant(x, weight, eps, quant_dtype={quant_dtype!r}, "
                f"group_size={GROUP}{extra}): one absmax scale per 1x{GROUP} group of columns "
                f"(DeepSeek-V3's activation tiles), yscale float32 (M, N/{GROUP})"
                + (" of powers of two, column-major with M padded to 4 (DeepGEMM)"
                   if deepgemm else "")
                + "; peers: the same formulas in float32 torch operators",
        bytes_formula=f"M*N*e + N*e + M*N + M*N/{GROUP}*4 (read x and weight; write 8-bit q "
                      f"and a float32 scale per group)",
        bytes_moved=lambda M, N, e: M * N * e + N * e + M * N + M * (N // GROUP) * 4,
        make_inputs=_rms_norm_inputs,
        reference=_group_reference(quant_dtype, scale_format),
        ours=peers.ours_rms_norm_quant_group(*spec, residual=residual),
        torch_peer=peers.torch_rms_norm_quant_group(*spec),
        numpy_peer=peers.numpy_rms_norm_quant_group(*spec),
        tolerance=SCALED_TOLERANCE[quant_dtype], residual=residual,
        unpack=_column_major_checked if deepgemm else None,
        scale_tolerance=SCALES_TOLERANCE,
    )


def _mx_op(name, fmt, residual=False):
    fp4 = fmt == "mxfp4_e2m1"
    q_bytes = "M*N/2" if fp4 else "M*N"
    return _scaled_op(
        name,
        summary=f"(q, scales) = rms_norm_quant(x, weight, eps, quant_dtype={fmt!r}): OCP MX, "
                f"an E8M0 scale byte per block of {MX_BLOCK} columns (M, N/{MX_BLOCK}), "
                + ("e2m1 elements packed two to a byte (M, N/2)" if fp4 else
                   "e4m3 elements (M, N)")
                + "; peers: the same formulas in float32 torch operators",
        bytes_formula=f"M*N*e + N*e + {q_bytes} + M*N/{MX_BLOCK} (read x and weight; write "
                      f"{'4-bit' if fp4 else '8-bit'} q and a scale byte per block)",
        bytes_moved=lambda M, N, e: (M * N * e + N * e + (M * N // 2 if fp4 else M * N)
                                     + M * N // MX_BLOCK),
        make_inputs=_rms_norm_inputs,
        reference=_mx_reference(fmt),
        ours=peers.ours_rms_norm_quant_mx(fmt, residual=residual),
        torch_peer=peers.torch_rms_norm_quant_mx(fmt),
        numpy_peer=peers.numpy_rms_norm_quant_mx(fmt),
        tolerance=SCALED_TOLERANCE[fmt], residual=residual,
        unpack=_mx_unpack(fmt),
        scale_tolerance=SCALES_TOLERANCE,
    )


def _static_op(name, residual=False):
    return _scaled_op(
        name,
        summary=f"q = rms_norm_quant(x, weight, eps, quant_dtype='float8_e4m3fn', scale=s): a "
                f"static per-tensor scale, s a float32 (1,) array on x's device (here "
                f"{STATIC_SCALE}); peers: the same formula in float32 torch operators",
        bytes_formula="M*N*e + N*e + 4 + M*N (read x, weight and the scale; write 8-bit q)",
        bytes_moved=lambda M, N, e: M * N * e + N * e + 4 + M * N,
        make_inputs=_static_inputs,
        reference=_static_reference,
        ours=peers.ours_rms_norm_quant_static(residual=residual),
        torch_peer=peers.torch_rms_norm_quant_static,
        numpy_peer=peers.numpy_rms_norm_quant_static,
        tolerance=SCALED_TOLERANCE["float8_e4m3fn"], residual=residual,
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

# ---- QK-norm: q (T, Hq, D) and k (T, Hk, D) views into one (T, (Hq + 2 Hk) D) QKV buffer ----

QK_HEADS = (32, 8)          # Hq, Hk: Llama-3-8B's query and key (and value) heads
ROPE_MAX_POSITION = 4096    # rows of the cos / sin cache; positions are arange(T) % this
ROPE_BASE = 10000.0


def _from_host(target, array):
    """A NumPy array on the target: itself on the CPU, a torch CUDA tensor on CUDA."""
    if target.name == "cpu":
        return array
    return target.torch.from_numpy(array).to(target.device)


def _view(part, shape):
    """``part`` (a column slice of the QKV buffer) as ``shape`` without a copy."""
    return part.view(shape) if hasattr(part, "amax") else part.reshape(shape)


def _qk_views(qkv, hq, hk):
    """(q, k) views of a QKV buffer (T, (hq + 2 hk) D): columns [0, hq D) and
    [hq D, (hq + hk) D)."""
    t, width = qkv.shape
    d = width // (hq + 2 * hk)
    return (_view(qkv[:, :hq * d], (t, hq, d)),
            _view(qkv[:, hq * d:(hq + hk) * d], (t, hk, d)))


def _qk_inputs(target, M, N, dtype, seed):
    """(q, k, q_weight, k_weight, eps): T = M tokens, head size D = N.  The weights are random
    signs: timed over and over in place, a head stays where the first call leaves it (weights
    of other magnitudes take most of its elements, call by call, to subnormals, which the CPU
    runs far slower)."""
    hq, hk = QK_HEADS
    qkv = target.randn((M, (hq + 2 * hk) * N), dtype, seed)
    q, k = _qk_views(qkv, hq, hk)
    return (q, k, _signs(target.randn((N,), dtype, seed + 1)),
            _signs(target.randn((N,), dtype, seed + 2)), EPS)


def _signs(a):
    """+-1 in a's dtype and library (a: random normal, none of it zero)."""
    if hasattr(a, "amax"):
        return a.sign()
    import numpy as np
    return np.sign(a)


def _qk_copy(args):
    """Fresh copies of the QKV buffer behind q and k, and views into the copy like q and k."""
    q, k, *rest = args
    base = q._base if hasattr(q, "amax") else q.base
    copy = base.clone() if hasattr(base, "clone") else base.copy()
    return _qk_views(copy, q.shape[1], k.shape[1]) + tuple(rest)


def rope_cache(max_position, rotary_dim, base=ROPE_BASE):
    """vLLM's cos_sin_cache (max_position, rotary_dim), float32: cos then sin of
    position * inv_freq, inv_freq = base ** -(arange(0, rotary_dim, 2) / rotary_dim)."""
    import numpy as np

    inv_freq = 1.0 / base ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    freqs = np.outer(np.arange(max_position, dtype=np.float64), inv_freq)
    return np.concatenate((np.cos(freqs), np.sin(freqs)), -1).astype(np.float32)


def _qk_rope_inputs(target, M, N, dtype, seed):
    """The qk inputs, then positions (int64 (T,), arange(T) % 4096) and the float32 cache
    (4096, D) of neox RoPE over the whole head."""
    import numpy as np

    positions = np.arange(M, dtype=np.int64) % ROPE_MAX_POSITION
    return _qk_inputs(target, M, N, dtype, seed) + (
        _from_host(target, positions), _from_host(target, rope_cache(ROPE_MAX_POSITION, N)))


def _cat(parts):
    """Concatenation along the last axis, torch tensors or NumPy arrays."""
    if hasattr(parts[0], "amax"):
        import torch
        return torch.cat(parts, -1)
    import numpy as np
    return np.concatenate(parts, -1)


def _qk_reference(target, q, k, q_weight, k_weight, eps):
    """float64 per head row."""
    return (_rms_norm_reference(target, q, q_weight, eps),
            _rms_norm_reference(target, k, k_weight, eps))


def _qk_rope_reference(target, q, k, q_weight, k_weight, eps, positions, cos_sin_cache):
    """float64 per head row, then the neox rotation of the halves by the token's position."""
    half = q.shape[-1] // 2
    table = target.float64(cos_sin_cache)[positions][:, None, :]      # (T, 1, D)
    cos, sin = table[..., :half], table[..., half:]

    def rotate(y):
        y1, y2 = y[..., :half], y[..., half:]
        return _cat((y1 * cos - y2 * sin, y2 * cos + y1 * sin))

    return tuple(map(rotate, _qk_reference(target, q, k, q_weight, k_weight, eps)))


_QK_HEADS_NOTE = (f"T = M tokens of Hq = {QK_HEADS[0]} query and Hk = {QK_HEADS[1]} key heads "
                  f"of size D = N, q and k views into one (T, (Hq + 2 Hk) D) QKV buffer")


def _qk_op(name, rope):
    cuda_ours = {"ours": peers.ours_qk_rope_inplace if rope else peers.ours_qk_rms_norm_inplace,
                 "ours_torch": (peers.ours_torch_qk_rope_inplace if rope
                                else peers.ours_torch_qk_rms_norm_inplace)}
    if rope:
        call = ("qk_rms_norm_(q, k, q_weight, k_weight, eps, positions=positions, "
                "cos_sin_cache=cos_sin_cache, rope_style='neox')")
        bytes_formula = ("2*M*(Hq+Hk)*N*e + 2*N*e + M*N*4 + M*8 (read and write q and k, read "
                         "the weights, each token's float32 cos/sin cache row and its int64 "
                         "position)")
        peer = {"cuda": {"torch": peers.torch_qk_rope,
                         "torch_compile": peers.torch_compile_qk_rope},
                "cpu": {"numpy": peers.numpy_qk_rope,
                        "torch": peers.on_host(peers.torch_qk_rope)}}
    else:
        call = "qk_rms_norm_(q, k, q_weight, k_weight, eps)"
        bytes_formula = "2*M*(Hq+Hk)*N*e + 2*N*e (read and write q and k, read the weights)"
        peer = {"cuda": {"torch": peers.torch_qk_rms_norm,
                         "torch_compile": peers.torch_compile_qk_rms_norm},
                "cpu": {"numpy": peers.numpy_qk_rms_norm,
                        "torch": peers.on_host(peers.torch_qk_rms_norm)}}
    heads = sum(QK_HEADS)
    rope_bytes = (lambda M, N: M * N * 4 + M * 8) if rope else (lambda M, N: 0)
    return Op(
        name=name,
        summary=f"{call}: QK-norm in place{', then neox RoPE' if rope else ''}; "
                f"{_QK_HEADS_NOTE}; weights (N,) in x's dtype"
                + ("; positions int64 (T,) = arange(T) % 4096, cos_sin_cache float32 (4096, D)"
                   if rope else "")
                + "; peers: F.rms_norm of q and of k" + (" then the neox rotation in float32"
                                                         if rope else "") + ", out of place",
        bytes_formula=bytes_formula.replace("(Hq+Hk)", f"({QK_HEADS[0]}+{QK_HEADS[1]})"),
        bytes_moved=lambda M, N, e: 2 * M * heads * N * e + 2 * N * e + rope_bytes(M, N),
        make_inputs=_qk_rope_inputs if rope else _qk_inputs,
        reference=_qk_rope_reference if rope else _qk_reference,
        ours={"cuda": cuda_ours, "cpu": {"ours": cuda_ours["ours"]}},
        peers=peer,
        in_place=True,
        copy_inputs=_qk_copy,
    )


# ---- Mamba 2's gated RMSNorm (norm_before_gate=False): y = rms_norm(x * silu(z)) * weight ----


def _silu64(z64):
    """(silu(z), sigmoid(z)) in float64, with operators torch tensors and NumPy arrays share."""
    sig = 1.0 / (1.0 + math.e ** (-z64))
    return z64 * sig, sig


def _gated_inputs(target, M, N, dtype, seed):
    x, weight, eps = _rms_norm_inputs(target, M, N, dtype, seed)
    return x, target.randn((M, N), dtype, seed + 2), weight, eps


def _gated_reference(target, x, z, weight, eps):
    g = target.float64(x) * _silu64(target.float64(z))[0]
    return g * (_rows(g * g) / g.shape[-1] + eps) ** -0.5 * target.float64(weight)


def _gated_bwd_inputs(target, M, N, dtype, seed):
    """(dy, x, z, weight, rstd): rstd as the forward stores it (float32, from our
    rms_norm_gated)."""
    import rmsnorm_hip

    x, z, weight, _ = _gated_inputs(target, M, N, dtype, seed)
    rstd = rmsnorm_hip.rms_norm_gated(x, z, weight, EPS, return_rstd=True)[1]
    return target.randn((M, N), dtype, seed + 3), x, z, weight, rstd


def _gated_bwd_reference(target, dy, x, z, weight, rstd):
    """float64 dx, dz and dweight from x and z (rstd recomputed in float64: independent of
    ours)."""
    x64, dy64 = target.float64(x), target.float64(dy)
    silu, sig = _silu64(target.float64(z))
    g = x64 * silu
    r = (_rows(g * g) / g.shape[-1] + EPS) ** -0.5
    g_hat = g * r
    wdy = dy64 * target.float64(weight)
    dg = (wdy - g_hat * (_rows(g_hat * wdy) / g.shape[-1])) * r
    z64 = target.float64(z)
    return dg * silu, dg * x64 * sig * (1 + z64 * (1 - sig)), (dy64 * g_hat).sum(0)


_GATED = Op(
    name="gated",
    summary="y = rms_norm_gated(x, z, weight, eps): Mamba 2's gated RMSNorm, norm_before_gate="
            "False (y = rms_norm(x * silu(z)) * weight), x, z (M, N), weight (N,) in x's dtype; "
            "peers: mamba_ssm's reference in float32, one rounding",
    bytes_formula="3*M*N*e + N*e (read x, z and weight, write y)",
    bytes_moved=lambda M, N, e: 3 * M * N * e + N * e,
    make_inputs=_gated_inputs,
    reference=_gated_reference,
    ours={"cuda": {"ours": peers.ours_rms_norm_gated,
                   "ours_torch": peers.ours_torch_rms_norm_gated},
          "cpu": {"ours": peers.ours_rms_norm_gated}},
    peers={"cuda": {"torch": peers.torch_rms_norm_gated,
                    "torch_compile": peers.torch_compile_rms_norm_gated},
           "cpu": {"numpy": peers.numpy_rms_norm_gated,
                   "torch": peers.on_host(peers.torch_rms_norm_gated)}},
)

_GATED_BWD = Op(
    name="gated_bwd",
    summary="(dx, dz, dweight) = rms_norm_gated_backward(dy, x, z, weight, rstd), "
            "norm_before_gate=False, x, z (M, N), weight (N,) in x's dtype, rstd float32 (M,) "
            "from the forward; peers: torch autograd of mamba_ssm's float32 reference (eager), "
            "its backward written out (torch.compile)",
    bytes_formula="5*M*N*e + 2*N*e (read dy, x, z, weight; write dx, dz, dweight; rstd not "
                  "counted)",
    bytes_moved=lambda M, N, e: 5 * M * N * e + 2 * N * e,
    make_inputs=_gated_bwd_inputs,
    reference=_gated_bwd_reference,
    ours={"cuda": {"ours": peers.ours_rms_norm_gated_backward},
          "cpu": {"ours": peers.ours_rms_norm_gated_backward}},
    peers={"cuda": {"torch": peers.torch_rms_norm_gated_backward,
                    "torch_compile": peers.torch_compile_rms_norm_gated_backward},
           "cpu": {"numpy": peers.numpy_rms_norm_gated_backward,
                   "torch": peers.on_host(peers.torch_eager_rms_norm_gated_backward)}},
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
    "qk": _qk_op("qk", rope=False),
    "qk_rope": _qk_op("qk_rope", rope=True),
    "gated": _GATED,
    "gated_bwd": _GATED_BWD,
}
# the scaled quantisation ops, each also as NAME_res: with residual= (the fused add)
_SCALED = {
    "quant_group": lambda name, r: _group_quant_op(name, "float8_e4m3fn", residual=r),
    "quant_group_ue8m0": lambda name, r: _group_quant_op(name, "float8_e4m3fn", "ue8m0", "column",
                                                         residual=r),
    "quant_group_int8": lambda name, r: _group_quant_op(name, "int8", residual=r),
    "quant_static": lambda name, r: _static_op(name, residual=r),
    "mxfp8": lambda name, r: _mx_op(name, "mxfp8_e4m3", residual=r),
    "mxfp4": lambda name, r: _mx_op(name, "mxfp4_e2m1", residual=r),
}
SCALED = tuple(_SCALED)
SCALED_RESIDUAL = tuple(f"{name}_res" for name in _SCALED)
OPS.update({name: make(name, False) for name, make in _SCALED.items()})
OPS.update({f"{name}_res": make(f"{name}_res", True) for name, make in _SCALED.items()})
# `--op all` runs these in order; fused_inplace, qk, qk_rope, gated, gated_bwd and the scaled
# quantisation ops (quant_group, quant_group_ue8m0, quant_group_int8, quant_static, mxfp8, mxfp4)
# only when named (`--op`, `--decode --ops`)
ALL = ("fwd", "bwd", "bwd_dres", "fused", "quant", "quant_fp8")
