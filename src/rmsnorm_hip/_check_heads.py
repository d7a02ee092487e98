"""``rmsnorm-hip check`` rows for the entry points that work on attention heads and gates:
qk_rms_norm_ / qk_rms_norm (QK-norm, with and without RoPE), rms_norm on head-shaped views of a
QKV buffer, and rms_norm_gated / rms_norm_gated_backward (Mamba 2), each against a float64
reference from the same rounded inputs, within the numerical contract (docs/api.md; _numerics).

Rows (the output format of cli.cmd_check: a line per failing case, or per case with
``--verbose``, then one ``all`` line per label and dtype).  Every kernel specialisation (dtype,
weight dtype, RoPE style, gate, ...) compiles on first use, about a second each on the CPU, so
the main path of each entry point runs in every dtype and each variant in one (``MAIN``,
``EXTRA``):

- ``qk_ neox`` (every dtype): QK-norm in place on the q and k views of one QKV buffer (rows
  padded past the v part), then neox RoPE over the whole head and over ``rotary_dim`` about
  D/2 (each shape twice, the partial one marked ``r<dim>``), float32 cache, int64 positions.
  The v part and the padding keep their bits.
- ``qk_`` (bfloat16): no RoPE, float32 weights, every other shape with ``weight_offset=1.0``.
- ``qk_ gptj`` (float16): gptj RoPE, full and partial, the cache in x's dtype, int32 positions.
- ``qk`` (bfloat16): qk_rms_norm (out of place, neox) bitwise equal to the in-place results;
  q and k untouched.
- ``heads`` (bfloat16): rms_norm of the (T, Hq, D) q view: y and rstd bitwise those of a
  contiguous copy and within the contract, then out= the view itself (in place) bitwise the
  same, k, v and the padding untouched.
- ``gated`` (every dtype) / ``gated nbg`` (bfloat16): rms_norm_gated with norm_before_gate
  False / True, with and without group_size: y and rstd.  Weights float32 for bfloat16 x
  (mixed-precision training), else in x's dtype.
- ``gated_bwd`` (every dtype) / ``gbwd nbg`` (bfloat16): rms_norm_gated_backward with the
  forward's rstd (float32: every other shape with rstd=None, recomputed): dx and dz measured
  against the size of the terms they are differences of (as rms_norm_backward's dx;
  gated_backward_ref), dweight as rms_norm_backward's.

On the CPU every shape has at least two rows: a one-row view is C-contiguous there and would
compile kernels of their own; GPUs also run single-token / single-row shapes (``_shapes``).

A case that raises is a failing case, its error printed on its row.
"""
import numpy as np

from . import _dtypes, _numerics, functional, gated, qk, reference

EPS = 1e-6
# (T, Hq, Hk, D): two-element heads, small heads, Llama-3-8B's 32 + 8 heads of 128, head
# sizes that are no power of two (80, 1000) and 256
QK_SHAPES = ((2, 1, 1, 2), (7, 4, 1, 64), (33, 32, 8, 128), (5, 6, 2, 80), (3, 4, 2, 256),
             (2, 2, 1, 1000))
QK_PAD = 5                  # columns past the v part in each row of the QKV buffer
MAX_POSITION = 50           # rows of the cos / sin cache
# (M, N, group_size): tiny rows, N no power of two, wide rows, Mamba 2's groups (d_inner 4096
# in 8 groups, 2560 in 2), one-column groups and rows the backward reads twice (looped)
GATED_SHAPES = ((2, 1, None), (7, 3, None), (333, 127, None), (33, 5000, None), (7, 8192, None),
                (9, 4096, 512), (5, 2560, 1280), (4, 96, 1), (3, 24576, 3072), (3, 65537, None))


class _Device:
    """Moves NumPy arrays to the checked device and back (cli._device_arrays, or identity)."""

    def __init__(self, to_device, to_host):
        self.to_device, self.to_host = to_device, to_host

    def put(self, a):
        """(device array, dtype keyword) of the NumPy array ``a``."""
        return self.to_device(a, np.asarray(a).dtype.name)

    def get(self, a, dtype):
        return np.asarray(self.to_host(a, dtype))


