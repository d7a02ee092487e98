"""What every GPU backend (cuda, hip, sim) shares: choosing the kernel variant for a call and
packing its launch (one argument builder per kernel: fwd_args, fused_args, bwd_args).
Subclasses provide ``compile(builder, spec, argtypes)``, ``launch(kernel, grid, block, args,
stream)``, ``arg(info, dtype)``, ``stream_for(info)`` and ``cache_key``."""
from dataclasses import replace

from .. import _arrays, _cache, _dtypes
from ..kernels import _config, gated_bwd, qk_norm, rmsnorm_bwd, rmsnorm_fwd

_ALIGN = _config.CHUNK_BYTES
_ALIGN_MASK = _ALIGN - 1
_MAX_SM_THREADS = 2048     # resident threads an SM holds at most (NVIDIA's largest SMs)


def fwd_args(x, weight, y, rstd, m, x_stride, y_stride, eps, weight_offset):
    """rms_norm's kernel arguments (kernels/rmsnorm_fwd.argtypes), pointers or 0."""
    return (x, weight, y, rstd, m, x_stride, y_stride, eps, weight_offset)


def fused_args(x, residual, weight, xscale, y, residual_out, rstd, yscale, m, strides, eps,
               weight_offset):
    """The fused forward's kernel arguments; ``strides``: row strides of (x, residual, y,
    residual_out)."""
    return (x, residual, weight, xscale, y, residual_out, rstd, yscale, m, *strides, eps,
            weight_offset)


_ONE_STRIDE = (1, 0, 0, 0, 0)


def bwd_args(dy, x, weight, rstd, dresidual, dx, workspace, m, strides, eps, weight_offset,
             heads=_ONE_STRIDE):
    """The backward's kernel arguments; ``strides``: row strides of (dy, x, dresidual, dx);
    ``heads``: (H, head strides of the four) for head rows (BwdSpec.heads)."""
    return (dy, x, weight, rstd, dresidual, dx, workspace, m, *strides, eps, weight_offset,
            *heads)


