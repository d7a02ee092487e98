"""Argument checks at the public boundary.  Every message starts with the function name and names
the argument, what was expected and what was given.  Types raise TypeError; shapes, strides,
dtype combinations, devices and values raise ValueError.  Nothing is launched before these pass."""
import math
import operator

import numpy as np

from . import _dtypes


def activation_dtype(info, fn, arg):
    if info.dtype not in _dtypes.ACTIVATION_DTYPES:
        raise TypeError(f"{fn}: {arg} must have dtype float32, float16 or bfloat16, "
                        f"got {info.dtype}")


def rows(info, fn, arg):
    """(M, N, row_stride) of an array whose leading dims flatten to rows of unit-stride elements."""
    shape, strides = info.shape, info.strides
    if len(shape) == 0:
        raise ValueError(f"{fn}: {arg} must have at least 1 dimension, got a 0-d array")
    n = shape[-1]
    if n == 0:
        raise ValueError(f"{fn}: {arg} must have a non-empty last dimension, got shape {shape}")
    m = math.prod(shape[:-1])
    if m == 0:  # nothing is read or written; NumPy >= 2.4 reports zero strides here
        return m, n, n
    if any(not float(s).is_integer() for s in strides):
        raise ValueError(f"{fn}: {arg} strides must be whole elements, got {strides}")
    if n > 1 and strides[-1] != 1:
        raise ValueError(f"{fn}: {arg} must have unit stride in its last dimension, "
                         f"got stride {strides[-1]} (shape {shape})")
    lead = [(d, s) for d, s in zip(shape[:-1], strides[:-1]) if d != 1]
    if not lead:
        return m, n, n
    row_stride = lead[-1][1]
    if row_stride < n:
        raise ValueError(f"{fn}: {arg} row stride must be >= its last dimension {n} "
                         f"(zero, negative and overlapping strides are not supported), "
                         f"got strides {strides} for shape {shape}")
    for (d_outer, s_outer), (d_inner, s_inner) in zip(lead[:-1], lead[1:]):
        if s_outer != s_inner * d_inner:
            raise ValueError(f"{fn}: {arg} leading dimensions must flatten to one row stride, "
                             f"got strides {strides} for shape {shape}")
    return m, n, int(row_stride)


def _break(shape, strides):
    """Index of the first leading dim (of those before the last) after which the leading dims
    stop flattening to one stride, or None."""
    lead = [(i, d, s) for i, (d, s) in enumerate(zip(shape[:-1], strides[:-1])) if d != 1]
    for (_, _, s_outer), (i, d_inner, s_inner) in zip(lead[:-1], lead[1:]):
        if s_outer != s_inner * d_inner:
            return i
    return None


def row_split(infos):
    """Where same-shaped arrays' leading dims split into two groups that each flatten to one
    stride (the first break any of them has), or None when every array is rows at one row
    stride."""
    for info in infos:
        if info is not None and math.prod(info.shape[:-1]) > 0:
            at = _break(tuple(info.shape), tuple(info.strides))
            if at is not None:
                return at
    return None


def head_rows(info, split, fn, arg):
    """(M, N, (stride, head_stride), H) of an array of rows whose leading dims flatten to two
    strides: dims [:split] at ``stride``, the H rows of dims [split:-1] at ``head_stride`` (a
    (T, H, D) view of a QKV buffer: split 1, strides (row, D)).  No two rows may share an
    element."""
    shape, strides = tuple(info.shape), tuple(info.strides)
    n = shape[-1]
    m = math.prod(shape[:-1])
    if n == 0:
        raise ValueError(f"{fn}: {arg} must have a non-empty last dimension, got shape {shape}")
    if any(not float(s).is_integer() for s in strides):
        raise ValueError(f"{fn}: {arg} strides must be whole elements, got {strides}")
    if n > 1 and strides[-1] != 1:
        raise ValueError(f"{fn}: {arg} must have unit stride in its last dimension, "
                         f"got stride {strides[-1]} (shape {shape})")
    groups = []
    for dims in (range(split), range(split, len(shape) - 1)):
        lead = [(shape[i], int(strides[i])) for i in dims if shape[i] != 1]
        for (_, s_outer), (d_inner, s_inner) in zip(lead[:-1], lead[1:]):
            if s_outer != s_inner * d_inner:
                raise ValueError(f"{fn}: {arg} leading dimensions must flatten to at most two "
                                 f"strides (tokens, then heads), got strides {strides} for "
                                 f"shape {shape}")
        groups.append((math.prod(d for d, _ in lead), lead[-1][1] if lead else 0))
    (t, ts), (h, hs) = groups
    hs = hs if h > 1 else n
    ts = ts if t > 1 else h * hs
    (a, na), (b, nb) = sorted([(hs, h), (ts, t)])
    if (na > 1 and a < n) or (nb > 1 and b < a * (na - 1) + n):
        raise ValueError(f"{fn}: {arg} rows must not overlap (zero, negative and overlapping "
                         f"strides are not supported), got strides {strides} for shape {shape}")
    if m >= 1 << 31:
        raise ValueError(f"{fn}: {arg} with two row strides may have at most 2**31 - 1 rows, got "
                         f"shape {shape}")
    return m, n, (ts, hs), h


