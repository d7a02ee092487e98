"""CPU backend: NumPy (host) arrays through numba's CPU JIT, rows in parallel."""
import numpy as np

from .. import _cache, _dtypes, intrinsics
from ..kernels import cpu_rmsnorm


# below ~1M elements a serial pass beats waking the thread pool (2-core CI VM: 64x4096 bf16
# serial 0.2-0.3 ms, parallel 0.4 ms with workqueue and 7.7 ms with an oversubscribed OpenMP)
PARALLEL_MIN_ELEMENTS = 1 << 20


def rows_view(info, m, n, row_stride):
    """(m, n) view of host memory with the given row stride (elements)."""
    host = info.host
    return np.lib.stride_tricks.as_strided(host, shape=(m, n),
                                           strides=(row_stride * host.itemsize, host.itemsize))


def _dummy(dtype, ndim=1):
    return np.zeros((1,) * ndim, _dtypes.STORAGE[dtype])


class CpuBackend:
    name = "cpu"
    arch = "host"
    device_index = -1
    cache_key = ("cpu", "host", -1)

    def __init__(self):
        self.intrinsics = intrinsics.load("cpu")

    def _kernel(self, builder, *spec):
        return _cache.get(self.cache_key + (builder.__name__,) + spec,
                          lambda: builder(self.intrinsics, *spec))

    def rms_norm_fwd(self, x, weight, y, rstd, m, n, x_stride, y_stride, eps, weight_offset):
        wdtype = weight.dtype if weight is not None else ""
        fwd = self._kernel(cpu_rmsnorm.make_cpu_rmsnorm_fwd, x.dtype, wdtype,
                           m > 1 and m * n >= PARALLEL_MIN_ELEMENTS)
        fwd(rows_view(x, m, n, x_stride),
            weight.host if weight is not None else _dummy(_dtypes.FLOAT32),
            rows_view(y, m, n, y_stride),
            rstd.host if rstd is not None else _dummy(_dtypes.FLOAT32),
            np.float32(eps), np.float32(weight_offset), rstd is not None)

    def rms_norm_fused_fwd(self, x, residual, weight, xscale, y, residual_out, rstd, yscale, m, n,
                           strides, eps, weight_offset, quant=""):
        """See GpuBackend.rms_norm_fused_fwd (same arguments)."""
        x_stride, r_stride, y_stride, ro_stride = strides
        fwd = self._kernel(cpu_rmsnorm.make_cpu_fused_fwd, x.dtype,
                           weight.dtype if weight is not None else "",
                           m > 1 and m * n >= PARALLEL_MIN_ELEMENTS, residual is not None, quant,
                           xscale.dtype if xscale is not None else "")

        def rows(info, stride):
            return rows_view(info, m, n, stride) if info is not None else _dummy(x.dtype, 2)

        def vec(info):
            return info.host if info is not None else _dummy(_dtypes.FLOAT32)

        fwd(rows(x, x_stride), rows(residual, r_stride), vec(weight), vec(xscale),
            rows(y, y_stride), rows(residual_out, ro_stride), vec(rstd), vec(yscale),
            np.float32(eps), np.float32(weight_offset), rstd is not None)

    def rms_norm_bwd(self, dy, x, weight, rstd, dres, dx, dweight, m, n, strides, eps,
                     weight_offset, workspace, deterministic=True, zero_fill=None):
        """strides: (dy, x, dresidual, dx) row strides; workspace(shape) -> float32 ArrayInfo."""
        dy_stride, x_stride, dres_stride, dx_stride = strides
        wdtype = weight.dtype if weight is not None else ""
        bwd = self._kernel(cpu_rmsnorm.make_cpu_rmsnorm_bwd, x.dtype, wdtype, rstd is None,
                           dres is not None, m > 1 and m * n >= PARALLEL_MIN_ELEMENTS)
        partial = workspace((min(m, cpu_rmsnorm.BWD_GROUPS), n)).host
        bwd(rows_view(dy, m, n, dy_stride), rows_view(x, m, n, x_stride),
            weight.host if weight is not None else _dummy(_dtypes.FLOAT32),
            rstd.host if rstd is not None else _dummy(_dtypes.FLOAT32),
            rows_view(dres, m, n, dres_stride) if dres is not None else rows_view(x, m, n, x_stride),
            rows_view(dx, m, n, dx_stride), partial,
            dweight.host if dweight is not None else _dummy(_dtypes.FLOAT32),
            np.float32(eps), np.float32(weight_offset))
