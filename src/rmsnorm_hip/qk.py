"""QK-norm entry points (docs/api.md): each attention head's query and key vectors normalised in
one launch, optionally rotated (RoPE) before the one rounding.  Validation happens here, before
any launch; the kernel is kernels/qk_norm.py (the CPU's: kernels/cpu_rmsnorm.make_cpu_qk_norm)."""

from . import _arrays, _validate, backends
from .functional import _backend_env, _keep_runner, _qk_runners, _runner
from .kernels._config import QK_MAX_HEAD_SIZE
from .kernels.qk_norm import Geometry

__all__ = ["qk_rms_norm", "qk_rms_norm_"]

_POSITION_DTYPES = ("int32", "int64")
ROPE_STYLES = ("neox", "gptj")


def qk_rms_norm_(q, k, q_weight, k_weight, eps=1e-6, *, weight_offset=0.0, positions=None,
                 cos_sin_cache=None, rope_style="neox", rotary_dim=None, dtype=None):
    """QK-norm in place: every head row of ``q`` (..., Hq, D) and ``k`` (..., Hk, D) becomes
    ``rms_norm(row, weight, eps, weight_offset=...)`` with ``q_weight`` / ``k_weight`` (D,),
    both in one launch.  With ``positions`` (int32 / int64, q's leading shape) and
    ``cos_sin_cache`` ((max_position, rotary_dim): cos in the first half of a row, sin in the
    second; float32 or q's dtype), the first ``rotary_dim`` (default D) elements of each
    normalised row are then rotated by the token's position, in float32, before the one
    rounding: ``rope_style="neox"`` rotates the two halves, ``"gptj"`` interleaved pairs.
    q and k are usually views into one QKV buffer (any token and head strides); they must not
    share an element with each other or another argument.  Returns None."""
    fn = "qk_rms_norm_"
    key = _repeat_key(fn, q, k, q_weight, k_weight, positions, cos_sin_cache, rope_style,
                      rotary_dim, dtype)
    run = _runner(_qk_runners, key, eps, weight_offset, q_weight)
    # None: k has moved against q, or the arrays' spans meet: full validation looks at them
    if run is not None and run(q, k, q_weight, k_weight, positions, cos_sin_cache, eps,
                               weight_offset) is not None:
        _arrays.bump_versions(q, k)
        return
    _qk(fn, q, k, q_weight, k_weight, eps, weight_offset, positions, cos_sin_cache,
        rope_style, rotary_dim, dtype, True, key)


def qk_rms_norm(q, k, q_weight, k_weight, eps=1e-6, *, weight_offset=0.0, positions=None,
                cos_sin_cache=None, rope_style="neox", rotary_dim=None, dtype=None):
    """:func:`qk_rms_norm_` into new arrays: ``(q_out, k_out)``, contiguous, shaped like q and k;
    q and k are not modified."""
    fn = "qk_rms_norm"
    key = _repeat_key(fn, q, k, q_weight, k_weight, positions, cos_sin_cache, rope_style,
                      rotary_dim, dtype)
    run = _runner(_qk_runners, key, eps, weight_offset, q_weight)
    if run is not None:
        return run(q, k, q_weight, k_weight, positions, cos_sin_cache, eps, weight_offset)
    return _qk(fn, q, k, q_weight, k_weight, eps, weight_offset, positions, cos_sin_cache,
               rope_style, rotary_dim, dtype, False, key)


def _repeat_key(fn, q, k, q_weight, k_weight, positions, cache, rope_style, rotary_dim, dtype):
    """The key of a call's repeat-call runner (torch / CuPy device arrays of one library), or
    None."""
    if dtype is not None or type(rope_style) is not str or not (
            rotary_dim is None or type(rotary_dim) is int):
        return None
    return _arrays.fast_key(q, q_weight, (fn, rope_style, rotary_dim, _backend_env()),
                            (k, k_weight, positions, cache))


