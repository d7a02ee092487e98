"""Random calls of every entry point checked against the float64 references (docs/api.md's numerical
contract, through ``rmsnorm_hip._numerics``), shared by the CPU / simulator fuzz
(tests/test_fuzz.py) and the GPU one (tests/test_device_reliability.py).

A :class:`Case` is drawn by :func:`cases` (hypothesis); :func:`check_case` builds its arrays in an
array library (:class:`NumpyLib`, :class:`TorchLib`, :class:`CupyLib`), calls the entry point and
checks, beyond the contract:

- every row array sits in its own buffer with guard rows and columns around the view, poisoned
  with 0xFF bytes; ``out=`` and in-place arrays keep their guards, inputs keep every byte;
- outputs and workspaces the library allocates are poisoned and guarded too (tests/_guard.py):
  nothing written outside them, every element written;
- layout invariance (bitwise): the same call on contiguous copies gives the same bits; the fused
  y is ``rms_norm(residual_out)``; in place equals out of place.

No side effects on import; torch / CuPy are imported by their adapters only.
"""
import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np
from _guard import guarded_outputs
from hypothesis import strategies as st

from rmsnorm_hip import (_numerics, fused_add_rms_norm, fused_add_rms_norm_, reference, rms_norm,
                         rms_norm_backward, rms_norm_quant)

OPS = ("fwd", "fused", "fused_", "quant", "bwd")
DTYPES = ("float32", "float16", "bfloat16")
QUANTS = ("int8", "float8_e4m3fn")
NUMPY = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
         "bfloat16": np.dtype(ml_dtypes.bfloat16), "int8": np.dtype(np.int8),
         "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn)}
POISON = 0xFF
GUARD_ROWS = 1


@dataclass(frozen=True)
class Layout:
    """Where a row array's rows sit in their buffer: ``offset`` elements before each row and
    ``pad`` after it (row stride offset + N + pad); (0, 0) is a contiguous array."""
    offset: int = 0
    pad: int = 0


CONTIGUOUS = Layout()
# contiguous; 16-byte aligned starts with strided rows (vector path when N fits); starts one
# element or a few elements past a boundary (scalar path); wide and narrow pads
LAYOUTS = (CONTIGUOUS, CONTIGUOUS, Layout(0, 8), Layout(8, 8), Layout(1, 0), Layout(1, 7),
           Layout(3, 16), Layout(0, 3))


@dataclass(frozen=True)
class Case:
    op: str
    dtype: str
    lead: tuple                 # x's leading dims: () is a 1-D x (one row)
    n: int
    eps: float
    seed: int
    weight: str = None          # None | "same" (x's dtype) | "float32"
    weight_offset: float = 0.0
    vec_offset: int = 0         # weight / xscale start this many elements into their buffer
    scale: float = 1.0          # of x (and residual)
    x_layout: Layout = CONTIGUOUS
    other_layout: Layout = CONTIGUOUS   # residual, dy
    out: object = None          # fwd: None, a Layout (out= in its own buffer) or "x" (in place)
    return_rstd: bool = False   # fwd, fused
    residual: bool = False      # quant
    xscale: str = None          # quant: None | "same" | "float32"
    quant: str = "int8"
    given_rstd: bool = False    # bwd
    dresidual: bool = False     # bwd
    zero_row: bool = False      # row 0 of x (and residual) all zeros

    @property
    def m(self):
        return math.prod(self.lead)

    @property
    def shape(self):
        return self.lead + (self.n,)

    def wdtype(self, which):
        kind = self.weight if which == "weight" else self.xscale
        return None if kind is None else self.dtype if kind == "same" else "float32"


@dataclass(frozen=True)
class Sizes:
    """The M and N a tier draws: mostly ``small`` (M up to max_m, N up to small_n, or one of
    small_n when it is a tuple: each N is a kernel to compile on the GPU), then ``awkward`` N
    (M up to awkward_m), and rarely ``big`` N (M up to big_m)."""
    max_m: int
    small_n: object
    awkward: tuple
    awkward_m: int
    big: tuple = ()
    big_m: int = 2
    max_elements: int = 1 << 19     # M * N (the CPU backend goes parallel at 2**20)


