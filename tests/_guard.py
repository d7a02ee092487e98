"""Poisoned, guarded allocations: every array the library allocates (outputs and workspaces) sits
in a bigger buffer filled with a poison byte, with guard bands on both sides.

Inside :func:`guarded_outputs`, ``rmsnorm_hip._arrays.empty`` (which every output and workspace
goes through, on every backend) hands out such views.  After the call, :meth:`Guards.check`
asserts that the guard bands still hold the poison (nothing was written outside an output) and,
unless told otherwise, that no element of an output still holds it (every element was written).
The poison is 0xFF bytes (a NaN for float32 / float16 / bfloat16 / float8 e4m3fn, never produced
from finite inputs) and 0x80 for int8 (-128, outside the quantiser's +-127).  NumPy, torch (CPU
or CUDA) and CuPy buffers; anything else is allocated as usual and not checked.  No side effects
on import: the device tests and benchmarks/sanitize_h200.sh import this too.
"""
import contextlib
import math
import sys
from dataclasses import dataclass

import numpy as np

from rmsnorm_hip import _arrays, _dtypes, functional, gated, qk

GUARD_BYTES = 256


def poison_byte(dtype):
    return 0x80 if dtype == _dtypes.INT8 else 0xFF


def byte_view(buf):
    """A uint8 view of a 1-D contiguous NumPy / torch / CuPy buffer."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buf, torch.Tensor):
        return buf.view(torch.uint8)
    return buf.view(np.uint8)       # NumPy and CuPy


def host_bytes(buf):
    b = byte_view(buf)
    if hasattr(b, "get"):                        # CuPy
        return b.get()
    if hasattr(b, "cpu"):                        # torch
        return b.cpu().numpy()
    return np.array(b)


@dataclass
class Allocation:
    buffer: object          # the whole poisoned buffer (1-D)
    dtype: str              # library dtype name of the elements
    shape: tuple
    guard: int              # guard elements before and after the array

    def check(self, written=True):
        """Guards untouched; with ``written``, no element of the array kept the poison."""
        b = host_bytes(self.buffer)
        item = _dtypes.ITEMSIZE[self.dtype]
        p = poison_byte(self.dtype)
        lo, hi = self.guard * item, len(b) - self.guard * item
        before, after = np.flatnonzero(b[:lo] != p), np.flatnonzero(b[hi:] != p)
        assert before.size == 0 and after.size == 0, (
            f"{self.dtype}{self.shape}: written outside the array: {before.size} byte(s) of the "
            f"guard before it (nearest {lo - before.max() if before.size else '-'} bytes before "
            f"the start), {after.size} after it (farthest {after.max() + 1 if after.size else '-'}"
            f" bytes past the end)")
        if written and hi > lo:
            left = np.all(b[lo:hi].reshape(-1, item) == p, axis=1)
            assert not left.any(), (
                f"{self.dtype}{self.shape}: {int(left.sum())} of {left.size} element(s) never "
                f"written (still poison), first at flat index {int(np.argmax(left))}")


class Guards(list):
    """The allocations made inside one :func:`guarded_outputs` block."""

    def check(self, written=True):
        for allocation in self:
            allocation.check(written)


class _NoRunners(dict):
    """The repeat-call runners (functional's, qk's, gated's) allocate outside ``_arrays.empty``:
    none are used or kept while allocations are guarded."""

    def get(self, key, default=None):
        return default

    def __setitem__(self, key, value):
        pass


@contextlib.contextmanager
def guarded_outputs(guard_bytes=GUARD_BYTES):
    """Yields a :class:`Guards` list that collects every allocation made in the block."""
    guards = Guards()
    empty = _arrays.empty
    runners = (functional._fwd_runners, functional._bwd_runners, functional._fused_runners,
               qk._qk_runners, gated._gated_runners)

    def guarded_empty(like, shape, dtype):
        if like.lib not in ("numpy", "torch", "cupy"):
            return empty(like, shape, dtype)
        item = _dtypes.ITEMSIZE[dtype]
        guard = -(-guard_bytes // item)
        size = math.prod(shape)
        buf, _ = empty(like, (size + 2 * guard,), dtype)
        view_bytes = byte_view(buf)
        if hasattr(view_bytes, "fill_"):
            view_bytes.fill_(poison_byte(dtype))
        else:
            view_bytes.fill(poison_byte(dtype))
        out = buf[guard:guard + size].reshape(shape)
        info = _arrays.describe(out, "out", dtype)   # storage read as dtype (uint8: float8)
        guards.append(Allocation(buf, dtype, tuple(shape), guard))
        return out, info

    _arrays.empty = guarded_empty
    functional._fwd_runners = functional._bwd_runners = functional._fused_runners = _NoRunners()
    qk._qk_runners = gated._gated_runners = _NoRunners()
    try:
        yield guards
    finally:
        _arrays.empty = empty
        (functional._fwd_runners, functional._bwd_runners, functional._fused_runners,
         qk._qk_runners, gated._gated_runners) = runners
