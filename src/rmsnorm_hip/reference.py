"""float64 NumPy references for the numerical contract (docs/api.md).

Each ``<op>_ref`` takes the same (already rounded) arrays the kernels see: NumPy float32,
float16, ``ml_dtypes.bfloat16``, or CPU torch tensors.  It upcasts them exactly to float64 and
returns float64 results, never rounded to the output dtype: tests measure the kernels' one
rounding against them.  Per-row statistics come back flattened to ``(M,)`` like the kernels'.
New ops go here as further ``<op>_ref`` functions built from :func:`to_float64` (and from each
other: a fused add is ``rms_norm_ref`` of the rounded sum).
"""
import ml_dtypes
import numpy as np

QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}


def to_float64(a):
    """``a`` upcast exactly to a float64 ndarray (``None`` stays ``None``)."""
    if a is None:
        return None
    if type(a).__module__.split(".")[0] == "torch":
        a = a.detach().cpu().float().numpy()  # bf16/f16 -> f32 is exact
    return np.asarray(a).astype(np.float64)


def rms_norm_ref(x, weight=None, eps=1e-6, weight_offset=0.0):
    """``(y, rstd)``: ``rstd = 1 / sqrt(mean(x**2) + eps)`` per row, shape (M,);
    ``y = x * rstd * (weight + weight_offset)``, shape of x (``weight=None``: no scaling)."""
    x64 = to_float64(x)
    rstd = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    y = x64 * rstd
    if weight is not None:
        y = y * (to_float64(weight) + weight_offset)
    return y, rstd.reshape(-1)


def round_like(a64, like):
    """float64 ``a64`` rounded once to ``like``'s dtype (NumPy, ml_dtypes or CPU torch), back as
    float64: the value a kernel stores there."""
    if type(like).__module__.split(".")[0] == "torch":
        dtype = {"torch.float32": np.float32, "torch.float16": np.float16,
                 "torch.bfloat16": ml_dtypes.bfloat16}[str(like.dtype)]
    else:
        dtype = np.asarray(like).dtype
    with np.errstate(over="ignore"):
        return np.asarray(a64).astype(dtype).astype(np.float64)


def fused_add_rms_norm_ref(x, residual, weight=None, eps=1e-6, weight_offset=0.0):
    """``(y, residual_out, rstd)``: ``residual_out = x + residual`` rounded once to x's dtype (it
    is a stored input of the normalisation, so the reference rounds it like the kernel), and
    ``(y, rstd) = rms_norm_ref(residual_out, ...)`` in float64."""
    h = round_like(to_float64(x) + to_float64(residual), x)
    y, rstd = rms_norm_ref(h, weight, eps, weight_offset)
    return y, h, rstd


def quantize_ref(levels64, quant_dtype):
    """float64 values in units of yscale, rounded to ``quant_dtype``'s nearest level (ties to
    even) and saturated at +-QMAX, as float64 (the grid q is compared on); ``quant_dtype``
    "int8", "float8_e4m3fn" or "float4_e2m1" (MX's elements)."""
    if quant_dtype == "float4_e2m1":
        return quantize_e2m1_ref(levels64)
    qmax = QMAX[quant_dtype]
    clipped = np.clip(levels64, -qmax, qmax)
    if quant_dtype == "int8":
        return np.rint(clipped)
    return clipped.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def rms_norm_quant_ref(x, weight=None, eps=1e-6, *, xscale=None, residual=None,
                       quant_dtype="int8", weight_offset=0.0):
    """``(q, yscale)`` or ``(q, yscale, residual_out)``, float64: ``h = round(x + residual)``
    (or x), ``y = h * rstd * (weight + weight_offset) * xscale``, ``yscale = max|y| / QMAX``
    per row (1 for an all-zero row) and ``q = y / yscale``, not rounded to a level
    (:func:`quantize_ref` does that, ties to even)."""
    h = x if residual is None else fused_add_rms_norm_ref(x, residual)[1]
    y, _ = rms_norm_ref(h, weight, eps, weight_offset)
    if xscale is not None:
        y = y * to_float64(xscale)
    amax = np.max(np.abs(y), axis=-1, keepdims=True)
    yscale = np.where(amax == 0, 1.0, amax / QMAX[quant_dtype])
    q = y / yscale
    yscale = yscale.reshape(-1)
    return (q, yscale) if residual is None else (q, yscale, h)

MX_EMAX = {"mxfp8_e4m3": 8, "mxfp4_e2m1": 2}
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_e2m1_ref(v64):
    """float64 values rounded to the nearest float4 e2m1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6 and
    their negatives), ties to the even code, saturating at +-6, as float64."""
    v64 = np.asarray(v64, np.float64)
    distance = np.abs(np.minimum(np.abs(v64), 6.0)[..., None] - E2M1_MAGNITUDES)
    nearest = distance == distance.min(axis=-1, keepdims=True)
    even = (np.arange(8) % 2 == 0)
    code = np.argmax(nearest * (1 + even), axis=-1)     # of two equally near, the even code
    return np.copysign(E2M1_MAGNITUDES[code], v64)