def _heads(buf, col, h, d):
    """The (T, h, d) view of columns [col, col + h d) of a device QKV buffer, no copy."""
    part = buf[:, col:col + h * d]
    if type(part).__module__.split(".")[0] == "torch":
        return part.view(part.shape[0], h, d)
    return part.reshape(part.shape[0], h, d)   # NumPy and CuPy: a view for these strides


def _bits_equal(a, b):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _worst(results):
    """(ok, rel, ulps) over several (ok, rel, ulps)."""
    return (all(r[0] for r in results), max(r[1] for r in results),
            max(r[2] for r in results))


def rope_cache(max_position, rot, base=10000.0):
    """(max_position, rot) float64: cos then sin of position * base ** -(2i / rot)."""
    angles = np.outer(np.arange(max_position), base ** -(np.arange(0, rot, 2) / rot))
    return np.concatenate((np.cos(angles), np.sin(angles)), -1)


def _partial(d):
    """A partial rotary_dim: about half the head, even, at least 2."""
    return max(2, d // 2 - (d // 2) % 2)


class _QkCase:
    """One QKV buffer of random rows (host and device) with q and k views and weights."""

    def __init__(self, rng, dev, dtype, shape, wdtype, offset):
        t, hq, hk, d = shape
        self.dtype, self.shape, self.dev = dtype, shape, dev
        self.buf = rng.standard_normal((t, (hq + 2 * hk) * d + QK_PAD)).astype(
            _dtypes.NUMPY[dtype])
        self.q, self.k = (self.buf[:, c:c + h * d].reshape(t, h, d)
                          for c, h in ((0, hq), (hq * d, hk)))
        mean = 0.0 if offset else 1.0
        self.w = [(mean + 0.1 * rng.standard_normal(d)).astype(_dtypes.NUMPY[wdtype])
                  for _ in range(2)]
        self.wd = [dev.put(w)[0] for w in self.w]
        self.offset = offset

    def device_views(self):
        """(device buffer, q view, k view, dtype keyword): a fresh device copy of the buffer."""
        t, hq, hk, d = self.shape
        bufd, kw = self.dev.to_device(self.buf.copy(), self.dtype)  # the CPU's is no copy
        return bufd, _heads(bufd, 0, hq, d), _heads(bufd, hq * d, hk, d), kw

    def split(self, buf):
        """(q, k, the rest) of a host buffer like self.buf."""
        t, hq, hk, d = self.shape
        return (buf[:, :hq * d].reshape(t, hq, d), buf[:, hq * d:(hq + hk) * d].reshape(t, hk, d),
                buf[:, (hq + hk) * d:])


def _qk_check(rng, dev, dtype, shape, wdtype, offset, rope=None, out_of_place=False):
    """qk_rms_norm_ on views of a QKV buffer against qk_rms_norm_ref (rope: (style, rot,
    cache dtype, position dtype)); with out_of_place, qk_rms_norm bitwise against it."""
    case = _QkCase(rng, dev, dtype, shape, wdtype, offset)
    t, _, _, d = shape
    kwargs = dict(weight_offset=offset)
    ref_kwargs = dict(weight_offset=offset)
    if rope is not None:
        style, rot, cache_dtype, pos_dtype = rope
        positions = rng.integers(0, MAX_POSITION, t).astype(pos_dtype)
        cache = rope_cache(MAX_POSITION, rot).astype(_dtypes.NUMPY[cache_dtype])
        kwargs.update(positions=dev.put(positions)[0], cos_sin_cache=dev.put(cache)[0],
                      rope_style=style, rotary_dim=rot)
        ref_kwargs.update(positions=positions, cos_sin_cache=cache, rope_style=style,
                          rotary_dim=rot)
    q_ref, k_ref = reference.qk_rms_norm_ref(case.q, case.k, *case.w, EPS, **ref_kwargs)
    bufd, qd, kd, kw = case.device_views()
    qk.qk_rms_norm_(qd, kd, *case.wd, EPS, dtype=kw, **kwargs)
    out = dev.get(bufd, dtype)
    q_out, k_out, rest = case.split(out)
    ok, rel, ulps = _worst([_numerics.within_contract(q_out, q_ref, dtype),
                            _numerics.within_contract(k_out, k_ref, dtype)])
    ok = ok and _bits_equal(rest, case.split(case.buf)[2])
    if out_of_place:
        bufd, qd, kd, kw = case.device_views()
        q2, k2 = qk.qk_rms_norm(qd, kd, *case.wd, EPS, dtype=kw, **kwargs)
        ok = (_bits_equal(dev.get(q2, dtype), q_out) and _bits_equal(dev.get(k2, dtype), k_out)
              and _bits_equal(dev.get(bufd, dtype), case.buf))
    return ok, rel, ulps


def _heads_check(rng, dev, dtype, shape, wdtype, offset):
    """rms_norm of the (T, Hq, D) q view: bitwise a contiguous copy's y and rstd, within the
    contract, and in place (out= the view) bitwise the same, the rest of the buffer untouched."""
    case = _QkCase(rng, dev, dtype, shape, wdtype, offset)
    t, hq, _, d = shape
    w, wd = case.w[0], case.wd[0]
    y_ref, rstd_ref = reference.rms_norm_ref(case.q, w, EPS, offset)
    bufd, qd, _, kw = case.device_views()
    y, rstd = functional.rms_norm(qd, wd, EPS, weight_offset=offset, return_rstd=True, dtype=kw)
    y, rstd = dev.get(y, dtype), dev.get(rstd, _dtypes.FLOAT32)
    ok, rel, ulps = _numerics.within_contract(y, y_ref, dtype)
    ok = ok and _numerics.within_contract(rstd, rstd_ref, _dtypes.FLOAT32)[0]
    xc, kw = dev.to_device(np.ascontiguousarray(case.q), dtype)
    yc, rstdc = functional.rms_norm(xc, wd, EPS, weight_offset=offset, return_rstd=True,
                                    dtype=kw)
    ok = (ok and rstd.shape == (t * hq,) and _bits_equal(y, dev.get(yc, dtype))
          and _bits_equal(rstd, dev.get(rstdc, _dtypes.FLOAT32)))
    functional.rms_norm(qd, wd, EPS, weight_offset=offset, out=qd, dtype=kw)
    q_out, k_out, rest = case.split(dev.get(bufd, dtype))
    _, k_in, rest_in = case.split(case.buf)
    return (ok and _bits_equal(q_out, y) and _bits_equal(k_out, k_in)
            and _bits_equal(rest, rest_in)), rel, ulps


# ---- gated RMSNorm: float64 references ----


def _silu64(z64):
    """(silu(z), sigmoid(z), silu'(z)) in float64."""
    sig = 1.0 / (1.0 + np.exp(-z64))
    return z64 * sig, sig, sig * (1.0 + z64 * (1.0 - sig))


def _grouped(a, g):
    """float64 (M, N) -> (M, N // g, g)."""
    a = reference.to_float64(a)
    return a.reshape(a.shape[0], -1, g)


def gated_ref(x, z, weight, eps, g, norm_before_gate, weight_offset=0.0):
    """(y (M, N), rstd (M, N // g)) in float64: each group of g columns normalised on its own;
    norm_before_gate False: y = rms_norm(x silu(z)) (w + offset), True: rms_norm(x) (w + offset)
    silu(z)."""
    x64, z64 = _grouped(x, g), _grouped(z, g)
    silu = _silu64(z64)[0]
    h = x64 if norm_before_gate else x64 * silu
    rstd = 1.0 / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps)
    y = h * rstd
    if weight is not None:
        y = y * (reference.to_float64(weight).reshape(-1, g) + weight_offset)
    if norm_before_gate:
        y = y * silu
    return y.reshape(x64.shape[0], -1), rstd[..., 0]


