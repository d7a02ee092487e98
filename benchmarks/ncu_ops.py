"""Drives a few calls of one entry point for Nsight Compute (no CUPTI of its own, which ncu
would contend with), bf16 x of M x N:

    ncu --clock-control none -k regex:rmsnorm -s 2 -c 1 --section WarpStateStats \\
        python3 benchmarks/ncu_ops.py bwd 4096 4096

ops: fwd, fused, quant (SmoothQuant int8), quant_group (fp8 e4m3, 128-column groups), gated,
gated_bwd (Mamba 2's gate on the input), bwd, bwd_dres; a fourth argument ``offset`` puts every
row one element past 16 bytes (views of (M, N + 1) buffers: the scalar kernels).  qk and qk_rope
(neox): M tokens of 32 query and 8 key heads of size N, in place in a QKV buffer, as the bench.
"""
import sys


def main():
    import torch

    import rmsnorm_hip

    op, m, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    offset = sys.argv[4:] == ["offset"]

    def rows():
        if offset:
            return torch.empty(m, n + 1, device="cuda", dtype=torch.bfloat16)[:, 1:].normal_()
        return torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    x = rows()
    other = rows()
    w = (1 + 0.1 * torch.randn(n, device="cuda")).to(torch.bfloat16)
    xscale = (1 + 0.1 * torch.rand(n, device="cuda"))
    rstd = rmsnorm_hip.rms_norm(x, w, 1e-6, return_rstd=True)[1]
    calls = {
        "fwd": lambda: rmsnorm_hip.rms_norm(x, w, 1e-6),
        "fused": lambda: rmsnorm_hip.fused_add_rms_norm(x, other, w, 1e-6),
        "quant": lambda: rmsnorm_hip.rms_norm_quant(x, w, 1e-6, xscale=xscale),
        "bwd": lambda: rmsnorm_hip.rms_norm_backward(other, x, w, rstd),
        "bwd_dres": lambda: rmsnorm_hip.rms_norm_backward(other, x, w, rstd, dresidual=x),
        "quant_group": lambda: rmsnorm_hip.rms_norm_quant(x, w, 1e-6, quant_dtype="float8_e4m3fn",
                                                          group_size=128),
        "gated": lambda: rmsnorm_hip.rms_norm_gated(x, other, w, 1e-6),
    }
    if op == "gated_bwd":
        dy = rows()
        gated_rstd = rmsnorm_hip.rms_norm_gated(x, other, w, 1e-6, return_rstd=True)[1]
        calls[op] = lambda: rmsnorm_hip.rms_norm_gated_backward(dy, x, other, w, gated_rstd)
    if op.startswith("qk"):
        buf = torch.randn(m, 48 * n, device="cuda", dtype=torch.bfloat16)
        q, k = buf[:, :32 * n].view(m, 32, n), buf[:, 32 * n:40 * n].view(m, 8, n)
        wq, wk = w[:n].clone(), w[:n].flip(0).contiguous()
        positions = torch.arange(m, device="cuda") % 4096
        cache = torch.randn(4096, n, device="cuda")
        rope = dict(positions=positions, cos_sin_cache=cache) if op == "qk_rope" else {}
        calls[op] = lambda: rmsnorm_hip.qk_rms_norm_(q, k, wq, wk, 1e-6, **rope)
    for _ in range(4):
        calls[op]()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