def heads(info, fn, arg, max_d):
    """(T, H, D, (token stride, head stride)) of a (..., H, D) array of head rows: unit-stride
    rows of D elements whose leading dims flatten to T tokens at one stride, heads at another;
    no two head rows share an element."""
    shape, strides = tuple(info.shape), tuple(info.strides)
    if len(shape) < 2:
        raise ValueError(f"{fn}: {arg} must have shape (..., heads, head_size), got shape {shape}")
    t, (h, d) = math.prod(shape[:-2]), shape[-2:]
    if d == 0 or d > max_d:
        raise ValueError(f"{fn}: {arg} head size (last dimension) must be 1 to {max_d}, got "
                         f"shape {shape}")
    if t * h == 0:
        return t, h, d, (d, d)
    if any(not float(s).is_integer() for s in strides):
        raise ValueError(f"{fn}: {arg} strides must be whole elements, got {strides}")
    if d > 1 and strides[-1] != 1:
        raise ValueError(f"{fn}: {arg} must have unit stride in its last dimension, got stride "
                         f"{strides[-1]} (shape {shape})")
    lead = [(n, s) for n, s in zip(shape[:-2], strides[:-2]) if n != 1]
    for (_, s_outer), (n_inner, s_inner) in zip(lead[:-1], lead[1:]):
        if s_outer != s_inner * n_inner:
            raise ValueError(f"{fn}: {arg} leading dimensions (before heads) must flatten to one "
                             f"token stride, got strides {strides} for shape {shape}")
    ts = int(lead[-1][1]) if lead else h * max(int(strides[-2]), d)
    hs = int(strides[-2]) if h > 1 else d
    # heads within a token and tokens apart, in either order, must not meet
    (a, na), (b, nb) = sorted([(hs, h), (ts, t)])
    if (na > 1 and a < d) or (nb > 1 and b < a * (na - 1) + d):
        raise ValueError(f"{fn}: {arg} head rows must not overlap (zero, negative and "
                         f"overlapping strides are not supported), got strides {strides} for "
                         f"shape {shape}")
    return t, h, d, (ts, hs)


def dense(info):
    """Whether an array's elements are consecutive in C order (size-1 dims aside; empty arrays
    are, whatever strides NumPy gives them)."""
    if 0 in tuple(info.shape):
        return True
    expected = 1
    for d, s in reversed(list(zip(info.shape, info.strides))):
        if d != 1 and s != expected:
            return False
        expected *= d
    return True


def same_place(info, like, fn, arg):
    """``info`` on x's device; any array library (outputs follow x's)."""
    if (info.device, info.device_index) != (like.device, like.device_index):
        raise ValueError(f"{fn}: {arg} must be on the same device as x ({_where(like)}), "
                         f"got {_where(info)}")


def _where(info):
    return "cpu" if info.device == "cpu" else f"{info.device}:{info.device_index}"


def vector(info, like, n, fn, arg, dtypes, like_name="x"):
    """A (n,) unit-stride parameter vector (weight, xscale) on x's device with one of ``dtypes``."""
    same_place(info, like, fn, arg)
    if info.dtype not in dtypes:
        raise TypeError(f"{fn}: {arg} must have dtype {' or '.join(dtypes)} for {like_name} of "
                        f"dtype {like.dtype}, got {info.dtype}")
    if info.shape != (n,):
        raise ValueError(f"{fn}: {arg} must have shape ({n},), got {info.shape}")
    if n > 1 and info.strides[-1] != 1:
        raise ValueError(f"{fn}: {arg} must be contiguous, got stride {info.strides[-1]}")