def rms_norm_quant_scaled_ref(x, weight=None, eps=1e-6, *, xscale=None, residual=None,
                              quant_dtype="int8", weight_offset=0.0, group_size=None,
                              scale_format="float32", scale=None):
    """The scaled formats of rms_norm_quant in float64, from y as :func:`rms_norm_quant_ref`
    forms it: ``(levels, scales, residual_out or None)`` with ``levels = y / scale`` per element
    (not rounded: :func:`quantize_ref` / :func:`quantize_e2m1_ref` do that) and ``scales``
    (M, N // G) as the call returns them, row-major:

    - group_size G: amax = max|y| of each group; yscale = amax / QMAX (1 where amax = 0), or
      with scale_format="ue8m0" 2**ceil(log2(amax / QMAX)), the exponent clamped to E8M0's
      [-127, 127] (1 where amax = 0);
    - MX (quant_dtype "mxfp8_e4m3" / "mxfp4_e2m1", blocks of 32): e = floor(log2(amax)) - emax
      clamped to [-127, 127] (-127 where amax = 0), scales the E8M0 bytes e + 127, levels
      y / 2**e;
    - scale=s: levels y / s, scales None."""
    h = x if residual is None else fused_add_rms_norm_ref(x, residual)[1]
    y, _ = rms_norm_ref(h, weight, eps, weight_offset)
    if xscale is not None:
        y = y * to_float64(xscale)
    n = y.shape[-1]
    y = y.reshape(-1, n)
    h = None if residual is None else h
    if scale is not None:
        return y / float(np.float32(to_float64(scale).reshape(-1)[0])), None, h
    mx = quant_dtype in MX_EMAX
    g = 32 if mx else group_size
    blocks = y.reshape(len(y), n // g, g)
    amax = np.max(np.abs(blocks), axis=-1)
    with np.errstate(divide="ignore"):
        if mx:
            finite = np.isfinite(amax)
            e = np.where(amax == 0, -127, np.floor(np.log2(np.where(finite, amax, 1.0)))
                         - MX_EMAX[quant_dtype])
            e = np.clip(e, -127, 127)
            byte = np.where(finite, e + 127, 255).astype(np.uint8)    # 0xFF: E8M0's NaN
            return (blocks / 2.0 ** e[..., None]).reshape(y.shape), byte, h
        yscale = amax / QMAX[quant_dtype]
        if scale_format == "ue8m0":
            yscale = 2.0 ** np.clip(np.ceil(np.log2(yscale)), -127, 127)
    yscale = np.where(amax == 0, 1.0, yscale)
    return (blocks / yscale[..., None]).reshape(y.shape), yscale, h


def rms_norm_backward_ref(dy, x, weight=None, rstd=None, eps=1e-6, weight_offset=0.0,
                          dresidual=None):
    """``(dx, dweight)`` in float64 (dweight ``None`` without weight), plus nothing rounded:
    ``wdy = dy * (weight + weight_offset)``, ``x_hat = x * rstd``,
    ``dx = (wdy - x_hat * mean(x_hat * wdy)) * rstd + dresidual``, ``dweight = sum(dy * x_hat)``.
    ``rstd=None`` recomputes it from x with eps, as the forward does."""
    x64, dy64 = to_float64(x), to_float64(dy)
    n = x64.shape[-1]
    x2, dy2 = x64.reshape(-1, n), dy64.reshape(-1, n)
    if rstd is None:
        rstd2 = rms_norm_ref(x2, None, eps)[1][:, None]
    else:
        rstd2 = to_float64(rstd).reshape(-1, 1)
    scale = 1.0 if weight is None else to_float64(weight) + weight_offset
    wdy = dy2 * scale
    x_hat = x2 * rstd2
    dx = (wdy - x_hat * np.mean(x_hat * wdy, axis=-1, keepdims=True)) * rstd2
    if dresidual is not None:
        dx = dx + to_float64(dresidual).reshape(-1, n)
    dweight = None if weight is None else np.sum(dy2 * x_hat, axis=0)
    return dx.reshape(x64.shape), dweight


def qk_rms_norm_ref(q, k, q_weight, k_weight, eps=1e-6, weight_offset=0.0, positions=None,
                    cos_sin_cache=None, rope_style="neox", rotary_dim=None):
    """``(q_out, k_out)`` of QK-norm: each head row (last dim D) as ``rms_norm_ref`` with its
    weight, then with ``positions`` and ``cos_sin_cache`` RoPE over the first ``rotary_dim``
    (default D) elements: c, s = cache[pos, :rot/2], cache[pos, rot/2:]; "neox" rotates the
    halves (a, b) -> (a c - b s, b c + a s), "gptj" the pairs (2i, 2i + 1) alike."""
    def one(x, w):
        x64 = to_float64(x)
        y, _ = rms_norm_ref(x64, w, eps, weight_offset)
        y = y.reshape(x64.shape)
        if positions is None:
            return y
        rot = x64.shape[-1] if rotary_dim is None else rotary_dim
        half = rot // 2
        pos = np.asarray(to_float64(positions), dtype=np.int64)
        table = to_float64(cos_sin_cache)[pos.reshape(-1)].reshape(pos.shape + (1, rot))
        c, s = table[..., :half], table[..., half:]
        if rope_style == "neox":
            a, b = y[..., :half].copy(), y[..., half:rot].copy()
            y[..., :half], y[..., half:rot] = a * c - b * s, b * c + a * s
        else:
            a, b = y[..., 0:rot:2].copy(), y[..., 1:rot:2].copy()
            y[..., 0:rot:2], y[..., 1:rot:2] = a * c - b * s, b * c + a * s
        return y

    return one(q, q_weight), one(k, k_weight)
