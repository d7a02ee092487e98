"""What every GPU backend (cuda, hip, sim) shares: choosing the kernel variant for a call and packing
its launch.  Subclasses provide ``compile(pyfunc, argtypes, name)``, ``launch(kernel, grid, block,
args, like)``, ``arg(info, dtype)`` and ``cache_key``."""
from .. import _cache, _dtypes
from ..kernels import _config, rmsnorm_fwd

_ALIGN = _config.CHUNK_BYTES


def aligned(info, row_stride, itemsize):
    return info.ptr % _ALIGN == 0 and (row_stride * itemsize) % _ALIGN == 0


class GpuBackend:
    name = "gpu"
    arch = "?"
    device_index = 0

    def __init__(self, intrinsics):
        self.intrinsics = intrinsics
        self._plans = {}

    @property
    def cache_key(self):
        return (self.name, self.arch, self.device_index)

    def kernel(self, builder, spec, argtypes):
        """The compiled kernel of ``builder(intrinsics, spec)``, cached by (backend, spec)."""
        key = self.cache_key + (builder.__name__, spec)
        return _cache.get(key, lambda: self.compile(builder(self.intrinsics, spec), argtypes,
                                                    builder.__name__))

    # ---- forward -------------------------------------------------------------------------
    def _fwd_plan(self, key):
        spec = _config.fwd_spec(*key)
        kernel = self.kernel(rmsnorm_fwd.make_rmsnorm_fwd, spec, rmsnorm_fwd.argtypes(spec))
        plan = (kernel, spec.rows, (spec.layout.threads, spec.rows, 1))
        self._plans[("fwd",) + key] = plan
        return plan

    def rms_norm_fwd(self, x, weight, y, rstd, m, n, x_stride, y_stride, eps, weight_offset):
        itemsize = _dtypes.ITEMSIZE[x.dtype]
        vector = (n * itemsize % _ALIGN == 0 and aligned(x, x_stride, itemsize)
                  and aligned(y, y_stride, itemsize) and (weight is None or weight.ptr % _ALIGN == 0))
        key = (n, x.dtype, weight.dtype if weight is not None else "", vector, rstd is not None)
        kernel, rows, block = self._plans.get(("fwd",) + key) or self._fwd_plan(key)
        grid = ((m + rows - 1) // rows, 1, 1)
        args = (self.arg(x, x.dtype), self.arg(weight, _dtypes.FLOAT32), self.arg(y, y.dtype),
                self.arg(rstd, _dtypes.FLOAT32), m, x_stride, y_stride, eps, weight_offset)
        self.launch(kernel, grid, block, args, x)