def cases(op, sizes, ops_with_strides=True):
    """A hypothesis strategy of :class:`Case` for ``op`` at ``sizes``."""
    @st.composite
    def draw_case(draw):
        dtype = draw(st.sampled_from(DTYPES))
        kinds = ["small"] * 6 + ["awkward"] * 3 + (["big"] if sizes.big else [])
        kind = draw(st.sampled_from(kinds))
        if kind == "small":
            ns = (st.sampled_from(sizes.small_n) if isinstance(sizes.small_n, tuple)
                  else st.integers(1, sizes.small_n))
            n, m = draw(ns), draw(st.integers(1, sizes.max_m))
        elif kind == "awkward":
            n, m = draw(st.sampled_from(sizes.awkward)), draw(st.integers(1, sizes.awkward_m))
        else:
            n, m = draw(st.sampled_from(sizes.big)), draw(st.integers(1, sizes.big_m))
        if draw(st.sampled_from([False] * 19 + [True])):
            m = 0                       # an empty batch, now and then
        m = min(m, max(1, sizes.max_elements // n))
        shape_kind = draw(st.sampled_from(["2d", "2d", "1d", "3d"]))
        if shape_kind == "1d" and m == 1:
            lead = ()
        elif shape_kind == "3d" and m >= 4 and m % 2 == 0:
            lead = (2, m // 2)
        else:
            lead = (m,)
        layouts = st.sampled_from(LAYOUTS) if ops_with_strides else st.just(CONTIGUOUS)
        eps = draw(st.sampled_from([1e-6, 1e-6, 1e-5, 0.0, 1e-12, 0.1, 1.0]))
        weight = draw(st.sampled_from([None, "same", "float32"]))
        fields = dict(
            op=op, dtype=dtype, lead=lead, n=n, eps=eps, seed=draw(st.integers(0, 2 ** 32 - 1)),
            weight=weight,
            weight_offset=draw(st.sampled_from([0.0, 0.0, 1.0, -0.5, 0.25])) if weight else 0.0,
            vec_offset=draw(st.sampled_from([0, 0, 1])),
            scale=draw(st.sampled_from([1.0, 1.0, 1e-3, 30.0])),
            x_layout=draw(layouts), other_layout=draw(layouts),
            # an all-zero row has rstd = 1/sqrt(eps): its dx (dy * rstd) overflows float16 for
            # eps < ~1e-9, outside what the contract speaks about
            zero_row=m > 0 and eps >= (1e-6 if op == "bwd" else 1e-12) and draw(st.booleans()))
        if op == "fwd":
            fields["out"] = draw(st.sampled_from([None, None, "x"]) | layouts)
        if op in ("fwd", "fused"):
            fields["return_rstd"] = draw(st.booleans())
        if op == "quant":
            fields.update(residual=draw(st.booleans()), quant=draw(st.sampled_from(QUANTS)),
                          xscale=draw(st.sampled_from([None, "same", "float32"])))
        if op == "bwd":
            fields.update(given_rstd=draw(st.booleans()), dresidual=draw(st.booleans()))
        return Case(**fields)

    return draw_case()


# ---- array libraries --------------------------------------------------------------------------
class NumpyLib:
    """Host arrays (the CPU and simulator backends).  A library adapter makes buffers from host
    data, views into them, copies, and brings arrays back as NumPy (ml_dtypes) arrays."""
    name = "numpy"

    def dtype_kw(self, dtype):
        return {}

    def to_device(self, host):
        return host.copy()

    def to_host(self, a, dtype):
        a = np.asarray(a)
        return a.view(NUMPY[dtype]) if a.dtype != NUMPY[dtype] else a.copy()

    def copy(self, a):
        return a.copy()

    def bytes_of(self, buf):
        return np.ascontiguousarray(buf).reshape(-1).view(np.uint8).copy()


class TorchLib(NumpyLib):
    name = "torch"

    def __init__(self, device="cuda"):
        import torch
        self.torch, self.device = torch, device

    def to_device(self, host):
        torch = self.torch
        target = {NUMPY["bfloat16"]: torch.bfloat16, NUMPY["float16"]: torch.float16,
                  NUMPY["float8_e4m3fn"]: torch.float8_e4m3fn}.get(host.dtype)
        if target is None:
            return torch.from_numpy(np.ascontiguousarray(host)).to(self.device)
        bits = host.view(np.int16 if host.dtype.itemsize == 2 else np.uint8)
        return torch.from_numpy(np.ascontiguousarray(bits)).to(self.device).view(target)

    def to_host(self, a, dtype):
        torch = self.torch
        a = a.detach()
        if a.dtype in (torch.bfloat16, torch.float16):
            return a.view(torch.int16).cpu().numpy().view(NUMPY[dtype])
        if a.dtype == torch.float8_e4m3fn:
            return a.view(torch.uint8).cpu().numpy().view(NUMPY[dtype])
        return a.cpu().numpy()

    def copy(self, a):
        return a.clone()

    def bytes_of(self, buf):
        return buf.contiguous().view(-1).view(self.torch.uint8).cpu().numpy()


class CupyLib(NumpyLib):
    """CuPy arrays; 16-bit floats travel as uint16 with ``dtype=``, float8 comes back as uint8."""
    name = "cupy"

    def __init__(self):
        import cupy
        self.cupy = cupy

    def dtype_kw(self, dtype):
        return {"dtype": dtype} if dtype in ("float16", "bfloat16") else {}

    def to_device(self, host):
        return self.cupy.asarray(_plain(host))

    def to_host(self, a, dtype):
        return a.get().view(NUMPY[dtype])

    def copy(self, a):
        return a.copy()

    def bytes_of(self, buf):
        return self.cupy.ascontiguousarray(buf).reshape(-1).view(self.cupy.uint8).get()


def _plain(host):
    """bfloat16 / float8 host data as the unsigned integers that hold their bits."""
    if host.dtype in (NUMPY["bfloat16"], NUMPY["float16"]):
        return host.view(np.uint16)
    if host.dtype == NUMPY["float8_e4m3fn"]:
        return host.view(np.uint8)
    return host


@dataclass
class Placed:
    """A row array in its poisoned buffer: ``view`` is what the entry point gets."""
    buffer: object
    view: object
    mask: np.ndarray            # bytes of the buffer that belong to the view


def place_rows(lib, host, layout, lead):
    """``host`` (M, N) in a buffer of M + 2 guard rows of stride offset + N + pad, the rest 0xFF."""
    m, n = host.shape
    stride = layout.offset + n + layout.pad
    rows = m + 2 * GUARD_ROWS
    buf = np.full((rows, stride), 0, host.dtype)
    buf.view(np.uint8)[...] = POISON
    inside = (slice(GUARD_ROWS, GUARD_ROWS + m), slice(layout.offset, layout.offset + n))
    buf[inside] = host
    mask = np.zeros((rows, stride * host.dtype.itemsize), bool)
    item = host.dtype.itemsize
    mask[GUARD_ROWS:GUARD_ROWS + m, layout.offset * item:(layout.offset + n) * item] = True
    dev = lib.to_device(buf)
    view = dev[inside[0], inside[1]]
    if lead == ():
        view = view[0]
    elif len(lead) > 1:     # splits the row dimension: a view in every library (torch: asserted)
        view = view.view(lead + (n,)) if lib.name == "torch" else view.reshape(lead + (n,))
    return Placed(dev, view, mask.reshape(-1))


def place_vector(lib, host, offset):
    n = host.shape[0]
    buf = np.zeros(n + offset + 1, host.dtype)
    buf.view(np.uint8)[...] = POISON
    buf[offset:offset + n] = host
    return lib.to_device(buf)[offset:offset + n]


def assert_guards(lib, placed, what, before=None):
    """Bytes of ``placed``'s buffer outside its view are still poison (or equal ``before``)."""
    now = lib.bytes_of(placed.buffer)
    outside = ~placed.mask
    expected = np.full(now.shape, POISON, np.uint8) if before is None else before
    bad = np.flatnonzero(outside & (now != expected))
    assert bad.size == 0, f"{what}: {bad.size} byte(s) written outside the array (first at " \
                          f"buffer byte {bad[0]})"


def assert_bits(lib, a, b, dtype, what):
    ha, hb = lib.to_host(a, dtype), lib.to_host(b, dtype)
    assert ha.shape == hb.shape, f"{what}: shape {ha.shape} != {hb.shape}"
    ba = np.ascontiguousarray(ha).reshape(-1).view(np.uint8)
    bb = np.ascontiguousarray(hb).reshape(-1).view(np.uint8)
    assert np.array_equal(ba, bb), f"{what}: not bitwise equal"


def _ok(result, what):
    ok, rel, worst = result if isinstance(result, tuple) else (result, None, None)
    assert ok, f"{what} outside the contract: relative error {rel}, worst {worst}"


def _rows(a, n):
    return np.asarray(a, np.float64).reshape(-1, n)


# ---- the checks -------------------------------------------------------------------------------
class Inputs:
    """The host data of a case (rounded to its dtypes) and its arrays in ``lib``."""

    def __init__(self, case, lib):
        self.case, self.lib = case, lib
        rng = np.random.default_rng(case.seed)
        m, n, dt = case.m, case.n, NUMPY[case.dtype]

        def rows(scale=1.0):
            a = (scale * rng.standard_normal((m, n))).astype(dt)
            if case.zero_row:
                a[0] = 0
            return a

        self.x = rows(case.scale)
        self.residual = rows(case.scale) if case.op in ("fused", "fused_") or case.residual \
            else None
        wdt = case.wdtype("weight")
        self.weight = None if wdt is None else (
            1.0 - case.weight_offset + 0.5 * rng.standard_normal(n)).astype(NUMPY[wdt])
        sdt = case.wdtype("xscale")
        self.xscale = None if sdt is None else (0.5 + rng.random(n)).astype(NUMPY[sdt])
        self.dy = rows() if case.op == "bwd" else None
        if self.dy is not None and case.zero_row:
            self.dy[0] = (rng.standard_normal(n)).astype(dt)
        self.dresidual = (0.1 * rng.standard_normal((m, n))).astype(dt) if case.dresidual \
            else None
        self.rstd = None
        if case.given_rstd:
            self.rstd = reference.rms_norm_ref(self.x, None, case.eps)[1].astype(np.float32)

        self.placed = {}
        for name, layout in (("x", case.x_layout), ("residual", case.other_layout),
                             ("dy", case.other_layout), ("dresidual", case.x_layout)):
            host = getattr(self, name)
            if host is not None:
                self.placed[name] = place_rows(lib, host, layout, case.lead)
        self.vectors = {name: place_vector(lib, getattr(self, name), case.vec_offset)
                        for name in ("weight", "xscale") if getattr(self, name) is not None}
        if self.rstd is not None:
            self.vectors["rstd"] = lib.to_device(self.rstd)
        self.before = {name: lib.bytes_of(p.buffer) for name, p in self.placed.items()}

    def arg(self, name):
        if name in self.placed:
            return self.placed[name].view
        return self.vectors.get(name)

    def contiguous(self, name):
        """The same values in a new contiguous array (the layout-invariance twin)."""
        a = self.arg(name)
        if a is None:
            return None
        if self.lib.name == "torch":
            return a.contiguous().clone()
        if self.lib.name == "cupy":
            return self.lib.cupy.ascontiguousarray(a).copy()
        return np.ascontiguousarray(a).copy()

    def assert_inputs_unchanged(self, skip=()):
        for name, placed in self.placed.items():
            if name not in skip:
                now = self.lib.bytes_of(placed.buffer)
                assert np.array_equal(now, self.before[name]), f"input {name} was modified"

    def kw(self):
        return dict(weight_offset=self.case.weight_offset, **self.lib.dtype_kw(self.case.dtype))


def check_case(case, lib, invariance=True, repeat=True):
    """Runs ``case`` through ``lib``'s arrays and asserts everything the module docstring lists;
    ``invariance``: also the contiguous twins; ``repeat``: also dweight run to run."""
    data = Inputs(case, lib)
    CHECKS[case.op](case, lib, data, invariance and (repeat or "no_repeat"))


def _call(fn, *args, **kwargs):
    with guarded_outputs() as guards:
        result = fn(*args, **kwargs)
    guards.check(written=True)
    return result


def check_fwd(case, lib, data, invariance):
    n, dtype = case.n, case.dtype
    x, w = data.arg("x"), data.arg("weight")
    out, out_placed = None, None
    if case.out == "x":
        out_placed = place_rows(lib, data.x, case.x_layout, case.lead)
        x = out = out_placed.view
    elif case.out is not None:
        poison = np.empty_like(data.x)
        poison.view(np.uint8)[...] = POISON
        out_placed = place_rows(lib, poison, case.out, case.lead)
        out = out_placed.view
    result = _call(rms_norm, x, w, case.eps, out=out, return_rstd=case.return_rstd, **data.kw())
    y, rstd = result if case.return_rstd else (result, None)
    if out is not None:
        assert y is out, "out= is returned"
        assert_guards(lib, out_placed, "out")
    y_ref, rstd_ref = reference.rms_norm_ref(data.x, data.weight, case.eps, case.weight_offset)
    _ok(_numerics.within_contract(_rows(lib.to_host(y, dtype), n), y_ref, dtype), "y")
    assert tuple(lib.to_host(y, dtype).shape) == case.shape, "y has x's shape"
    if rstd is not None:
        assert lib.to_host(rstd, "float32").shape == (case.m,)
        _ok(_numerics.within_contract(lib.to_host(rstd, "float32"), rstd_ref, "float32"), "rstd")
    data.assert_inputs_unchanged()
    if invariance:
        twin = _call(rms_norm, data.contiguous("x"), data.contiguous("weight"), case.eps,
                     **data.kw())
        assert_bits(lib, twin, y, dtype, "y of a contiguous copy")


def check_fused(case, lib, data, invariance):
    n, dtype = case.n, case.dtype
    x, r, w = data.arg("x"), data.arg("residual"), data.arg("weight")
    result = _call(fused_add_rms_norm, x, r, w, case.eps, return_rstd=case.return_rstd,
                   **data.kw())
    y, ro = result[:2]
    y_ref, h_ref, rstd_ref = reference.fused_add_rms_norm_ref(data.x, data.residual, data.weight,
                                                              case.eps, case.weight_offset)
    assert np.array_equal(_rows(lib.to_host(ro, dtype), n), h_ref), \
        "residual_out is not x + residual rounded once"
    _ok(_numerics.within_contract(_rows(lib.to_host(y, dtype), n), y_ref, dtype), "y")
    if case.return_rstd:
        _ok(_numerics.within_contract(lib.to_host(result[2], "float32"), rstd_ref, "float32"),
            "rstd")
    data.assert_inputs_unchanged()
    assert_bits(lib, _call(rms_norm, ro, w, case.eps, **data.kw()), y, dtype,
                "y against rms_norm(residual_out)")
    if invariance:
        y2, ro2 = _call(fused_add_rms_norm, data.contiguous("x"), data.contiguous("residual"),
                        data.contiguous("weight"), case.eps, **data.kw())
        assert_bits(lib, y2, y, dtype, "y of contiguous copies")
        assert_bits(lib, ro2, ro, dtype, "residual_out of contiguous copies")
    return y, ro


def check_fused_in_place(case, lib, data, invariance):
    """fused_add_rms_norm_ on copies laid out like x and residual: bitwise the out-of-place
    results (checked against the reference by check_fused), guards of both buffers kept."""
    y, ro = check_fused(case, lib, data, invariance=False)
    xp = place_rows(lib, data.x, case.x_layout, case.lead)
    rp = place_rows(lib, data.residual, case.other_layout, case.lead)
    assert _call(fused_add_rms_norm_, xp.view, rp.view, data.arg("weight"), case.eps,
                 **data.kw()) is None
    assert_bits(lib, xp.view, y, case.dtype, "x after fused_add_rms_norm_ (y)")
    assert_bits(lib, rp.view, ro, case.dtype, "residual after fused_add_rms_norm_")
    assert_guards(lib, xp, "x (in place)")
    assert_guards(lib, rp, "residual (in place)")


def check_quant(case, lib, data, invariance):
    n, dtype = case.n, case.dtype
    x, w, s, r = (data.arg(k) for k in ("x", "weight", "xscale", "residual"))
    result = _call(rms_norm_quant, x, w, case.eps, xscale=s, residual=r, quant_dtype=case.quant,
                   **data.kw())
    assert len(result) == (3 if case.residual else 2)
    q, yscale = result[:2]
    ref = reference.rms_norm_quant_ref(data.x, data.weight, case.eps, xscale=data.xscale,
                                       residual=data.residual, quant_dtype=case.quant,
                                       weight_offset=case.weight_offset)
    qh, ysh = lib.to_host(q, case.quant), lib.to_host(yscale, "float32")
    assert qh.shape == case.shape and ysh.shape == (case.m,)
    if case.m:
        _ok(_numerics.quant_within_contract(_rows(qh, n), ysh, _rows(ref[0], n), ref[1],
                                            case.quant), "q / yscale")
    if case.residual:
        assert np.array_equal(_rows(lib.to_host(result[2], dtype), n), _rows(ref[2], n)), \
            "residual_out is not x + residual rounded once"
    data.assert_inputs_unchanged()
    if invariance:
        twin = _call(rms_norm_quant, data.contiguous("x"), data.contiguous("weight"), case.eps,
                     xscale=data.contiguous("xscale"), residual=data.contiguous("residual"),
                     quant_dtype=case.quant, **data.kw())
        assert_bits(lib, twin[0], q, case.quant, "q of contiguous copies")
        assert_bits(lib, twin[1], yscale, "float32", "yscale of contiguous copies")


def check_bwd(case, lib, data, invariance):
    n, dtype = case.n, case.dtype
    args = (data.arg("dy"), data.arg("x"), data.arg("weight"), data.arg("rstd"))
    dx, dw = _call(rms_norm_backward, *args, dresidual=data.arg("dresidual"), eps=case.eps,
                   **data.kw())
    dx_ref, dw_ref = reference.rms_norm_backward_ref(
        data.dy, data.x, data.weight, data.rstd, case.eps, case.weight_offset, data.dresidual)
    rstd = data.rstd if data.rstd is not None else reference.rms_norm_ref(
        data.x, None, case.eps)[1]
    scale = 1.0 if data.weight is None else data.weight.astype(np.float64) + case.weight_offset
    s = np.abs(_rows(data.dy, n) * scale * np.asarray(rstd, np.float64).reshape(-1, 1))
    dxh = lib.to_host(dx, dtype)
    assert dxh.shape == case.shape
    _ok(_numerics.dx_within_contract(_rows(dxh, n), _rows(dx_ref, n), s, dtype), "dx")
    if data.weight is None:
        assert dw is None
    else:
        wdt = case.wdtype("weight")
        dwh = lib.to_host(dw, wdt)
        assert dwh.shape == (n,)
        if not np.any(dw_ref):
            assert not np.any(dwh.astype(np.float64)), "dweight of no rows (or zero rows) is 0"
        else:
            assert _numerics.dweight_within_contract(dwh, dw_ref, wdt), "dweight outside contract"
    data.assert_inputs_unchanged()
    if invariance:
        dx2, dw2 = _call(rms_norm_backward, data.contiguous("dy"), data.contiguous("x"),
                         data.contiguous("weight"), data.contiguous("rstd"),
                         dresidual=data.contiguous("dresidual"), eps=case.eps, **data.kw())
        assert_bits(lib, dx2, dx, dtype, "dx of contiguous copies")
        if dw is not None and invariance != "no_repeat":  # deterministic: same inputs, same bits
            dw3 = _call(rms_norm_backward, *args, dresidual=data.arg("dresidual"), eps=case.eps,
                        **data.kw())[1]
            assert_bits(lib, dw3, dw, case.wdtype("weight"), "dweight run to run")


CHECKS = {"fwd": check_fwd, "fused": check_fused, "fused_": check_fused_in_place,
          "quant": check_quant, "bwd": check_bwd}