def like_x(info, x, fn, arg, split=None):
    """An array (dy, residual, dresidual) with x's shape, dtype, device and library; its row
    stride (rows may be strided like x's), or with a ``split`` (row_split) its (stride,
    head_stride)."""
    same_place(info, x, fn, arg)
    if info.dtype != x.dtype:
        raise TypeError(f"{fn}: {arg} must have x's dtype {x.dtype}, got {info.dtype}")
    if tuple(info.shape) != tuple(x.shape):
        raise ValueError(f"{fn}: {arg} must have x's shape {tuple(x.shape)}, "
                         f"got {tuple(info.shape)}")
    return (rows(info, fn, arg) if split is None else head_rows(info, split, fn, arg))[2]


def weight_dtypes(x_dtype):
    return (x_dtype,) if x_dtype == _dtypes.FLOAT32 else (x_dtype, _dtypes.FLOAT32)


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _real(value, fn, arg, what):
    """``value`` as a Python float that float32 holds finitely: a Python or NumPy real number, a
    0-d array, or a tensor of one element (what ``float()`` takes; NumPy 2.5 refuses arrays of
    shape (1,)).  Booleans (``True``, ``np.bool_``) and complex numbers
    raise TypeError; NaN, infinities and magnitudes past float32's range ValueError, saying
    ``what`` the argument must be."""
    kind = getattr(value, "dtype", None)
    if (isinstance(value, (bool, np.bool_, complex, np.complexfloating))
            or getattr(kind, "kind", "") in ("b", "c")
            or not (isinstance(value, (int, float)) or hasattr(value, "__float__"))):
        raise TypeError(f"{fn}: {arg} must be a float, got {type(value).__name__}"
                        + (f" of dtype {kind}" if kind is not None else ""))
    try:
        number = float(value)
    except OverflowError:
        number = math.inf if value > 0 else -math.inf
    except (TypeError, ValueError):   # a NumPy / torch array of more than one element
        shape = tuple(getattr(value, "shape", ()))
        raise TypeError(f"{fn}: {arg} must be a float, got {type(value).__name__} of shape "
                        f"{shape}") from None
    if not (abs(number) <= _FLOAT32_MAX):      # NaN fails too
        past = " (float32, where the kernels compute, holds at most 3.4e38)" if (
            not math.isnan(number)) else ""
        raise ValueError(f"{fn}: {arg} must be {what}, got {_short(value)}{past}")
    return number


def _short(value):
    text = str(value)
    return text if len(text) <= 40 else f"{text[:12]}... ({len(text)} digits)"


def eps(value, fn):
    what = "a finite number >= 0"
    value = _real(value, fn, "eps", what)
    if value < 0:
        raise ValueError(f"{fn}: eps must be {what}, got {value}")
    return value


def weight_offset(value, has_weight, fn):
    value = _real(value, fn, "weight_offset", "finite")
    if not has_weight and value != 0.0:
        raise ValueError(f"{fn}: weight_offset must be 0.0 when weight is None, got {value}")
    return value


def flag(value, fn, arg):
    """A keyword switch (return_rstd, deterministic): a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{fn}: {arg} must be a bool, got {type(value).__name__}")


def required(value, fn, arg):
    """An array argument that has no default (residual of the fused add)."""
    if value is None:
        raise TypeError(f"{fn}: {arg} must be an array like x, got None")


def reinterpret(dtype, fn):
    if dtype not in (None, _dtypes.BFLOAT16, _dtypes.FLOAT16):
        raise ValueError(f"{fn}: dtype must be None, 'bfloat16' or 'float16', got {dtype!r}")
    return dtype


def reinterpreted(info, reinterpret, fn):
    """``dtype=`` only says how uint16 storage is read: x must be such storage."""
    if reinterpret is not None and info.dtype != reinterpret:
        raise ValueError(f"{fn}: dtype={reinterpret!r} reads uint16 storage, but x has dtype "
                         f"{info.dtype}")


def output(info, like, shape, dtype, fn, arg, writeable=True, split=None):
    """An ``out=`` array: same shape, dtype, device and library as ``like``; rows may be strided.
    ``writeable=False`` checks an input that must match ``like`` (residual) the same way.
    (M, N, row stride), or with a ``split`` (row_split) :func:`head_rows`'s tuple."""
    same_place(info, like, fn, arg)
    if writeable and info.readonly:
        raise ValueError(f"{fn}: {arg} must be writeable, got a read-only array")
    if info.dtype != dtype:
        raise TypeError(f"{fn}: {arg} must have dtype {dtype}, got {info.dtype}")
    if tuple(info.shape) != tuple(shape):
        raise ValueError(f"{fn}: {arg} must have shape {tuple(shape)}, got {tuple(info.shape)}")
    return rows(info, fn, arg) if split is None else head_rows(info, split, fn, arg)