class GpuBackend:
    name = "gpu"
    arch = "?"
    device_index = 0

    def __init__(self, intrinsics):
        self.intrinsics = intrinsics
        # whose tuning the launch geometry follows (kernels/_config); the simulator runs CUDA's
        self.vendor = "hip" if intrinsics.name == "hip" else "cuda"
        self._plans = {}
        self._bwd_plans = {}

    def forget_plans(self):
        """Drop the launch plans memoised per call shape (the compiled kernels stay cached):
        the next call re-plans from kernels/_config."""
        self._plans.clear()
        self._bwd_plans.clear()

    @property
    def cache_key(self):
        return (self.name, self.arch, self.device_index)

    def kernel(self, builder, spec, argtypes):
        """The compiled kernel of ``builder(intrinsics, spec)``, cached by (backend, spec) in
        memory (and its binary on disk, by the backend's ``compile``)."""
        key = self.cache_key + (builder.__name__, spec)
        return _cache.get(key, lambda: self.compile(builder, spec, argtypes))

    def stream_for(self, info):
        return _arrays.current_stream(info)

    def resident_per_sm(self, kernel, block_threads):
        """Blocks of ``kernel`` one SM/CU holds at once; backends that can ask the driver do."""
        return max(1, _MAX_SM_THREADS // block_threads)

    # ---- forward -------------------------------------------------------------------------
    @staticmethod
    def _rows_aligned(n, dtype, strides):
        """Whether rows of ``n`` elements at these row strides may take a vector kernel (the
        pointers permitting, which is decided per call)."""
        itemsize = _dtypes.ITEMSIZE[dtype]
        return all((v * itemsize) % _ALIGN == 0 for v in (n,) + tuple(strides))

    def fwd_kernels(self, m, n, dtype, weight_dtype, store_rstd, x_stride, y_stride=None, *,
                    more_strides=(), fused=(False, "", "", True)):
        """(vector key or None, scalar key): the two variants a call of ``m`` rows may take; the
        vector one when the strides allow it, chosen per call when the pointers are 16-byte
        aligned too.  ``fused``: (residual, quant, xscale, weight_offset != 0) of the variant
        (FwdSpec), with the row strides of its other arrays in ``more_strides`` (in x's
        elements).  Keys are fwd_spec's arguments; the vector one says whether to stream."""
        y_stride = n if y_stride is None else y_stride
        strides_ok = GpuBackend._rows_aligned(n, dtype,
                                              (x_stride, y_stride) + tuple(more_strides))
        scalar = (n, dtype, weight_dtype, False, store_rstd) + tuple(fused) + (False,)
        if not strides_ok:
            return None, scalar
        vector = (n, dtype, weight_dtype, True, store_rstd) + tuple(fused)
        return vector + (self._stream(fused[0], fused[1], m, lambda s: vector + (s,)),), scalar

    def _stream(self, residual, quant, m, key_of):
        """Whether ``m`` rows of a vector forward take the streamed grid: up to the kind's
        rows per SM (_config.fwd_stream), and for the kinds of _config.FWD_ONE_SHOT_WAVE not
        where one wave of one-shot blocks holds them (``key_of(stream)``: the plan key)."""
        if not _config.fwd_stream(self.vendor, residual, quant, m, self.sm_count):
            return False
        if _config.fwd_kind(residual, quant) not in _config.FWD_ONE_SHOT_WAVE[self.vendor]:
            return True
        spec, _, block, per_sm = self._fwd_plan(key_of(True))
        threads = block[0] * block[1]
        stream_rows = per_sm * spec.rows * self.sm_count
        # an SM holds at most 2048 threads (NVIDIA's kinds): past that bound no one-shot wave
        # holds the batch, and the one-shot kernel need not be built to say so
        if (not spec.stream or m <= stream_rows
                or m > (_MAX_SM_THREADS // threads) * spec.rows * self.sm_count):
            return True
        one_shot, kernel, block, _ = self._fwd_plan(key_of(False))
        wave_rows = (self.resident_per_sm(kernel, block[0] * block[1]) * one_shot.rows
                     * self.sm_count)
        return not _config.fwd_one_shot_wave(stream_rows, wave_rows, m)

    def _fwd_plan(self, key):
        """(spec, kernel, block, blocks per SM) of a variant key: fwd_spec's first ten
        arguments as fwd_kernels gives them, then a scaled format's (scaling, group)."""
        plan = self._plans.get(key)
        if plan is None:
            spec, kernel, per_sm = self._fwd_kernel(_config.fwd_spec(
                *key[:10], vendor=self.vendor, **dict(zip(("scaling", "group"), key[10:]))))
            plan = self._plans[key] = (spec, kernel, (spec.layout.threads, spec.rows, 1),
                                       per_sm if spec.stream else 0)
        return plan

    def _fwd_kernel(self, spec):
        """(spec, kernel, blocks per SM) of a forward that can launch.  ptxas gives forward
        kernels the registers they ask for: a streamed program of a long row may then need
        more than an SM has for one block (bf16 N = 16384: 704 threads of 102 registers); it
        runs one-shot, the same bits.  A one-shot block that still does not fit is built to
        its launch bounds (FwdSpec.bounded)."""
        kernel = self.kernel(rmsnorm_fwd.make_rmsnorm_fwd, spec, rmsnorm_fwd.argtypes(spec))
        per_sm = self.resident_per_sm(kernel, spec.layout.threads * spec.rows)
        if per_sm == 0 and spec.stream:
            return self._fwd_kernel(replace(spec, stream=False, held_weights=False))
        if per_sm == 0 and not spec.bounded:
            return self._fwd_kernel(replace(spec, bounded=True))
        return spec, kernel, per_sm

    def _fwd_launch_shape(self, key, m):
        """(kernel, grid, block) for m rows."""
        spec, kernel, block, per_sm = self._plans.get(key) or self._fwd_plan(key)
        return kernel, (_config.fwd_programs(spec, m, self.sm_count, per_sm), 1, 1), block

    def fwd_runner(self, io, shape, m, n, x_stride, dtype, weight_dtype, return_rstd):
        """``run(x, weight, eps, weight_offset)`` for repeat calls with this metadata: everything
        but pointers, outputs and the stream is decided here, once."""
        vector_key, scalar_key = self.fwd_kernels(m, n, dtype, weight_dtype, return_rstd,
                                                  x_stride)
        alloc_y = io.like_allocator(shape, dtype, x_stride == n)
        alloc_rstd = io.allocator((m,), _dtypes.FLOAT32)
        ptr, stream, launch = io.ptr, io.stream, self.launch
        mask = 0 if vector_key is None else _ALIGN_MASK
        shapes = {}

        def run(x, weight, eps, weight_offset):
            y = alloc_y(x)
            rstd = alloc_rstd() if return_rstd else None
            if m:
                x_ptr, y_ptr = ptr(x), ptr(y)
                w_ptr = 0 if weight is None else ptr(weight)
                key = vector_key if mask and not (x_ptr | w_ptr | y_ptr) & mask else scalar_key
                shape_ = shapes.get(key) or shapes.setdefault(key, self._fwd_launch_shape(key, m))
                launch(shape_[0], shape_[1], shape_[2],
                       fwd_args(x_ptr, w_ptr, y_ptr, 0 if rstd is None else ptr(rstd), m,
                                x_stride, n, eps, weight_offset), stream())
            return (y, rstd) if return_rstd else y

        return run

    def rms_norm_fwd(self, x, weight, y, rstd, m, n, x_stride, y_stride, eps, weight_offset,
                     heads=None):
        """``heads``: (H, x's head stride, y's head stride) for rows at two strides
        (FwdSpec.heads: the row strides are then per H rows), or None."""
        if heads is not None:
            return self._rms_norm_fwd_heads(x, weight, y, rstd, m, n, x_stride, y_stride, eps,
                                            weight_offset, heads)
        vector_key, scalar_key = self.fwd_kernels(
            m, n, x.dtype, weight.dtype if weight is not None else "", rstd is not None, x_stride,
            y_stride)
        pointers = x.ptr | y.ptr | (weight.ptr if weight is not None else 0)
        key = vector_key if vector_key is not None and not pointers & _ALIGN_MASK else scalar_key
        kernel, grid, block = self._fwd_launch_shape(key, m)
        args = fwd_args(self.arg(x, x.dtype), self.arg(weight, _dtypes.FLOAT32),
                        self.arg(y, y.dtype), self.arg(rstd, _dtypes.FLOAT32), m, x_stride,
                        y_stride, eps, weight_offset)
        self.launch(kernel, grid, block, args, self.stream_for(x))

    def _rms_norm_fwd_heads(self, x, weight, y, rstd, m, n, x_stride, y_stride, eps,
                            weight_offset, heads):
        h, x_head_stride, y_head_stride = heads
        wdtype = weight.dtype if weight is not None else ""
        pointers = x.ptr | y.ptr | (weight.ptr if weight is not None else 0)
        vector = (self._rows_aligned(n, x.dtype, (x_stride, y_stride, x_head_stride,
                                                  y_head_stride))
                  and not pointers & _ALIGN_MASK)
        spec, kernel, _ = self._fwd_kernel(_config.fwd_spec(
            n, x.dtype, wdtype, vector, rstd is not None, vendor=self.vendor, heads=True))
        args = fwd_args(self.arg(x, x.dtype), self.arg(weight, _dtypes.FLOAT32),
                        self.arg(y, y.dtype), self.arg(rstd, _dtypes.FLOAT32), m, x_stride,
                        y_stride, eps, weight_offset) + (h, x_head_stride, y_head_stride)
        self.launch(kernel, (_config.ceil_div(m, spec.rows), 1, 1),
                    (spec.layout.threads, spec.rows, 1), args, self.stream_for(x))

    def rms_norm_gated_fwd(self, x, z, weight, y, rstd, m, n, strides, heads, eps,
                           weight_offset, gate):
        """Gated rows (FwdSpec.gate "input" / "output") of ``n`` elements: a row's groups when
        ``heads`` = (H, head strides of x, z, y) has H > 1 (the row strides are then per H
        rows, and group i takes weight[i * n:]).  ``strides``: row strides of (x, z, y)."""
        plan, mask = self._gated_plans(m, n, x.dtype, weight.dtype if weight is not None else "",
                                       rstd is not None, strides, heads, gate)
        pointers = x.ptr | z.ptr | y.ptr | (weight.ptr if weight is not None else 0)
        kernel, grid, block = plan(bool(mask) and not pointers & mask)
        f32 = _dtypes.FLOAT32
        args = (self.arg(x, x.dtype), self.arg(z, x.dtype), self.arg(weight, f32),
                self.arg(y, y.dtype), self.arg(rstd, f32), m, *strides, eps, weight_offset,
                *heads)
        self.launch(kernel, grid, block, args, self.stream_for(x))

    def _gated_plans(self, m, n, dtype, weight_dtype, store_rstd, strides, heads, gate):
        """(plan(vector) -> (kernel, grid, block), built on first use; the alignment mask,
        0 where the strides allow no vector kernel) of a gated forward's metadata."""
        h = heads[0]
        vector_ok = self._rows_aligned(n, dtype, tuple(strides) + tuple(heads[1:]))
        # whole rows stream where the fused add does (z is a second input like its residual)
        stream = h == 1 and _config.fwd_stream(self.vendor, True, "", m, self.sm_count)

        def build(vector):
            spec, kernel, per_sm = self._fwd_kernel(_config.fwd_spec(
                n, dtype, weight_dtype, vector, store_rstd, stream=stream, vendor=self.vendor,
                heads=h > 1, gate=gate))
            return (kernel, (_config.fwd_programs(spec, m, self.sm_count, per_sm), 1, 1),
                    (spec.layout.threads, spec.rows, 1))
        return _per_form(build), (_ALIGN_MASK if vector_ok else 0)

    def gated_runner(self, io, shape, m, n, strides, heads, dtype, weight_dtype, return_rstd,
                     stat_shape, gate):
        """``run(x, z, weight, eps, weight_offset) -> (y, rstd or None)`` for repeat calls of
        the gated forward (out=None) with this metadata (rms_norm_gated_fwd's arguments)."""
        plan, mask = self._gated_plans(m, n, dtype, weight_dtype, return_rstd, strides, heads,
                                       gate)
        alloc_y = io.like_allocator(shape, dtype, strides[0] == n * heads[0])
        alloc_rstd = io.allocator(stat_shape, _dtypes.FLOAT32) if return_rstd else None
        ptr, stream, launch = io.ptr, io.stream, self.launch
        tail = (m, *strides)

        def run(x, z, weight, eps, weight_offset):
            y = alloc_y(x)
            rstd = alloc_rstd() if alloc_rstd is not None else None
            if m:
                x_ptr, z_ptr, y_ptr = ptr(x), ptr(z), ptr(y)
                w_ptr = 0 if weight is None else ptr(weight)
                kernel, grid, block = plan(bool(mask) and not (x_ptr | z_ptr | y_ptr | w_ptr)
                                           & mask)
                launch(kernel, grid, block,
                       (x_ptr, z_ptr, w_ptr, y_ptr, 0 if rstd is None else ptr(rstd)) + tail
                       + (eps, weight_offset) + heads, stream())
            return y, rstd

        return run

    # ---- fused residual add / quantised forward --------------------------------------------
    def rms_norm_fused_fwd(self, x, residual, weight, xscale, y, residual_out, rstd, yscale, m, n,
                           strides, eps, weight_offset, quant=""):
        """The forward with its fused switches: ``residual`` (with ``residual_out``, which may
        be ``residual`` itself) and/or quantisation (``y`` int8 / float8_e4m3fn, ``yscale``,
        optional ``xscale``; ``quant`` names y's 8-bit format, which CuPy's uint8 bits do not
        carry).  ``strides``: row strides of (x, residual, y, residual_out), in
        elements; a quantised y's is N, so its 8- / 4-byte chunk stores are aligned whenever
        x's 16-byte chunks are."""
        x_stride, r_stride, y_stride, ro_stride = strides
        fused = (residual is not None, quant, xscale.dtype if xscale is not None else "",
                 weight_offset != 0.0)
        vector_key, scalar_key = self.fwd_kernels(
            m, n, x.dtype, weight.dtype if weight is not None else "", rstd is not None, x_stride,
            y_stride, more_strides=(r_stride, ro_stride), fused=fused)
        pointers = 0
        for info in (x, residual, weight, xscale, y, residual_out):
            pointers |= info.ptr if info is not None else 0
        key = vector_key if vector_key is not None and not pointers & _ALIGN_MASK else scalar_key
        kernel, grid, block = self._fwd_launch_shape(key, m)
        f32 = _dtypes.FLOAT32
        args = fused_args(self.arg(x, x.dtype), self.arg(residual, x.dtype),
                          self.arg(weight, f32), self.arg(xscale, f32), self.arg(y, y.dtype),
                          self.arg(residual_out, x.dtype), self.arg(rstd, f32),
                          self.arg(yscale, f32), m, strides, eps, weight_offset)
        self.launch(kernel, grid, block, args, self.stream_for(x))

    def rms_norm_quant_fwd(self, x, residual, weight, xscale, q, residual_out, scales, m, n,
                           strides, scale_strides, eps, weight_offset, quant, scaling, group,
                           scale_value=0.0):
        """The quantised forward with scales per group, E8M0 MX scales or a static scale
        (FwdSpec.scaling): ``scales`` is written ((row, group) element strides
        ``scale_strides``), or read (static: its one float32, unless ``scale_value`` gives the
        scale itself; ``scales`` is then None).  ``strides``: row strides of
        (x, residual, q, residual_out) in their own elements (fp4 q: bytes, N / 2 a row)."""
        x_stride, r_stride, _, ro_stride = strides
        pointers = 0
        for info in (x, residual, weight, xscale, q, residual_out):
            pointers |= info.ptr if info is not None else 0
        vector = (self._rows_aligned(n, x.dtype, (x_stride, r_stride, ro_stride))
                  and not pointers & _ALIGN_MASK)
        key = self._scaled_key(m, n, x.dtype, weight.dtype if weight is not None else "",
                               vector, residual is not None, quant,
                               xscale.dtype if xscale is not None else "", weight_offset != 0.0,
                               scaling, group)
        kernel, grid, block = self._fwd_launch_shape(key, m)
        f32 = _dtypes.FLOAT32
        args = fused_args(self.arg(x, x.dtype), self.arg(residual, x.dtype),
                          self.arg(weight, f32), self.arg(xscale, f32), self.arg(q, q.dtype),
                          self.arg(residual_out, x.dtype), self.arg(None, f32),
                          self.arg(scales, _dtypes.UINT8 if scaling == "mx" else f32), m,
                          strides, eps, weight_offset)
        self.launch(kernel, grid, block, args + _scaled_tail(scaling, scale_strides, scale_value),
                    self.stream_for(x))

    def _scaled_key(self, m, n, dtype, weight_dtype, vector, has_residual, quant, xscale_dtype,
                    offset, scaling, group):
        """The plan key of a scaled quantised forward (see _fwd_plan)."""
        base = (n, dtype, weight_dtype, vector, False, has_residual, quant, xscale_dtype, offset)
        stream = vector and self._stream(has_residual, quant, m,
                                         lambda s: base + (s, scaling, group))
        return base + (stream, scaling, group)

    def quant_scaled_launcher(self, io, m, n, strides, scale_strides, dtype, weight_dtype,
                              xscale_dtype, has_residual, quant, scaling, group):
        """``launch(x, residual, weight, xscale, q, residual_out, scales, eps, weight_offset,
        scale_value)`` (library arrays, absent ones None; outputs allocated by the caller) for
        repeat calls of the scaled quantised forward with this metadata: the kernels, grids
        and argument layout are decided here, once; per call, the pointers' alignment picks
        the vector or the scalar kernel."""
        x_stride, r_stride, _, ro_stride = strides
        strides_ok = self._rows_aligned(n, dtype, (x_stride, r_stride, ro_stride))
        shapes = {}     # kernels chosen and compiled as calls first need them
        mask = _ALIGN_MASK if strides_ok else 0
        ptr, stream, launch = io.ptr, io.stream, self.launch

        def run(x, residual, weight, xscale, q, residual_out, scales, eps, weight_offset,
                scale_value):
            pointers = tuple(0 if a is None else ptr(a)
                             for a in (x, residual, weight, xscale, q, residual_out))
            aligned = False
            if mask:
                bits = 0
                for pointer in pointers:
                    bits |= pointer
                aligned = not bits & mask
            which = (aligned, weight_offset != 0.0)
            kernel, grid, block = shapes.get(which) or shapes.setdefault(
                which, self._fwd_launch_shape(self._scaled_key(
                    m, n, dtype, weight_dtype, aligned, has_residual, quant, xscale_dtype,
                    which[1], scaling, group), m))
            args = fused_args(*pointers, 0, 0 if scales is None else ptr(scales), m, strides,
                              eps, weight_offset)
            launch(kernel, grid, block, args + _scaled_tail(scaling, scale_strides, scale_value),
                   stream())

        return run

    def fused_runner(self, io, shape, m, n, strides, dtype, weight_dtype, xscale_dtype,
                     has_residual, quant, return_rstd, in_place):
        """``run(x, residual, weight, xscale, eps, weight_offset) -> (y or q, residual_out, rstd,
        yscale)`` (absent ones None) for repeat calls of the fused forward with this metadata:
        the kernel keys, output shapes and strides are decided here, once.  In place, y and
        residual_out are x and residual; there ``run`` returns None, without launching, when the
        arrays' byte spans meet (full validation then decides whether they truly overlap)."""
        x_stride, r_stride, y_stride, ro_stride = strides
        keys = {}       # (vector key, scalar key) by weight_offset != 0, as calls first need them

        def keys_for(offset):
            return self.fwd_kernels(m, n, dtype, weight_dtype, return_rstd, x_stride, y_stride,
                                    more_strides=(r_stride, ro_stride),
                                    fused=(has_residual, quant, xscale_dtype, offset))
        strides_ok = self._rows_aligned(n, dtype, (x_stride, y_stride, r_stride, ro_stride))
        mask = _ALIGN_MASK if strides_ok else 0
        f32 = _dtypes.FLOAT32
        like_x = x_stride == n
        alloc_y = None if in_place else io.like_allocator(shape, quant or dtype,
                                                          like_x and not quant)
        alloc_ro = (io.like_allocator(shape, dtype, like_x) if has_residual and not in_place
                    else None)
        alloc_rstd = io.allocator((m,), f32) if return_rstd else None
        alloc_yscale = io.allocator((m,), f32) if quant else None
        item = _dtypes.ITEMSIZE[dtype]
        x_span = ((m - 1) * x_stride + n) * item if m else 0
        r_span = ((m - 1) * r_stride + n) * item if m else 0
        w_span = n * _dtypes.ITEMSIZE[weight_dtype] if weight_dtype else 0
        ptr, stream, launch = io.ptr, io.stream, self.launch
        shapes = {}

        def run(x, residual, weight, xscale, eps, weight_offset):
            x_ptr = ptr(x)
            r_ptr = 0 if residual is None else ptr(residual)
            w_ptr = 0 if weight is None else ptr(weight)
            if in_place and (_meet(r_ptr, r_span, x_ptr, x_span)
                             or _meet(r_ptr, r_span, w_ptr, w_span)
                             or _meet(x_ptr, x_span, w_ptr, w_span)):
                return None
            y = x if in_place else alloc_y(x)
            ro = residual if in_place else (alloc_ro(x) if alloc_ro is not None else None)
            rstd = alloc_rstd() if alloc_rstd is not None else None
            yscale = alloc_yscale() if alloc_yscale is not None else None
            if m:
                s_ptr = 0 if xscale is None else ptr(xscale)
                y_ptr = x_ptr if in_place else ptr(y)
                ro_ptr = 0 if ro is None else (r_ptr if in_place else ptr(ro))
                offset = weight_offset != 0.0
                vector_key, scalar_key = keys.get(offset) or keys.setdefault(offset,
                                                                             keys_for(offset))
                key = (vector_key if mask and not (x_ptr | r_ptr | w_ptr | s_ptr | y_ptr | ro_ptr)
                       & mask else scalar_key)
                shape_ = shapes.get(key) or shapes.setdefault(key, self._fwd_launch_shape(key, m))
                launch(shape_[0], shape_[1], shape_[2],
                       fused_args(x_ptr, r_ptr, w_ptr, s_ptr, y_ptr, ro_ptr,
                                  0 if rstd is None else ptr(rstd),
                                  0 if yscale is None else ptr(yscale), m, strides, eps,
                                  weight_offset), stream())
            return y, ro, rstd, yscale

        return run

    # ---- gated backward ------------------------------------------------------------------------
    def rms_norm_gated_bwd(self, dy, x, z, weight, rstd, dx, dz, dweight, m, groups, g, strides,
                           eps, weight_offset, gate, workspace):
        """dx, dz and dweight of ``m`` rows of ``groups`` gated group rows of ``g`` elements;
        ``strides``: row strides of (dy, x, z, dx, dz); workspace(shape) -> float32 ArrayInfo."""
        pointers = 0
        for info in (dy, x, z, dx, dz, weight):
            pointers |= info.ptr if info is not None else 0
        vector = self._rows_aligned(g, x.dtype, strides) and not pointers & _ALIGN_MASK
        wdtype = weight.dtype if weight is not None else ""
        spec = _config.gated_bwd_spec(g, x.dtype, wdtype, vector, rstd is None, gate,
                                      self.vendor)
        kernel = self.kernel(gated_bwd.make_gated_bwd, spec, gated_bwd.argtypes(spec))
        slots = _config.gated_bwd_slots(spec, m, groups, self.sm_count)
        ws_rows = slots // groups
        ws = workspace((ws_rows, groups * g))
        f32 = _dtypes.FLOAT32
        stream = self.stream_for(x)
        self.launch(kernel, (slots // spec.rows, 1, 1), (spec.layout.threads, spec.rows, 1),
                    (self.arg(dy, x.dtype), self.arg(x, x.dtype), self.arg(z, x.dtype),
                     self.arg(weight, f32), self.arg(rstd, f32), self.arg(dx, x.dtype),
                     self.arg(dz, x.dtype), self.arg(ws, f32), m, groups, slots, *strides, eps,
                     weight_offset), stream)
        if weight is not None:
            reduce_spec = _config.reduce_spec(wdtype)
            reduce = self.kernel(rmsnorm_bwd.make_dweight_reduce, reduce_spec,
                                 rmsnorm_bwd.reduce_argtypes(reduce_spec))
            n = groups * g
            columns = reduce_spec.columns
            self.launch(reduce, ((n + columns - 1) // columns, 1, 1),
                        (columns, reduce_spec.groups, 1),
                        (self.arg(ws, f32), self.arg(dweight, wdtype), ws_rows, n), stream)

    # ---- QK-norm -----------------------------------------------------------------------------
    def qk_norm(self, q, k, q_weight, k_weight, q_out, k_out, positions, cache, geo, eps,
                weight_offset):
        """q's and k's head rows normalised (and rotated where ``geo.rope``) in one launch;
        ``geo``: kernels/qk_norm.Geometry.  q_out / k_out may be q / k."""
        plan, mask = self._qk_plans(geo, q.dtype, q_weight.dtype)
        pointers = 0
        for info in (q, k, q_weight, k_weight, q_out, k_out):
            pointers |= info.ptr
        if geo.rope and geo.rope[0] == "neox":
            pointers |= cache.ptr
        kernel, grid, block, tail = plan(bool(mask) and not pointers & mask)
        dtype, f32 = q.dtype, _dtypes.FLOAT32
        args = (self.arg(q, dtype), self.arg(k, dtype), self.arg(q_weight, f32),
                self.arg(k_weight, f32), self.arg(q_out, dtype), self.arg(k_out, dtype),
                self.arg(positions, f32), self.arg(cache, f32))
        self.launch(kernel, grid, block, args + tail + (eps, weight_offset), self.stream_for(q))

    def _qk_plans(self, geo, dtype, weight_dtype):
        """(plan(vector), alignment mask: 0 where the strides allow no vector form) of a QK
        call's geometry; a plan, built on first use, is (kernel, grid, block, the arguments
        after the pointers but eps and weight_offset).  The vector form also needs every pointer
        16-byte aligned (the cos / sin cache's too for neox)."""
        strides = geo.q + geo.k + geo.q_out + geo.k_out
        style, cache_dtype, pos_dtype, cache_stride, max_position, rot = geo.rope or (
            "", "", "", 0, 0, 0)
        vector = self._rows_aligned(geo.d, dtype, strides)
        halves = _config.qk_halves(geo.d, dtype, style, rot)
        if vector and style == "neox":     # the partner a power-of-two chunks away (qk_norm)
            chunk = _ALIGN // _dtypes.ITEMSIZE[dtype]
            lanes = rot // (2 * chunk)
            vector = (rot % (2 * chunk) == 0 and lanes & (lanes - 1) == 0
                      and (cache_stride * _dtypes.ITEMSIZE[cache_dtype]) % _ALIGN == 0)
        tail = (geo.tokens, geo.hq, geo.hk, *strides, cache_stride, max_position, rot)

        def build(vector):
            spec = _config.qk_spec(geo.d, dtype, weight_dtype, vector, style, cache_dtype,
                                   pos_dtype, halves)
            kernel = self.kernel(qk_norm.make_qk_norm, spec, qk_norm.argtypes(spec))
            grid = (geo.tokens, _config.ceil_div(geo.hq + geo.hk, spec.rows), 1)
            return kernel, grid, (spec.layout.threads, spec.rows, 1), tail
        return _per_form(build), (_ALIGN_MASK if vector else 0)

    def qk_runner(self, io, geo, dtype, weight_dtype, shapes, in_place, k_offset, spans):
        """``run(q, k, q_weight, k_weight, positions, cache, eps, weight_offset) -> (q_out,
        k_out)`` for repeat QK calls with this metadata (``shapes``: q's and k's); in place,
        (q, k), or None without launching when k no longer starts ``k_offset`` bytes after q or
        another argument's byte span meets q's or k's (full validation then decides).
        ``spans``: the byte spans of (q, k, q_weight, k_weight, positions, cache)."""
        plan, mask = self._qk_plans(geo, dtype, weight_dtype)
        neox = bool(geo.rope) and geo.rope[0] == "neox"
        q_span, k_span, qw_span, kw_span, p_span, c_span = spans
        alloc_q = None if in_place else io.allocator(shapes[0], dtype)
        alloc_k = None if in_place else io.allocator(shapes[1], dtype)
        ptr, stream, launch = io.ptr, io.stream, self.launch
        rows = geo.tokens * (geo.hq + geo.hk)

        def run(q, k, q_weight, k_weight, positions, cache, eps, weight_offset):
            q_ptr, k_ptr, qw_ptr, kw_ptr = ptr(q), ptr(k), ptr(q_weight), ptr(k_weight)
            p_ptr = 0 if positions is None else ptr(positions)
            c_ptr = 0 if cache is None else ptr(cache)
            if in_place:
                if k_ptr - q_ptr != k_offset:
                    return None
                for other, span in ((qw_ptr, qw_span), (kw_ptr, kw_span), (p_ptr, p_span),
                                    (c_ptr, c_span)):
                    if _meet(other, span, q_ptr, q_span) or _meet(other, span, k_ptr, k_span):
                        return None
                q_out, k_out, qo_ptr, ko_ptr = q, k, q_ptr, k_ptr
            else:
                q_out, k_out = alloc_q(), alloc_k()
                qo_ptr, ko_ptr = ptr(q_out), ptr(k_out)
            if rows:
                pointers = q_ptr | k_ptr | qw_ptr | kw_ptr | qo_ptr | ko_ptr | (
                    c_ptr if neox else 0)
                kernel, grid, block, tail = plan(bool(mask) and not pointers & mask)
                launch(kernel, grid, block, (q_ptr, k_ptr, qw_ptr, kw_ptr, qo_ptr, ko_ptr, p_ptr,
                                             c_ptr) + tail + (eps, weight_offset), stream())
            return q_out, k_out

        return run

    # ---- backward ------------------------------------------------------------------------
    def _bwd_plan(self, key):
        """(spec, kernel, dweight reduction kernel or None, its spec) of a backward call shape
        (_bwd_key), built once: a repeat call only looks it up."""
        pair, stream, sink, heads = key[-4:]
        spec = _config.bwd_spec(*key[:-4], vendor=self.vendor, pair=pair, stream=stream,
                                atomic=sink == "atomic", direct=sink == "direct", heads=heads,
                                columns=sink == "columns")
        kernel_spec = _config.bwd_kernel_spec(spec)
        kernel = self.kernel(rmsnorm_bwd.make_rmsnorm_bwd, kernel_spec,
                             rmsnorm_bwd.argtypes(kernel_spec))
        reduce = None
        reduce_spec = _config.reduce_spec(spec.weight, spec.pair_twin)
        if spec.weight and sink == "workspace":     # atomics and direct need no second kernel
            reduce = self.kernel(rmsnorm_bwd.make_dweight_reduce, reduce_spec,
                                 rmsnorm_bwd.reduce_argtypes(reduce_spec))
        plan = self._bwd_plans[key] = (spec, kernel, reduce, reduce_spec)
        return plan

    def _bwd_key(self, key, m, deterministic=True, heads=False):
        """The plan key of a backward call of ``m`` rows: ``key`` (n, dtype, weight dtype,
        vector, recompute rstd, dresidual), whether its rows pair (_config.bwd_pair_rows),
        whether it asks for evict-first row loads (_config.bwd_stream_rows), and where its
        dweight goes: "workspace" (partial rows and the reduction kernel), "direct" (the kernel
        writes it: _config.bwd_direct_dweight), "columns" (column programs of the kernel sum
        it: _config.bwd_column_dweight, ``deterministic`` calls) or "atomic" (summed by atomics,
        not ``deterministic``, where _config.bwd_atomic_dweight says), and whether its rows are
        at two strides (``heads``: the workspace or the columns, as the one-stride call)."""
        columns = deterministic and _config.bwd_column_dweight(key[0], key[1], key[2], key[4],
                                                                m, self.vendor)
        pair = not columns and _config.bwd_pair_rows(m, self.sm_count, self.vendor)
        stream = _config.bwd_stream_rows(m, key[0], key[1], self.vendor)
        sink = "columns" if columns else "workspace"
        if heads:
            return key + (pair, False, sink, True)
        if not columns and (m == 1 or not deterministic):
            spec = _config.bwd_spec(*key, vendor=self.vendor, pair=pair, stream=stream)
            if _config.bwd_direct_dweight(spec, m):
                sink = "direct"
            elif not deterministic and _config.bwd_atomic_dweight(
                    spec, m, _config.bwd_programs(spec, m, self.sm_count, self.vendor),
                    self.vendor):
                sink = "atomic"
        return key + (pair, stream, sink, False)

    def _bwd_launch_shape(self, key, m, deterministic=True, heads=False):
        """(kernel, grid, block, dweight reduction kernel or None, its grid, its block,
        workspace rows, where dweight goes (_bwd_key: "atomic" sums into dweight itself,
        zeroed; "atomic" and "direct" take dweight for the workspace and run no reduction)) of
        a backward call of ``m`` rows."""
        key = self._bwd_key(key, m, deterministic, heads)
        spec, kernel, reduce, reduce_spec = self._bwd_plans.get(key) or self._bwd_plan(key)
        programs = (_config.bwd_programs(spec, m, self.sm_count, self.vendor)
                    + _config.bwd_column_programs(spec))
        columns, groups = reduce_spec.columns, reduce_spec.groups
        return (kernel, (programs, 1, 1), (spec.layout.threads, spec.rows, 1), reduce,
                ((spec.layout.n + columns - 1) // columns, 1, 1), (columns, groups, 1),
                _config.bwd_ws_rows(spec, programs), key[-2])

    def bwd_runner(self, io, shape, m, n, strides, dtype, weight_dtype, has_rstd, has_dres,
                   deterministic=True):
        """``run(dy, x, weight, rstd, dresidual, eps, weight_offset) -> (dx, dweight)`` for
        repeat calls with this metadata (m > 0): the plans, the grid and the workspace shape are
        decided here, once; a call reads pointers, allocates its outputs and launches."""
        mask = _ALIGN_MASK if self._rows_aligned(n, dtype, strides) else 0
        launches = {}
        alloc_dx = io.like_allocator(shape, dtype, strides[1] == n)

        def launch_plan(vector):
            shape_ = self._bwd_launch_shape(
                (n, dtype, weight_dtype, vector, not has_rstd, has_dres), m, deterministic)
            sink = shape_[-1]
            # atomics add into a zeroed dweight; they, a direct and a column-summed dweight
            # need no workspace
            alloc_dw = ((io.zeros_allocator if sink == "atomic" else io.allocator)(
                (n,), weight_dtype) if weight_dtype else None)
            alloc_ws = (None if sink != "workspace"
                        else io.allocator((shape_[-2], n), _dtypes.FLOAT32))
            return launches.setdefault(vector, shape_[:-1] + (alloc_dw, alloc_ws))

        ptr, stream, launch = io.ptr, io.stream, self.launch

        def run(dy, x, weight, rstd, dres, eps, weight_offset):
            dx = alloc_dx(x)
            dy_ptr, x_ptr, dx_ptr = ptr(dy), ptr(x), ptr(dx)
            w_ptr = 0 if weight is None else ptr(weight)
            dres_ptr = 0 if dres is None else ptr(dres)
            vector = bool(mask) and not (dy_ptr | x_ptr | dx_ptr | w_ptr | dres_ptr) & mask
            (kernel, grid, block, reduce, reduce_grid, reduce_block, ws_rows,
             alloc_dw, alloc_ws) = launches.get(vector) or launch_plan(vector)
            dw = alloc_dw() if alloc_dw is not None else None
            ws_ptr = 0 if dw is None else ptr(alloc_ws() if alloc_ws is not None else dw)
            s = stream()
            launch(kernel, grid, block,
                   bwd_args(dy_ptr, x_ptr, w_ptr, 0 if rstd is None else ptr(rstd), dres_ptr,
                            dx_ptr, ws_ptr, m, strides, eps, weight_offset), s)
            if reduce is not None and dw is not None:
                launch(reduce, reduce_grid, reduce_block, (ws_ptr, ptr(dw), ws_rows, n), s)
            return dx, dw

        return run

    def rms_norm_bwd(self, dy, x, weight, rstd, dres, dx, dweight, m, n, strides, eps,
                     weight_offset, workspace, deterministic=True, zero_fill=None, heads=None):
        """strides: (dy, x, dresidual, dx) row strides; workspace(shape) -> float32 ArrayInfo,
        allocated per call on the caller's device (and stream, through its library);
        ``zero_fill(info)`` zeroes one in place (an atomic dweight accumulator: where not
        ``deterministic``, _config.bwd_atomic_dweight); ``heads``: (H, head strides of dy, x,
        dresidual, dx) for rows at two strides (the row strides are then per H rows)."""
        pointers = 0
        for info in (dy, x, dres, dx, weight):
            pointers |= info.ptr if info is not None else 0
        vector = (self._rows_aligned(n, x.dtype, tuple(strides) + tuple((heads or ())[1:]))
                  and not pointers & _ALIGN_MASK)
        wdtype = weight.dtype if weight is not None else ""
        (kernel, grid, block, reduce, reduce_grid, reduce_block,
         ws_rows, sink) = self._bwd_launch_shape(
            (n, x.dtype, wdtype, vector, rstd is None, dres is not None), m, deterministic,
            heads is not None)
        ws = None
        if weight is not None:
            ws = workspace((ws_rows, n)) if sink == "workspace" else dweight
            if sink == "atomic":
                zero_fill(dweight)
        stream = self.stream_for(x)
        f32 = _dtypes.FLOAT32
        self.launch(kernel, grid, block,
                    bwd_args(self.arg(dy, x.dtype), self.arg(x, x.dtype), self.arg(weight, f32),
                             self.arg(rstd, f32), self.arg(dres, x.dtype), self.arg(dx, x.dtype),
                             self.arg(ws, f32), m, strides, eps, weight_offset,
                             heads or _ONE_STRIDE), stream)
        if weight is not None and reduce is not None:
            self.launch(reduce, reduce_grid, reduce_block,
                        (self.arg(ws, f32), self.arg(dweight, wdtype), ws_rows, n), stream)


def _per_form(build):
    """``plan(vector)``: ``build(vector)``, built on a form's first use and kept (a call takes
    the scalar form only when its pointers are not 16-byte aligned)."""
    plans = {}

    def plan(vector):
        found = plans.get(vector)
        if found is None:
            found = plans[vector] = build(vector)
        return found
    return plan


def _scaled_tail(scaling, scale_strides, scale_value):
    """The scaled quantised forward's arguments after fused_args': the scales' (row, group)
    strides, or the static scale's value."""
    if scaling in _config.GROUP_SCALINGS:
        return tuple(scale_strides)
    return (scale_value,) if scaling == "static" else ()


def _meet(a, a_len, b, b_len):
    """Whether the byte spans [a, a + a_len) and [b, b + b_len) share a byte (empty spans and
    absent arrays, pointer 0, never do)."""
    return bool(a and b and a_len and b_len and a < b + b_len and b < a + a_len)
