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


def rows_view(info, m, n, row_stride):
    """(m, n) view of host memory with the given row stride (elements)."""
    host = info.host
    return np.lib.stride_tricks.as_strided(host, shape=(m, n),
                                           strides=(row_stride * host.itemsize, host.itemsize))


def heads_view(info, t, h, n, stride, head_stride):
    """(t, h, n) view of host memory: rows at two strides (elements)."""
    host = info.host
    size = host.itemsize
    return np.lib.stride_tricks.as_strided(host, shape=(t, h, n),
                                           strides=(stride * size, head_stride * size, size))


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


def _dummy(dtype, ndim=1):
    return np.zeros((1,) * ndim, _dtypes.STORAGE[dtype])


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
        dispatcher._cache = NumbaDiskCache(key)
        return dispatcher

    def rms_norm_fwd(self, x, weight, y, rstd, m, n, x_stride, y_stride, eps, weight_offset,
                     heads=None):
        """``heads``: (H, x's head stride, y's head stride) for rows at two strides (the row
        strides are then per H rows): run as H calls over the rows of one head each."""
        wdtype = weight.dtype if weight is not None else ""
        fwd = self._kernel(cpu_rmsnorm.make_cpu_rmsnorm_fwd, x.dtype, wdtype)
        w = weight.host if weight is not None else _dummy(_dtypes.FLOAT32)
        r = rstd.host if rstd is not None else _dummy(_dtypes.FLOAT32)
        if heads is None:
            args = (rows_view(x, m, n, x_stride), w, rows_view(y, m, n, y_stride), r,
                    np.float32(eps), np.float32(weight_offset), rstd is not None)
            self.pool.run(lambda lo, hi: fwd(*args, lo, hi), m, m * n)
            return
        h, x_head_stride, y_head_stride = heads
        t = m // h
        xs = heads_view(x, t, h, n, x_stride, x_head_stride)
        ys = heads_view(y, t, h, n, y_stride, y_head_stride)
        for i in range(h):
            args = (xs[:, i], w, ys[:, i], r[i::h] if rstd is not None else r, np.float32(eps),
                    np.float32(weight_offset), rstd is not None)
            self.pool.run(lambda lo, hi: fwd(*args, lo, hi), t, t * n)

    def rms_norm_gated_fwd(self, x, z, weight, y, rstd, m, n, strides, heads, eps,
                           weight_offset, gate):
        """See GpuBackend.rms_norm_gated_fwd (same arguments)."""
        h = heads[0]
        fwd = self._kernel(cpu_rmsnorm.make_cpu_gated_fwd, x.dtype,
                           weight.dtype if weight is not None else "", gate)
        rows = m // h
        xs, zs, ys = (heads_view(info, rows, h, n, stride, head_stride)
                      for info, stride, head_stride in zip((x, z, y), strides, heads[1:]))
        args = (xs, zs, weight.host if weight is not None else _dummy(_dtypes.FLOAT32), ys,
                rstd.host.reshape(-1) if rstd is not None else _dummy(_dtypes.FLOAT32),
                np.float32(eps), np.float32(weight_offset), rstd is not None)
        self.pool.run(lambda lo, hi: fwd(*args, lo, hi), rows, m * n)

    def rms_norm_gated_bwd(self, dy, x, z, weight, rstd, dx, dz, dweight, m, groups, g, strides,
                           eps, weight_offset, gate, workspace):
        """See GpuBackend.rms_norm_gated_bwd (same arguments).  dweight: partial rows of
        BWD_GROUPS row groups (a function of M), summed in group order."""
        wdtype = weight.dtype if weight is not None else ""
        bwd = self._kernel(cpu_rmsnorm.make_cpu_gated_bwd, x.dtype, wdtype, rstd is None, gate)
        parts = min(m, cpu_rmsnorm.BWD_GROUPS)
        partial = workspace((parts, groups * g)).host
        views = [heads_view(info, m, groups, g, stride, g)
                 for info, stride in zip((dy, x, z, dx, dz), strides)]
        dyv, xv, zv, dxv, dzv = views
        args = (dyv, xv, zv, weight.host if weight is not None else _dummy(_dtypes.FLOAT32),
                rstd.host.reshape(-1) if rstd is not None else _dummy(_dtypes.FLOAT32), dxv, dzv,
                partial, np.float32(eps), np.float32(weight_offset))
        self.pool.run(lambda p0, p1: bwd(*args, p0, p1), parts, m * groups * g)
        if weight is not None:
            self._kernel(cpu_rmsnorm.make_dweight_sum, wdtype)(partial, dweight.host)

    def rms_norm_fused_fwd(self, x, residual, weight, xscale, y, residual_out, rstd, yscale, m, n,
                           strides, eps, weight_offset, quant=""):
        """See GpuBackend.rms_norm_fused_fwd (same arguments)."""
        x_stride, r_stride, y_stride, ro_stride = strides
        fwd = self._kernel(cpu_rmsnorm.make_cpu_fused_fwd, x.dtype,
                           weight.dtype if weight is not None else "", residual is not None,
                           quant, xscale.dtype if xscale is not None else "")

        def rows(info, stride):
            return rows_view(info, m, n, stride) if info is not None else _dummy(x.dtype, 2)

        def vec(info):
            return info.host if info is not None else _dummy(_dtypes.FLOAT32)

        args = (rows(x, x_stride), rows(residual, r_stride), vec(weight), vec(xscale),
                rows(y, y_stride), rows(residual_out, ro_stride), vec(rstd), vec(yscale),
                np.float32(eps), np.float32(weight_offset), rstd is not None)
        self.pool.run(lambda lo, hi: fwd(*args, lo, hi), m, m * n)

    def rms_norm_quant_fwd(self, x, residual, weight, xscale, q, residual_out, scales, m, n,
                           strides, scale_strides, eps, weight_offset, quant, scaling, group,
                           scale_value=0.0):
        """See GpuBackend.rms_norm_quant_fwd (same arguments)."""
        x_stride, r_stride, q_stride, ro_stride = strides
        fwd = self._kernel(cpu_rmsnorm.make_cpu_quant_fwd, x.dtype,
                           weight.dtype if weight is not None else "", residual is not None,
                           quant, xscale.dtype if xscale is not None else "", scaling, group)
        q_width = n // 2 if quant == _dtypes.MXFP4 else n

        def rows(info, stride, width=n):
            return (rows_view(info, m, width, stride) if info is not None
                    else _dummy(x.dtype, 2))

        def vec(info):
            return info.host if info is not None else _dummy(_dtypes.FLOAT32)

        if scaling == "static":
            table = (np.full((1, 1), scale_value, np.float32) if scales is None
                     else scales.host.reshape(1, 1))
        else:
            host = scales.host
            table = np.lib.stride_tricks.as_strided(
                host, shape=(m, n // group),
                strides=tuple(s * host.itemsize for s in scale_strides))
        args = (rows(x, x_stride), rows(residual, r_stride), vec(weight), vec(xscale),
                rows(q, q_stride, q_width), rows(residual_out, ro_stride), table,
                np.float32(eps), np.float32(weight_offset))
        self.pool.run(lambda lo, hi: fwd(*args, lo, hi), m, m * n)

    def qk_norm(self, q, k, q_weight, k_weight, q_out, k_out, positions, cache, geo, eps,
                weight_offset):
        """See GpuBackend.qk_norm (same arguments)."""
        style, cache_dtype, _, cache_stride, max_position, rot = geo.rope or ("", "", "", 0, 0, 0)
        run = self._kernel(cpu_rmsnorm.make_cpu_qk_norm, q.dtype, q_weight.dtype, style,
                           cache_dtype)

        def heads(info, count, strides):
            host = info.host
            return np.lib.stride_tricks.as_strided(
                host, shape=(geo.tokens, count, geo.d),
                strides=(strides[0] * host.itemsize, strides[1] * host.itemsize, host.itemsize))

        if geo.rope:
            table = cache.host
            table = np.lib.stride_tricks.as_strided(
                table, shape=(max_position, rot),
                strides=(cache_stride * table.itemsize, table.itemsize))
            pos = positions.host.reshape(-1)
        else:
            table, pos = _dummy(_dtypes.FLOAT32, 2), np.zeros(1, np.int64)
        args = (heads(q, geo.hq, geo.q), heads(k, geo.hk, geo.k), q_weight.host, k_weight.host,
                heads(q_out, geo.hq, geo.q_out), heads(k_out, geo.hk, geo.k_out), pos, table,
                rot, np.float32(eps), np.float32(weight_offset))
        self.pool.run(lambda lo, hi: run(*args, lo, hi), geo.tokens,
                      geo.tokens * (geo.hq + geo.hk) * geo.d)

    def rms_norm_bwd(self, dy, x, weight, rstd, dres, dx, dweight, m, n, strides, eps,
                     weight_offset, workspace, deterministic=True, zero_fill=None, heads=None):
        """strides: (dy, x, dresidual, dx) row strides; workspace(shape) -> float32 ArrayInfo.
        dweight: partial rows of BWD_GROUPS row groups (a function of M), summed in group order:
        the same bits whatever the threads.  ``heads``: (H, head strides of dy, x, dresidual,
        dx) for rows at two strides (the row strides are then per H rows)."""
        h, *head_strides = heads or (1, n, n, n, n)

        def rows_view(info, stride, head_stride):     # (T, H, N): row i at [i // H, i % H]
            return heads_view(info, m // h, h, n, stride, head_stride)

        dy_stride, x_stride, dres_stride, dx_stride = strides
        dy_hs, x_hs, dres_hs, dx_hs = head_strides
        wdtype = weight.dtype if weight is not None else ""
        bwd = self._kernel(cpu_rmsnorm.make_cpu_rmsnorm_bwd, x.dtype, wdtype, rstd is None,
                           dres is not None)
        groups = min(m, cpu_rmsnorm.BWD_GROUPS)
        partial = workspace((groups, n)).host
        args = (rows_view(dy, dy_stride, dy_hs), rows_view(x, x_stride, x_hs),
                weight.host if weight is not None else _dummy(_dtypes.FLOAT32),
                rstd.host if rstd is not None else _dummy(_dtypes.FLOAT32),
                rows_view(dres, dres_stride, dres_hs) if dres is not None
                else rows_view(x, x_stride, x_hs),
                rows_view(dx, dx_stride, dx_hs), partial, np.float32(eps),
                np.float32(weight_offset))
        # the pool splits groups, not rows: a group's partial row is one thread's
        self.pool.run(lambda g0, g1: bwd(*args, g0, g1), groups, m * n)
        if weight is not None:
            self._kernel(cpu_rmsnorm.make_dweight_sum, wdtype)(partial, dweight.host)