def gated_backward_ref(dy, x, z, weight, eps, g, norm_before_gate, weight_offset=0.0):
    """(dx, dz, dweight, s_x, s_z) in float64, rstd recomputed from x and z; dweight None
    without weight.  s_x and s_z are the sizes of the terms dx and dz are differences of, the
    scale of their error (docs/api.md's dx rule), times the gate's factor: the norm's input
    gradient is (w dn - h_hat c) rstd with c = mean(h_hat w dn), so its terms are
    |w dn rstd| and |h_hat rstd| times the size of c's summands, mean(|h_hat w dn|).  The
    second matters where c cancels (a float32 sum of g products, its error scales with them,
    not with c) and an element's two terms cancel as well: there |dy w rstd| alone would ask
    for more than float32 accumulation gives (seen on the CPU: 9x4096 in groups of 512,
    bfloat16, dx off by 2.6 ulp where c was 1.6e-4 of its summands' mean)."""
    x64, z64, dy64 = _grouped(x, g), _grouped(z, g), _grouped(dy, g)
    m = x64.shape[0]
    silu, _, dsilu = _silu64(z64)
    scale = 1.0 if weight is None else (reference.to_float64(weight).reshape(-1, g)
                                        + weight_offset)
    h = x64 if norm_before_gate else x64 * silu
    rstd = 1.0 / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps)
    h_hat = h * rstd
    dn = dy64 * silu if norm_before_gate else dy64     # the gradient reaching the norm's output
    wdn = dn * scale
    dh = (wdn - h_hat * np.mean(h_hat * wdn, axis=-1, keepdims=True)) * rstd
    s = np.abs(wdn * rstd) + np.abs(h_hat * rstd) * np.mean(np.abs(h_hat * wdn), axis=-1,
                                                            keepdims=True)
    if norm_before_gate:
        dx, s_x = dh, s
        dz = dy64 * h_hat * scale * dsilu
        s_z = np.abs(dz)
    else:
        dx, s_x = dh * silu, s * np.abs(silu)
        dz, s_z = dh * x64 * dsilu, s * np.abs(x64 * dsilu)
    dweight = None if weight is None else np.sum(dn * h_hat, axis=0).reshape(-1)
    flat = lambda a: a.reshape(m, -1)  # noqa: E731
    return flat(dx), flat(dz), dweight, flat(s_x), flat(s_z)


