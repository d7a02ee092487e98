"""CPU backend: NumPy (host) arrays through numba's CPU JIT.  Compiled machine code is kept on
disk (``_diskcache``) under the kernel's explicit key: numba's own cache cannot tell apart
closures built from one source with different constants.

Large calls spread their rows over a pool of Python threads, each running a serial kernel on its
share with the GIL released.  Not numba's ``parallel=True``: its OpenMP layer spins waiting for
work (with the cores busy elsewhere, 1024x1024 went from 0.72 to 8 ms), oversubscribes when
called from several threads, and leaves a forked child unable to run a parallel region.  The pool
sleeps when idle, takes at most the cores this process may use, and a forked child starts its
own.  The rows a thread takes never change a row's result (batch invariance).
"""
import itertools
import os
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba.core.caching import NullCache
from numba.core.runtime import rtsys

from .. import _cache, _diskcache, _dtypes, intrinsics
from ..kernels import cpu_rmsnorm
from ..kernels._sharing import share_helpers

# below ~1M elements one thread beats handing rows out (2-core CI VM: 64x4096 bf16 serial
# 0.2-0.3 ms)
PARALLEL_MIN_ELEMENTS = 1 << 20


def _distinct_function_names():
    """numba names a compiled function by its qualified name and a per-process counter, and the
    JIT links a call by name to the first definition it holds.  A kernel loaded from disk brings
    the names its compiling process gave (its helpers, closures built from one source with other
    constants, included), which could be a name this process already gave another closure: the
    loaded kernel would then call that one.  This process's counter starts at a random 62-bit
    offset, so names from different processes do not meet."""
    from numba.core import bytecode
    start = (1 << 62) + random.SystemRandom().getrandbits(62)
    bytecode.FunctionIdentity._unique_ids = itertools.count(start)


_distinct_function_names()


def _cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:          # macOS, Windows
        return os.cpu_count() or 1