def _qk(fn, q, k, q_weight, k_weight, eps, weight_offset, positions, cache, rope_style,
        rotary_dim, dtype, in_place, plan_key=None):
    reinterpret = _validate.reinterpret(dtype, fn)
    qi = _arrays.describe(q, "q", reinterpret, fn)
    _validate.activation_dtype(qi, fn, "q")
    _validate.reinterpreted(qi, reinterpret, fn)
    t, hq, d, q_strides = _validate.heads(qi, fn, "q", QK_MAX_HEAD_SIZE)
    _validate.required(k, fn, "k")
    ki = _arrays.describe(k, "k", reinterpret, fn)
    _validate.same_place(ki, qi, fn, "k")
    if ki.dtype != qi.dtype:
        raise TypeError(f"{fn}: k must have q's dtype {qi.dtype}, got {ki.dtype}")
    _, hk, _, k_strides = _validate.heads(ki, fn, "k", QK_MAX_HEAD_SIZE)
    if tuple(ki.shape[:-2]) != tuple(qi.shape[:-2]) or ki.shape[-1] != d:
        raise ValueError(f"{fn}: q and k must be (..., heads, head_size) with the same leading "
                         f"(token) shape and head size (a flat (T, H * D) q is q.view(T, H, D)), "
                         f"got q {tuple(qi.shape)} and k {tuple(ki.shape)}")
    weights = []
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is None:
            raise TypeError(f"{fn}: {name} must be an array of shape ({d},), got None")
        info = _arrays.describe(w, name, reinterpret, fn)
        _validate.vector(info, qi, d, fn, name, _validate.weight_dtypes(qi.dtype),
                         like_name="q")
        weights.append(info)
    qwi, kwi = weights
    if kwi.dtype != qwi.dtype:
        raise TypeError(f"{fn}: k_weight must have q_weight's dtype {qwi.dtype}, got {kwi.dtype}")
    eps = _validate.eps(eps, fn)
    weight_offset = _validate.weight_offset(weight_offset, True, fn)
    rope, pi, ci = _rope(fn, qi, t, d, positions, cache, rope_style, rotary_dim, reinterpret)
    if in_place:
        for name, info in (("q", qi), ("k", ki)):
            if info.readonly:
                raise ValueError(f"{fn}: {name} must be writeable, got a read-only array")
        note = "q and k are written in place and must share no element with another argument"
        others = [("q_weight", qwi), ("k_weight", kwi), ("positions", pi),
                  ("cos_sin_cache", ci)]
        _validate.no_overlap(qi, [("k", ki)] + others, fn, "q", note=note)
        _validate.no_overlap(ki, others, fn, "k", note=note)
    backend = backends.for_array(qi, fn)
    if rope is not None and backend.name == "cpu" and t:
        _positions_in_range(fn, pi, ci.shape[0])

    if in_place:
        qoi, koi, qo_strides, ko_strides = qi, ki, q_strides, k_strides
    else:
        qoi = _arrays.empty(qi, qi.shape, qi.dtype)[1]
        koi = _arrays.empty(qi, ki.shape, qi.dtype)[1]
        qo_strides, ko_strides = (hq * d, d), (hk * d, d)
    geo = Geometry(t, hq, hk, d, q_strides, k_strides, qo_strides, ko_strides, rope)
    if t * (hq + hk) > 0:
        backend.qk_norm(qi, ki, qwi, kwi, qoi, koi, pi, ci, geo, eps, weight_offset)
    if plan_key is not None and hasattr(backend, "qk_runner"):
        spans = tuple(0 if info is None else info.extent_bytes()
                      for info in (qi, ki, qwi, kwi, pi, ci))
        _keep_runner(_qk_runners, plan_key, backend.qk_runner(
            _arrays.FastIO(qi), geo, qi.dtype, qwi.dtype, (qi.shape, ki.shape), in_place,
            ki.ptr - qi.ptr, spans))
    if in_place:
        _arrays.bump_versions(q, k)
        return None
    return qoi.result(), koi.result()


def _rope(fn, qi, t, d, positions, cache, style, rotary_dim, reinterpret):
    """(Geometry.rope or None, positions ArrayInfo, cache ArrayInfo) of a call."""
    if style not in ROPE_STYLES:    # a typo is refused with RoPE off too
        raise ValueError(f"{fn}: rope_style must be 'neox' or 'gptj', got {style!r}")
    if positions is None and cache is None:
        if rotary_dim is not None:
            raise ValueError(f"{fn}: rotary_dim needs positions and cos_sin_cache, got "
                             f"rotary_dim={rotary_dim!r} without them")
        return None, None, None
    if positions is None or cache is None:
        missing = "positions" if positions is None else "cos_sin_cache"
        raise ValueError(f"{fn}: RoPE needs both positions and cos_sin_cache, got {missing}=None")
    rot = d if rotary_dim is None else _validate.integer(rotary_dim)    # NumPy integers too
    if rot is None or not (2 <= rot <= d and rot % 2 == 0):
        raise ValueError(f"{fn}: rotary_dim must be an even int from 2 to the head size {d}, "
                         f"got {rotary_dim!r}")
    pi = _arrays.describe(positions, "positions", None, fn)
    _validate.same_place(pi, qi, fn, "positions")
    if pi.dtype not in _POSITION_DTYPES:
        raise TypeError(f"{fn}: positions must have dtype int32 or int64, got {pi.dtype}")
    lead = tuple(qi.shape[:-2])
    if tuple(pi.shape) not in (lead, (t,)):
        raise ValueError(f"{fn}: positions must have q's leading shape {lead}, got "
                         f"{tuple(pi.shape)}")
    if t > 1 and not _validate.dense(pi):
        raise ValueError(f"{fn}: positions must be contiguous, got strides {pi.strides}")
    ci = _arrays.describe(cache, "cos_sin_cache", reinterpret, fn)
    _validate.same_place(ci, qi, fn, "cos_sin_cache")
    if ci.dtype not in _validate.weight_dtypes(qi.dtype):
        raise TypeError(f"{fn}: cos_sin_cache must have dtype "
                        f"{' or '.join(_validate.weight_dtypes(qi.dtype))}, got {ci.dtype}")
    if len(ci.shape) != 2 or ci.shape[1] != rot or ci.shape[0] == 0:
        raise ValueError(f"{fn}: cos_sin_cache must have shape (max_position, {rot}) for "
                         f"rotary_dim {rot}, got {tuple(ci.shape)}")
    if ci.strides[1] != 1 or (ci.shape[0] > 1 and ci.strides[0] < rot):
        raise ValueError(f"{fn}: cos_sin_cache rows must be unit-stride and apart by at least "
                         f"{rot}, got strides {ci.strides}")
    stride = int(ci.strides[0]) if ci.shape[0] > 1 else rot
    return (style, ci.dtype, pi.dtype, stride, ci.shape[0], rot), pi, ci



def _positions_in_range(fn, pi, max_position):
    """The CPU backend checks every position against the cache before anything is written (a
    GPU kernel writes NaN over a token whose position is out of range instead)."""
    host = pi.host
    low, high = int(host.min()), int(host.max())
    if low < 0 or high >= max_position:
        raise ValueError(f"{fn}: positions must lie in [0, {max_position}) (cos_sin_cache's "
                         f"rows), got values from {low} to {high}")