class _GatedCase:
    def __init__(self, rng, dev, dtype, shape, wdtype):
        m, n, group = shape
        self.dtype, self.wdtype, self.dev = dtype, wdtype, dev
        self.g = n if group is None else group
        self.kwargs = {} if group is None else {"group_size": group}
        self.x, self.z, self.dy = (rng.standard_normal((m, n)).astype(_dtypes.NUMPY[dtype])
                                   for _ in range(3))
        self.w = None if wdtype is None else (1 + 0.1 * rng.standard_normal(n)).astype(
            _dtypes.NUMPY[wdtype])
        self.xd, self.kw = dev.to_device(self.x, dtype)
        self.zd, self.dyd = (dev.to_device(a, dtype)[0] for a in (self.z, self.dy))
        self.wd = None if self.w is None else dev.put(self.w)[0]
        if self.kw is not None:
            self.kwargs["dtype"] = self.kw


def _gated_check(rng, dev, dtype, shape, wdtype, norm_before_gate):
    case = _GatedCase(rng, dev, dtype, shape, wdtype)
    y, rstd = gated.rms_norm_gated(case.xd, case.zd, case.wd, EPS,
                                   norm_before_gate=norm_before_gate, return_rstd=True,
                                   **case.kwargs)
    y_ref, rstd_ref = gated_ref(case.x, case.z, case.w, EPS, case.g, norm_before_gate)
    ok, rel, ulps = _numerics.within_contract(dev.get(y, dtype), y_ref, dtype)
    rstd = dev.get(rstd, _dtypes.FLOAT32)
    want = rstd_ref.shape if shape[2] is not None else rstd_ref.shape[:1]
    ok_r = rstd.shape == want and _numerics.within_contract(
        rstd.reshape(rstd_ref.shape), rstd_ref, _dtypes.FLOAT32)[0]
    return ok and ok_r, rel, ulps


