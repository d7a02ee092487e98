"""A kernel with a quantising op's access pattern and no row work: what no kernel of that op is
expected to beat at a shape under the benchmark's method (targets such as "95% of a kernel that
moves the same bytes and computes nothing" are measured against it).

Each thread reads one 16-byte chunk of x (eight 16-bit elements), folds its words together so
the load cannot be dropped, and stores what the op stores for those eight elements: 8 bytes of
fp8 / int8 levels or 4 bytes of e2m1 pairs, plus a scale where a chunk starts one (an E8M0 byte
per 32 elements, a float32 per 128, a float32 per row).  With a residual (the ops' NAME_res
forms) a thread also reads the residual's chunk and stores it as residual_out.  A flat grid
(one thread a chunk) and a persistent grid-stride one (16 blocks of 256 threads an SM) are both
built; the faster is the ceiling.  Written in CUDA C and compiled by CuPy (NVRTC): it shares
nothing with the library.

    from no_work import no_work_kernel
    call = no_work_kernel("mxfp4", x, "flat")   # x: a contiguous 16-bit CUDA tensor (M, N)
    call = no_work_kernel("mxfp4_res", x, "stride", residual)
"""

# (level bytes per 8 elements, elements per scale or "row", scale bytes); the ops of
# rmsnorm_hip._bench.ops with 8-bit or 4-bit outputs
PATTERNS = {
    "quant": (8, "row", 4),
    "quant_fp8": (8, "row", 4),
    "quant_group": (8, 128, 4),
    "quant_group_ue8m0": (8, 128, 4),
    "quant_group_int8": (8, 128, 4),
    "quant_static": (8, 0, 0),
    "mxfp8": (8, 32, 1),
    "mxfp4": (4, 32, 1),
}

_SOURCE = r"""
extern "C" __global__ void no_work(const uint4* __restrict__ x, const uint4* __restrict__ r,
                                   uint4* __restrict__ r_out, unsigned char* __restrict__ q,
                                   unsigned char* __restrict__ s, long long chunks, int level_bytes,
                                   long long chunks_per_scale, int scale_bytes, int residual) {
    long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < chunks; i += step) {
        uint4 v = x[i];
        if (residual) {
            uint4 w = r[i];
            r_out[i] = w;
            v.x ^= w.x; v.y ^= w.y; v.z ^= w.z; v.w ^= w.w;
        }
        unsigned a = v.x ^ v.y, b = v.z ^ v.w;
        if (level_bytes == 8) {
            reinterpret_cast<uint2*>(q)[i] = make_uint2(a, b);
        } else {
            reinterpret_cast<unsigned*>(q)[i] = a ^ b;
        }
        if (chunks_per_scale > 0 && i % chunks_per_scale == 0) {
            long long k = i / chunks_per_scale;
            if (scale_bytes == 4) {
                reinterpret_cast<unsigned*>(s)[k] = a;
            } else {
                s[k] = (unsigned char)b;
            }
        }
    }
}
"""
_kernel = None


def no_work_kernel(op, x, grid="flat", residual=None):
    """A callable launching the no-work kernel of ``op`` (a PATTERNS name, or one with _res and
    ``residual`` given) over x's bytes on ``grid`` ("flat": a thread a chunk; "stride": 16
    blocks an SM walking the chunks); its outputs are allocated once.  Callers time both grids
    and keep the faster."""
    import cupy
    import torch

    global _kernel
    if _kernel is None:
        _kernel = cupy.RawKernel(_SOURCE, "no_work")
    base = op[:-len("_res")] if op.endswith("_res") else op
    if (base != op) != (residual is not None):
        raise ValueError(f"no_work_kernel: {op!r} takes a residual exactly when it ends in _res")
    level_bytes, per_scale, scale_bytes = PATTERNS[base]
    m, n = x.shape
    if x.element_size() != 2 or not x.is_contiguous() or n % 8:
        raise ValueError(f"no_work_kernel: x must be a contiguous 16-bit (M, N) tensor with N a "
                         f"multiple of 8, got {x.dtype} {tuple(x.shape)}")
    chunks = m * n // 8
    per_scale = n if per_scale == "row" else per_scale
    chunks_per_scale = per_scale // 8 if per_scale else 0
    scales = chunks // chunks_per_scale if chunks_per_scale else 1
    q = torch.empty(chunks * level_bytes, dtype=torch.uint8, device=x.device)
    s = torch.empty(scales * max(scale_bytes, 1), dtype=torch.uint8, device=x.device)
    as_bytes = lambda t: cupy.from_dlpack(t.view(torch.uint8).reshape(-1))  # noqa: E731
    r = residual if residual is not None else x
    r_out = torch.empty_like(r)
    args = (as_bytes(x), as_bytes(r), as_bytes(r_out), cupy.from_dlpack(q), cupy.from_dlpack(s),
            cupy.int64(chunks), cupy.int32(level_bytes), cupy.int64(chunks_per_scale),
            cupy.int32(scale_bytes), cupy.int32(residual is not None))
    threads = 256
    blocks = (chunks + threads - 1) // threads
    if grid == "stride":
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        blocks = min(16 * sms, blocks)
    elif grid != "flat":
        raise ValueError(f"no_work_kernel: grid must be 'flat' or 'stride', got {grid!r}")

    def call(*_):
        _kernel((blocks,), (threads,), args)
    return call
