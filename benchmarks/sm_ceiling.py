"""What an SM kernel with no row work reaches on the quantised op's access pattern: read bf16 x
(16 B a thread), write one byte an element (8 B a thread), as a CUDA C kernel (cupy RawKernel)
with nothing between the load and the store but a few integer operations.  Beside it, in the
same rounds: ours (the benchmark's SmoothQuant int8 call) and a torch device-to-device copy of
the same bytes (the copy engine).  Each timed as the benchmark times (CUPTI device time, median
of 20 calls, 256 MB write flush before each call; and the read flush, clean lines).  Forms of
the SM kernel: one 16-byte chunk a thread over a grid of all chunks (``flat``, as torch's
elementwise kernels), and grid-stride programs with U chunks' loads issued before their stores
(``strideU``, 132 x B blocks of 256 threads).  Also the fused add's pattern (two reads, two
writes a chunk) when --case fused.  DIR/sm_ceiling{tag}.json.

    PYTHONPATH=src python3 benchmarks/sm_ceiling.py [--case quant:4096x4096] [--rounds 3]
"""
import json
import statistics

import _probe

SOURCE = r"""
extern "C" __global__ void quant_flat(const uint4* __restrict__ x, uint2* __restrict__ q,
                                      long long chunks) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < chunks) {
        uint4 v = x[i];
        q[i] = make_uint2(__byte_perm(v.x, v.y, 0x7531), __byte_perm(v.z, v.w, 0x7531));
    }
}

template <int U>
__device__ void quant_stride_body(const uint4* __restrict__ x, uint2* __restrict__ q,
                                  long long chunks) {
    long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < chunks;
         i += U * step) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (i + u * step < chunks) v[u] = x[i + u * step];
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (i + u * step < chunks)
                q[i + u * step] = make_uint2(__byte_perm(v[u].x, v[u].y, 0x7531),
                                             __byte_perm(v[u].z, v[u].w, 0x7531));
    }
}
extern "C" __global__ void quant_stride1(const uint4* x, uint2* q, long long c) {
    quant_stride_body<1>(x, q, c); }
extern "C" __global__ void quant_stride4(const uint4* x, uint2* q, long long c) {
    quant_stride_body<4>(x, q, c); }

extern "C" __global__ void fused_flat(const uint4* __restrict__ x, const uint4* __restrict__ r,
                                      uint4* __restrict__ y, uint4* __restrict__ ro,
                                      long long chunks) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < chunks) {
        uint4 a = x[i], b = r[i];
        uint4 s = make_uint4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
        ro[i] = s;
        y[i] = make_uint4(s.x ^ a.x, s.y ^ a.y, s.z ^ a.z, s.w ^ a.w);
    }
}
"""


def main():
    ap = _probe.parser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import cupy
    import torch

    from rmsnorm_hip._bench import targets, timing

    target = targets.make_target("cuda")
    case = _probe.load_case(target, args.case)
    m, n = case.m, case.n
    module = cupy.RawModule(code=SOURCE, options=("-std=c++17",))
    chunks = m * n // 8
    threads = 256
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    impls = {"ours": case.run}

    def bf16_words():
        return cupy.asarray(torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
                            .view(torch.int32))

    if case.op == "quant":
        x = bf16_words()
        q = cupy.empty(m * n // 4, dtype=cupy.int32)
        flat = module.get_function("quant_flat")
        impls["sm_flat"] = lambda: flat(((chunks + threads - 1) // threads,), (threads,),
                                        (x, q, cupy.int64(chunks)))
        for unroll in (1, 4):
            kernel = module.get_function(f"quant_stride{unroll}")
            for per_sm in (8, 16):
                impls[f"sm_stride{unroll}_b{per_sm}"] = (
                    lambda kernel=kernel, per_sm=per_sm: kernel(
                        (sms * per_sm,), (threads,), (x, q, cupy.int64(chunks))))
    else:
        x, r, y, ro = bf16_words(), bf16_words(), bf16_words(), bf16_words()
        flat = module.get_function("fused_flat")
        impls["sm_flat"] = lambda: flat(((chunks + threads - 1) // threads,), (threads,),
                                        (x, r, y, ro, cupy.int64(chunks)))
    impls["copy_same_bytes"] = _probe.same_bytes_copy(case.nbytes)
    copy_gbps = target.copy_bandwidth()["gbps"]
    flushes = {"write": timing.L2Flush("write"), "read": timing.L2Flush("read")}
    rows = []
    for rnd in range(args.rounds):
        for mode, flush in flushes.items():
            for name, fn in impls.items():
                fn()
                torch.cuda.synchronize()
                t = timing.cuda_device_time(fn, flush)
                row = dict(case=args.case, round=rnd, flush=mode, impl=name, us=t["us"],
                           us_min=t["us_min"], kernels_per_call=t["kernels_per_call"],
                           pct_copy=case.pct_of(t["us"], copy_gbps))
                rows.append(row)
                print(json.dumps(row), flush=True)
    summary = {}
    for row in rows:
        summary.setdefault((row["flush"], row["impl"]), []).append(row["pct_copy"])
    print(f"copy {copy_gbps:.0f} GB/s; {args.case}: % of copy, median of {args.rounds} rounds")
    for (mode, name), pcts in summary.items():
        print(f"  {mode:5s} {name:18s} {statistics.median(pcts):6.1f}  "
              f"[{min(pcts):.1f}, {max(pcts):.1f}]")
    _probe.write(args.out, "sm_ceiling", args.tag, copy_gbps=copy_gbps, rows=rows)


if __name__ == "__main__":
    main()