def _gated_bwd_check(rng, dev, dtype, shape, wdtype, norm_before_gate, recompute):
    case = _GatedCase(rng, dev, dtype, shape, wdtype)
    rstd = None
    if not recompute:
        rstd = gated.rms_norm_gated(case.xd, case.zd, case.wd, EPS,
                                    norm_before_gate=norm_before_gate, return_rstd=True,
                                    **case.kwargs)[1]
    dx, dz, dw = gated.rms_norm_gated_backward(case.dyd, case.xd, case.zd, case.wd, rstd,
                                               norm_before_gate=norm_before_gate, eps=EPS,
                                               **case.kwargs)
    dx_ref, dz_ref, dw_ref, s_x, s_z = gated_backward_ref(case.dy, case.x, case.z, case.w, EPS,
                                                          case.g, norm_before_gate)
    ok, rel, ulps = _worst([
        _numerics.dx_within_contract(dev.get(dx, dtype), dx_ref, s_x, dtype),
        _numerics.dx_within_contract(dev.get(dz, dtype), dz_ref, s_z, dtype)])
    if case.w is None:
        ok = ok and dw is None
    else:
        ok = ok and _numerics.dweight_within_contract(dev.get(dw, case.wdtype), dw_ref,
                                                      case.wdtype)
    return ok, rel, ulps


# ---- the rows ----


def _qk_label(shape):
    t, hq, hk, d = shape
    return f"{t}x{hq}+{hk}x{d}"


def _gated_label(shape):
    m, n, group = shape
    return f"{m}x{n}" + ("" if group is None else f"/{group}")


def _rope(style, d, partial, dtype):
    """(style, rotary_dim, cache dtype, position dtype): neox with a float32 cache and int64
    positions, gptj with the cache in x's dtype and int32 positions."""
    rot = _partial(d) if partial else d
    if style == "neox":
        return style, rot, _dtypes.FLOAT32, np.int64
    return style, rot, dtype, np.int32


# Which rows run in which dtype.  Every kernel specialisation (dtype, weight dtype, RoPE style,
# gate, ...) compiles on first use, about a second each on the CPU, so the main path of each
# entry point runs in every dtype and each variant in one: MAIN rows everywhere, EXTRA rows in
# the dtype named.  16-bit gated rows take float32 weights in bfloat16 (mixed-precision
# training) and the x dtype's in float16.
MAIN = ("qk_ neox", "gated", "gated_bwd")
EXTRA = {"qk_": _dtypes.BFLOAT16, "qk_ gptj": _dtypes.FLOAT16, "qk": _dtypes.BFLOAT16,
         "heads": _dtypes.BFLOAT16, "gated nbg": _dtypes.BFLOAT16, "gbwd nbg": _dtypes.BFLOAT16}
ORDER = ("qk_", "qk_ neox", "qk_ gptj", "qk", "heads", "gated", "gated nbg", "gated_bwd",
         "gbwd nbg")


def _shapes(backend):
    """(QK shapes, gated shapes): on the CPU from two rows up, since a one-row view is
    C-contiguous there and compiles a kernel of its own; decode's single token on a GPU."""
    if backend in ("cuda", "hip"):
        return ((1, 32, 8, 128),) + QK_SHAPES, ((1, 4096, None), (1, 2560, 1280)) + GATED_SHAPES
    return QK_SHAPES, GATED_SHAPES