def no_overlap(out, inputs, fn, arg, allow_same=None,
               note="only out=x (in place) may share memory with an input"):
    """``out`` shares no element with any of ``inputs`` (``allow_same`` may be exactly ``out``).
    Arrays whose byte spans interleave without sharing an element (two column slices of one
    wider matrix, such as y written beside x) are accepted: every kernel writes exactly its
    outputs' elements."""
    for name, info in inputs:
        if info is None:
            continue
        if allow_same is info and info.ptr == out.ptr and info.strides == out.strides:
            continue
        if _share_elements(out, info):
            raise ValueError(f"{fn}: {arg} overlaps {name}; {note}")


def _row_bands(info):
    """(first byte, rows, row stride in bytes, row width in bytes) of an array whose elements
    are rows of unit-stride elements at one row stride (what :func:`rows` accepts, and vectors);
    None for any other layout."""
    shape, strides, size = tuple(info.shape), tuple(info.strides), max(info.itemsize, 1)
    if not shape or strides[-1] != 1:
        return None
    # trailing dims that are contiguous make one wider row (a (T, H, D) view of a QKV buffer:
    # rows of H * D elements)
    while len(shape) > 1 and (shape[-2] == 1 or strides[-2] == shape[-1]):
        shape, strides = shape[:-2] + (shape[-2] * shape[-1],), strides[:-2] + (1,)
    m = math.prod(shape[:-1])
    stride = strides[-2] if len(shape) > 1 else 0
    for d in range(len(shape) - 2):   # leading dims must flatten to the one row stride
        if shape[d] > 1 and strides[d] != strides[d + 1] * shape[d + 1]:
            return None
    if m > 1 and not isinstance(stride, int):
        return None
    return info.ptr, m, stride * size, shape[-1] * size


def _share_elements(a, b):
    """Whether arrays a and b have a byte in common, decided on the bytes they address: rows of
    unit-stride elements at their row strides (exactly, whatever the two strides); by byte spans
    only for other layouts, where it may say True for arrays that share nothing."""
    a_end, b_end = a.ptr + a.extent_bytes(), b.ptr + b.extent_bytes()
    if a_end == a.ptr or b_end == b.ptr or not (b.ptr < a_end and a.ptr < b_end):
        return False
    bands = _row_bands(a), _row_bands(b)
    if None in bands:
        return True
    (pa, ma, sa, wa), (pb, mb, sb, wb) = bands
    if ma > 1 and mb > 1 and sa == sb and wa <= sa and wb <= sb:
        offset = (pb - pa) % sa           # b's rows start this far into a's row period
        return not (wa <= offset and offset + wb <= sa)
    if ma == 1 and mb == 1:
        return True                       # two runs of bytes whose spans meet
    if ma < mb:                           # b: the one with fewer rows, walked row by row
        (pa, ma, sa, wa), (pb, mb, sb, wb) = (pb, mb, sb, wb), (pa, ma, sa, wa)
    # row j of b, [r, r + wb), meets row i of a, [pa + i sa, + wa), for lo <= i <= hi
    r = np.int64(pb) + np.int64(sb) * np.arange(mb, dtype=np.int64)
    lo = -((pa + wa - 1 - r) // sa)       # ceil((r - pa - wa + 1) / sa)
    hi = (r + wb - 1 - pa) // sa
    return bool(np.any(np.maximum(lo, 0) <= np.minimum(hi, ma - 1)))


def quant_dtype(value, fn):
    """The name of a quantised output format: "int8" / "float8_e4m3fn", also given as a NumPy,
    ml_dtypes or torch dtype of that name, or an MX format "mxfp8_e4m3" / "mxfp4_e2m1"."""
    if isinstance(value, str):
        name = value
    elif type(value).__module__.split(".")[0] == "torch":
        name = str(value).replace("torch.", "")
    else:
        try:
            name = np.dtype(value).name if value is not None else None
        except TypeError:
            name = None
    if name not in _dtypes.QUANT_DTYPES + _dtypes.MX_DTYPES:
        raise ValueError(f"{fn}: quant_dtype must be 'int8', 'float8_e4m3fn', 'mxfp8_e4m3' or "
                         f"'mxfp4_e2m1', got {value!r}")
    return name


def integer(value):
    """``value`` as an int when it is an integer of any integer type (a bool is not), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None