class RowPool:
    """Runs ``work(lo, hi)`` over row ranges on up to ``threads`` threads (the caller's one of
    them), for calls of at least PARALLEL_MIN_ELEMENTS; one range on the caller's thread
    otherwise."""

    def __init__(self, threads=None):
        self.threads = max(1, threads or _cores())
        self._pool = None
        self._lock = threading.Lock()
        if hasattr(os, "register_at_fork"):
            # a child has none of the parent's threads: it makes its own pool when it needs one
            os.register_at_fork(after_in_child=self._forget)

    def _forget(self):
        self._pool = None
        self._lock = threading.Lock()

    def _executor(self):
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.threads - 1,
                                                    thread_name_prefix="rmsnorm_hip")
        return self._pool

    def ranges(self, m, elements):
        """The row ranges a call of ``m`` rows and ``elements`` elements is split into."""
        parts = min(self.threads, m) if elements >= PARALLEL_MIN_ELEMENTS else 1
        bounds = [k * m // parts for k in range(parts + 1)]
        return list(zip(bounds[:-1], bounds[1:]))

    def run(self, work, m, elements):
        ranges = self.ranges(m, elements)
        if len(ranges) == 1:
            work(*ranges[0])
            return
        futures = [self._executor().submit(work, lo, hi) for lo, hi in ranges[1:]]
        work(*ranges[0])
        for future in futures:
            future.result()


def vector(info, *dims):
    """The storage elements of ``info`` from its first element to the last one the (count,
    stride) pairs ``dims`` reach, as one contiguous vector: how every array reaches a CPU kernel
    (kernels/cpu_rmsnorm.py), so that a kernel compiles once whatever the callers' strides."""
    host = info.host
    span = 0 if any(count <= 0 for count, _ in dims) else (
        1 + sum((count - 1) * stride for count, stride in dims))
    return np.lib.stride_tricks.as_strided(host, shape=(span,), strides=(host.itemsize,))


def _packed(info):
    """A 1-D input (rstd) as a contiguous vector: a copy only where the caller's is strided; a
    dummy where there is none."""
    if info is None:
        return _dummy(_dtypes.FLOAT32)
    return np.ascontiguousarray(info.host.reshape(-1))


def _written(info):
    """A float32 output the kernel fills as a vector (rstd, yscale: the library allocates them
    contiguous, so this is a view); a dummy where there is none."""
    return _dummy(_dtypes.FLOAT32) if info is None else info.host.reshape(-1)


def _gains(info):
    """A weight or xscale as a contiguous float32 vector (16-bit values convert exactly, and the
    kernels compute in float32), so that a kernel serves every gain dtype; a dummy where there is
    none.  Returns (its dtype name in kernel keys: "" or "float32", the vector)."""
    if info is None:
        return "", _dummy(_dtypes.FLOAT32)
    host = info.host.reshape(-1)
    if info.dtype == _dtypes.BFLOAT16:
        return _dtypes.FLOAT32, (host.astype(np.uint32) << 16).view(np.float32)
    if info.dtype == _dtypes.FLOAT16:
        return _dtypes.FLOAT32, host.view(np.float16).astype(np.float32)
    return _dtypes.FLOAT32, np.ascontiguousarray(host)


class NumbaDiskCache(NullCache):
    """A numba dispatcher's disk cache (``dispatcher._cache``) keyed by ``key``, the kernel's
    builder and spec, plus the signature and the host CPU numba compiles for."""

    def __init__(self, key):
        self._key = key
        self._lock = None

    def _entry(self, sig, target_context):
        return (self._key, str(sig), target_context.codegen().magic_tuple())

    def _load(self, entry, target_context):
        from numba.core import compiler, serialize
        payload = _diskcache.load("cpu", entry)
        if payload is None:
            return None
        try:
            return compiler.CompileResult._rebuild(target_context, *serialize.pickle.loads(payload))
        except Exception:
            _diskcache.discard("cpu", entry)
            return None

    def load_overload(self, sig, target_context):
        # numba's runtime (NRT), which compiled code calls into; numba's own disk cache runs the
        # whole target refresh here, which also loads every typing registry (~0.2 s) that a
        # kernel loaded, not compiled, never needs
        rtsys.initialize(target_context)
        entry = self._entry(sig, target_context)
        cres = self._load(entry, target_context)
        if cres is None:
            # on a miss, build under the entry's lock (released by save_overload, or by the
            # next load if the compile raised): a process that waited loads the entry instead
            self._release()
            self._lock = _diskcache.BuildLock("cpu", entry).acquire()
            cres = self._load(entry, target_context)
            if cres is not None:
                self._release()
        return cres

    def save_overload(self, sig, cres):
        from numba.core import serialize
        try:
            if not (cres.lifted or cres.library.has_dynamic_globals):
                _diskcache.store("cpu", self._entry(sig, cres.target_context),
                                 serialize.dumps(cres._reduce()))
        finally:
            self._release()

    def _release(self):
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def _dummy(dtype):
    """The vector passed for an array a call does not have (never read or written)."""
    return np.zeros(1, _dtypes.STORAGE[dtype])


class CpuBackend:
    name = "cpu"
    arch = "host"
    device_index = -1
    cache_key = ("cpu", "host", -1)

    def __init__(self):
        self.intrinsics = intrinsics.load("cpu")
        self.pool = RowPool()

    def _kernel(self, builder, *spec):
        key = self.cache_key + (builder.__name__,) + spec
        return _cache.get(key, lambda: self._build(key, builder, spec))

    def _build(self, key, builder, spec):
        dispatcher = builder(self.intrinsics, *spec)
        share_helpers(dispatcher.py_func)
        dispatcher._cache = NumbaDiskCache(key)
        return dispatcher

    def rms_norm_fwd(self, x, weight, y, rstd, m, n, x_stride, y_stride, eps, weight_offset,
                     heads=None):
        """``heads``: (H, x's head stride, y's head stride) for rows at two strides (the row
        strides are then per H rows)."""
        wdtype, w = _gains(weight)
        fwd = self._kernel(cpu_rmsnorm.make_cpu_rmsnorm_fwd, x.dtype, wdtype)
        h, x_head_stride, y_head_stride = heads or (1, n, n)
        t = m // h
        rows = (n, h, x_stride, x_head_stride, y_stride, y_head_stride)
        args = (vector(x, (t, x_stride), (h, x_head_stride), (n, 1)), w,
                vector(y, (t, y_stride), (h, y_head_stride), (n, 1)),
                _written(rstd), rows, np.float32(eps), np.float32(weight_offset),
                rstd is not None)
        self.pool.run(lambda lo, hi: fwd(*args, lo, hi), m, m * n)

    def rms_norm_gated_fwd(self, x, z, weight, y, rstd, m, n, strides, heads, eps,
                           weight_offset, gate):
        """See GpuBackend.rms_norm_gated_fwd (same arguments)."""
        h = heads[0]
        wdtype, w = _gains(weight)
        fwd = self._kernel(cpu_rmsnorm.make_cpu_gated_fwd, x.dtype, wdtype, gate)
        count = m // h
        arrays = [vector(info, (count, stride), (h, head_stride), (n, 1))
                  for info, stride, head_stride in zip((x, z, y), strides, heads[1:])]
        rows = (h, n) + tuple(v for pair in zip(strides, heads[1:]) for v in pair)
        args = (*arrays[:2], w, arrays[2], _written(rstd), rows, np.float32(eps),
                np.float32(weight_offset), rstd is not None)
        self.pool.run(lambda lo, hi: fwd(*args, lo, hi), count, m * n)

    def rms_norm_gated_bwd(self, dy, x, z, weight, rstd, dx, dz, dweight, m, groups, g, strides,
                           eps, weight_offset, gate, workspace):
        """See GpuBackend.rms_norm_gated_bwd (same arguments).  dweight: partial rows of
        BWD_GROUPS row groups (a function of M), summed in group order."""
        gain_dtype, w = _gains(weight)
        bwd = self._kernel(cpu_rmsnorm.make_cpu_gated_bwd, x.dtype, gain_dtype, rstd is None,
                           gate)
        parts = min(m, cpu_rmsnorm.BWD_GROUPS)
        partial = workspace((parts, groups * g)).host
        dyv, xv, zv, dxv, dzv = (vector(info, (m, stride), (groups * g, 1))
                                 for info, stride in zip((dy, x, z, dx, dz), strides))
        args = (dyv, xv, zv, w, _packed(rstd), dxv, dzv, partial, (m, groups, g, *strides),
                np.float32(eps), np.float32(weight_offset))
        self.pool.run(lambda p0, p1: bwd(*args, p0, p1), parts, m * groups * g)
        if weight is not None:
            self._kernel(cpu_rmsnorm.make_dweight_sum, weight.dtype)(partial, dweight.host)

    def rms_norm_fused_fwd(self, x, residual, weight, xscale, y, residual_out, rstd, yscale, m, n,
                           strides, eps, weight_offset, quant=""):
        """See GpuBackend.rms_norm_fused_fwd (same arguments)."""
        (wdtype, w), (sdtype, xs) = _gains(weight), _gains(xscale)
        fwd = self._kernel(cpu_rmsnorm.make_cpu_fused_fwd, x.dtype, wdtype, residual is not None,
                           quant, sdtype)
        x_v, residual_v, y_v, residual_out_v = (
            vector(info, (m, stride), (n, 1)) if info is not None else _dummy(x.dtype)
            for info, stride in zip((x, residual, y, residual_out), strides))
        rows = (n, *(stride if info is not None else 0
                     for info, stride in zip((x, residual, y, residual_out), strides)))
        args = (x_v, residual_v, w, xs, y_v, residual_out_v,
                _written(rstd), _written(yscale), rows,
                np.float32(eps), np.float32(weight_offset), rstd is not None)
        self.pool.run(lambda lo, hi: fwd(*args, lo, hi), m, m * n)

    def rms_norm_quant_fwd(self, x, residual, weight, xscale, q, residual_out, scales, m, n,
                           strides, scale_strides, eps, weight_offset, quant, scaling, group,
                           scale_value=0.0):
        """See GpuBackend.rms_norm_quant_fwd (same arguments)."""
        (wdtype, w), (sdtype, xs) = _gains(weight), _gains(xscale)
        fwd = self._kernel(cpu_rmsnorm.make_cpu_quant_fwd, x.dtype, wdtype, residual is not None,
                           quant, sdtype, scaling, group)
        widths = (n, n, n // 2 if quant == _dtypes.MXFP4 else n, n)
        x_v, residual_v, q_v, residual_out_v = (
            vector(info, (m, stride), (width, 1)) if info is not None else _dummy(x.dtype)
            for info, stride, width in zip((x, residual, q, residual_out), strides, widths))
        if scaling == "static":
            table = (np.full(1, scale_value, np.float32) if scales is None
                     else scales.host.reshape(-1)[:1])
            scale_strides = (0, 0)
        else:
            table = vector(scales, *zip((m, n // group), scale_strides))
        rows = (n, *(stride if info is not None else 0
                     for info, stride in zip((x, residual, q, residual_out), strides)),
                *scale_strides)
        args = (x_v, residual_v, w, xs, q_v, residual_out_v, table,
                rows, np.float32(eps), np.float32(weight_offset))
        self.pool.run(lambda lo, hi: fwd(*args, lo, hi), m, m * n)

    def qk_norm(self, q, k, q_weight, k_weight, q_out, k_out, positions, cache, geo, eps,
                weight_offset):
        """See GpuBackend.qk_norm (same arguments)."""
        style, cache_dtype, _, cache_stride, max_position, rot = geo.rope or ("", "", "", 0, 0, 0)
        (wdtype, qw), (_, kw) = _gains(q_weight), _gains(k_weight)
        run = self._kernel(cpu_rmsnorm.make_cpu_qk_norm, q.dtype, wdtype, style, cache_dtype)
        tokens, d = geo.tokens, geo.d
        views = [vector(info, (tokens, strides[0]), (count, strides[1]), (d, 1))
                 for info, count, strides in ((q, geo.hq, geo.q), (k, geo.hk, geo.k),
                                              (q_out, geo.hq, geo.q_out),
                                              (k_out, geo.hk, geo.k_out))]
        if geo.rope:
            table = vector(cache, (max_position, cache_stride), (rot, 1))
            pos = positions.host.reshape(-1)
        else:
            table, pos = _dummy(_dtypes.FLOAT32), np.zeros(1, np.int64)
        heads = (d, geo.hq, geo.hk, *geo.q, *geo.k, *geo.q_out, *geo.k_out, cache_stride, rot)
        args = (views[0], views[1], qw, kw, views[2], views[3], pos,
                table, heads, np.float32(eps), np.float32(weight_offset))
        self.pool.run(lambda lo, hi: run(*args, lo, hi), tokens, tokens * (geo.hq + geo.hk) * d)

    def rms_norm_bwd(self, dy, x, weight, rstd, dres, dx, dweight, m, n, strides, eps,
                     weight_offset, workspace, deterministic=True, zero_fill=None, heads=None):
        """strides: (dy, x, dresidual, dx) row strides; workspace(shape) -> float32 ArrayInfo.
        dweight: partial rows of BWD_GROUPS row groups (a function of M), summed in group order:
        the same bits whatever the threads.  ``heads``: (H, head strides of dy, x, dresidual,
        dx) for rows at two strides (the row strides are then per H rows)."""
        h, *head_strides = heads or (1, n, n, n, n)
        gain_dtype, w = _gains(weight)
        bwd = self._kernel(cpu_rmsnorm.make_cpu_rmsnorm_bwd, x.dtype, gain_dtype, rstd is None,
                           dres is not None)
        if dres is None:        # never read: x's rows stand in
            dres, strides, head_strides = (x, (*strides[:2], strides[1], strides[3]),
                                           (*head_strides[:2], head_strides[1], head_strides[3]))
        groups = min(m, cpu_rmsnorm.BWD_GROUPS)
        partial = workspace((groups, n)).host
        dy_v, x_v, dres_v, dx_v = (vector(info, (m // h, stride), (h, head_stride), (n, 1))
                                   for info, stride, head_stride in
                                   zip((dy, x, dres, dx), strides, head_strides))
        rows = (m, n, h, *(v for pair in zip(strides, head_strides) for v in pair))
        args = (dy_v, x_v, w, _packed(rstd), dres_v, dx_v, partial, rows,
                np.float32(eps), np.float32(weight_offset))
        # the pool splits groups, not rows: a group's partial row is one thread's
        self.pool.run(lambda g0, g1: bwd(*args, g0, g1), groups, m * n)
        if weight is not None:
            self._kernel(cpu_rmsnorm.make_dweight_sum, weight.dtype)(partial, dweight.host)