def _plan(dtype, backend="cpu"):
    """[(label, shape count, [(weight dtype, shape label, check(rng, dev))])]: the rows of one
    dtype (MAIN, EXTRA)."""
    qk_shapes, gated_shapes = _shapes(backend)
    gated_w = _dtypes.FLOAT32 if dtype in (_dtypes.FLOAT32, _dtypes.BFLOAT16) else dtype

    def qk_rows(style):
        return [(dtype, _qk_label(s) + (f" r{_partial(s[3])}" if partial else ""),
                 lambda rng, dev, s=s, p=partial: _qk_check(
                     rng, dev, dtype, s, dtype, 0.0, rope=_rope(style, s[3], p, dtype)))
                for s in qk_shapes for partial in ((False, True) if _partial(s[3]) < s[3]
                                                   else (False,))]

    def gated_rows(nbg):
        return [(gated_w, _gated_label(s), lambda rng, dev, s=s: _gated_check(
            rng, dev, dtype, s, gated_w, nbg)) for s in gated_shapes]

    def bwd_rows(nbg):
        # float32: every other shape with rstd=None (recomputed from x and z)
        return [(gated_w, _gated_label(s) + (" rstd=None" if i % 2 and dtype == _dtypes.FLOAT32
                                             and not nbg else ""),
                 lambda rng, dev, s=s, r=bool(i % 2 and dtype == _dtypes.FLOAT32 and not nbg):
                 _gated_bwd_check(rng, dev, dtype, s, gated_w, nbg, r))
                for i, s in enumerate(gated_shapes)]

    rows = {
        # no RoPE: float32 weights, every other shape with weight_offset=1.0 (Gemma's 1 + w)
        "qk_": (len(qk_shapes), [
            (_dtypes.FLOAT32, _qk_label(s), lambda rng, dev, s=s, o=float(i % 2): _qk_check(
                rng, dev, dtype, s, _dtypes.FLOAT32, o)) for i, s in enumerate(qk_shapes)]),
        "qk_ neox": (len(qk_shapes), qk_rows("neox")),
        "qk_ gptj": (len(qk_shapes), qk_rows("gptj")),
        "qk": (len(qk_shapes), [
            (dtype, _qk_label(s), lambda rng, dev, s=s: _qk_check(
                rng, dev, dtype, s, dtype, 0.0, rope=_rope("neox", s[3], False, dtype),
                out_of_place=True)) for s in qk_shapes]),
        "heads": (len(qk_shapes), [
            (dtype, _qk_label(s), lambda rng, dev, s=s, o=float(i % 2): _heads_check(
                rng, dev, dtype, s, dtype, o)) for i, s in enumerate(qk_shapes)]),
        "gated": (len(gated_shapes), gated_rows(False)),
        "gated nbg": (len(gated_shapes), gated_rows(True)),
        "gated_bwd": (len(gated_shapes), bwd_rows(False)),
        "gbwd nbg": (len(gated_shapes), bwd_rows(True)),
    }
    return [(label,) + rows[label] for label in ORDER
            if label in MAIN or EXTRA.get(label) == dtype]


def check(rng, to_device, to_host, verbose, backend="cpu", dtypes=_dtypes.ACTIVATION_DTYPES):
    """Prints the rows of each dtype; returns the number of failing cases.  backend: the
    checked backend's name (cli.detect), which picks the shapes (``_shapes``)."""
    dev = _Device(to_device, to_host)
    failures = 0
    for dtype in dtypes:
        for label, count, cases in _plan(dtype, backend):
            bad = 0
            for wdtype, shape, run in cases:
                error = None
                try:
                    ok, rel, ulps = run(rng, dev)
                except Exception as exc:   # a case that raises fails; the others still run
                    ok, rel, ulps = False, float("nan"), float("nan")
                    error = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:200]
                bad += not ok
                if not ok or verbose:
                    print(f"{label:10s} {dtype:9s} {str(wdtype):9s} {shape:>12s}  {rel:9.2e} "
                          f"{ulps:8.2f}  {'ok' if ok else 'FAIL'}"
                          + (f"  {error}" if error else ""))
            failures += bad
            print(f"{label:10s} {dtype:9s} {'all':9s} {count:>5d} shapes  "
                  f"{'':9s} {'':8s}  {'ok' if not bad else 'FAIL'}")
    return failures
