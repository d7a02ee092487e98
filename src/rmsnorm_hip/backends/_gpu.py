"""What every GPU backend (cuda, hip, sim) shares: choosing the kernel variant for a call and packing
its launch.  Subclasses provide ``compile(pyfunc, argtypes, name)``, ``launch(kernel, grid, block,
args, stream)``, ``arg(info, dtype)``, ``stream_for(info)`` and ``cache_key``."""
from .. import _arrays, _cache, _dtypes
from ..kernels import _config, rmsnorm_fwd

_ALIGN = _config.CHUNK_BYTES
_ALIGN_MASK = _ALIGN - 1


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

    def stream_for(self, info):
        return _arrays.current_stream(info)

    # ---- forward -------------------------------------------------------------------------
    @staticmethod
    def fwd_kernels(n, dtype, weight_dtype, store_rstd, x_stride, y_stride=None):
        """(vector key or None, scalar key): the two variants a call may take; the vector one
        when the strides allow it, chosen per call when the pointers are 16-byte aligned too."""
        itemsize = _dtypes.ITEMSIZE[dtype]
        y_stride = n if y_stride is None else y_stride
        strides_ok = all((v * itemsize) % _ALIGN == 0 for v in (n, x_stride, y_stride))
        scalar = (n, dtype, weight_dtype, False, store_rstd)
        return ((n, dtype, weight_dtype, True, store_rstd) if strides_ok else None), scalar

    def _fwd_plan(self, key):
        plan = self._plans.get(key)
        if plan is None:
            spec = _config.fwd_spec(*key)
            kernel = self.kernel(rmsnorm_fwd.make_rmsnorm_fwd, spec, rmsnorm_fwd.argtypes(spec))
            plan = self._plans[key] = (kernel, spec.rows, (spec.layout.threads, spec.rows, 1))
        return plan

    def launch_fwd(self, kernels, x_ptr, w_ptr, y_ptr, rstd_ptr, m, x_stride, eps, weight_offset,
                   stream):
        """The repeat-call path: pointers in, launch out (y contiguous)."""
        vector_key, scalar_key = kernels
        key = (vector_key if vector_key is not None and not (x_ptr | w_ptr | y_ptr) & _ALIGN_MASK
               else scalar_key)
        kernel, rows, block = self._plans.get(key) or self._fwd_plan(key)
        self.launch(kernel, ((m + rows - 1) // rows, 1, 1), block,
                    (x_ptr, w_ptr, y_ptr, rstd_ptr, m, x_stride, key[0], eps, weight_offset), stream)

    def rms_norm_fwd(self, x, weight, y, rstd, m, n, x_stride, y_stride, eps, weight_offset):
        vector_key, scalar_key = self.fwd_kernels(
            n, x.dtype, weight.dtype if weight is not None else "", rstd is not None, x_stride,
            y_stride)
        pointers = x.ptr | y.ptr | (weight.ptr if weight is not None else 0)
        key = vector_key if vector_key is not None and not pointers & _ALIGN_MASK else scalar_key
        kernel, rows, block = self._plans.get(key) or self._fwd_plan(key)
        args = (self.arg(x, x.dtype), self.arg(weight, _dtypes.FLOAT32), self.arg(y, y.dtype),
                self.arg(rstd, _dtypes.FLOAT32), m, x_stride, y_stride, eps, weight_offset)
        self.launch(kernel, ((m + rows - 1) // rows, 1, 1), block, args, self.stream_for(x))
