"""H200 check of paired backward rows (BWD_PAIRED_ROWS, session 17): dx bitwise the unpaired
kernel's, dweight against a float64 reference, three paired calls bitwise the same, over
16-bit N = 1100 / 4000 / 4096 at M = 1 / 7 / 333 / 4096, rstd given and recomputed, with and
without dresidual; and rows one element off 16 bytes (the scalar kernel standing in for the pair,
BwdSpec.pair_twin) bitwise the contiguous call's dx and dweight.  Prints one JSON line per case
and a summary; exits 1 on any failure.

    PYTHONPATH=src python3 benchmarks/check_paired.py"""
import json
import sys

import torch

import rmsnorm_hip
from rmsnorm_hip import functional
from rmsnorm_hip.kernels import _config


def ref(dy, x, w, rstd, dres):
    x64, dy64, w64 = x.double(), dy.double(), w.double()
    if rstd is None:
        rstd = torch.rsqrt(x64.pow(2).mean(-1) + 1e-6)
    r = rstd.double()[:, None]
    xh = x64 * r
    wdy = dy64 * w64
    c1 = (xh * wdy).mean(-1, keepdim=True)
    dx = (wdy - xh * c1) * r
    if dres is not None:
        dx = dx + dres.double()
    return dx, (dy64 * xh).sum(0)


def main():
    fails = 0
    for dtype in (torch.bfloat16, torch.float16):
        for n in (1100, 4000, 4096):
            for m in (1, 7, 333, 4096):
                for given in (True, False):
                    for has_dres in (False, True):
                        g = torch.Generator(device="cuda").manual_seed(m * n)
                        x = torch.randn(m, n, device="cuda", generator=g).to(dtype)
                        dy = torch.randn(m, n, device="cuda", generator=g).to(dtype)
                        w = (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).to(dtype)
                        dres = torch.randn(m, n, device="cuda", generator=g).to(dtype) \
                            if has_dres else None
                        rstd = rmsnorm_hip.rms_norm(x, w, 1e-6, return_rstd=True)[1] \
                            if given else None
                        outs = {}
                        for paired in (False, True):
                            _config.BWD_PAIRED_ROWS = {"cuda": paired, "hip": False}
                            functional.forget_plans()
                            outs[paired] = [rmsnorm_hip.rms_norm_backward(dy, x, w, rstd,
                                                                          dresidual=dres)
                                            for _ in range(3)]
                        p = outs[True]
                        shifted = [None if a is None else
                                   torch.empty(m, n + 1, device="cuda", dtype=dtype)[:, 1:]
                                   .copy_(a) for a in (dy, x, dres)]
                        twin = rmsnorm_hip.rms_norm_backward(shifted[0], shifted[1], w, rstd,
                                                             dresidual=shifted[2])
                        twin_same = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                                        for a, b in zip(twin, p[0]))
                        rdx, rdw = ref(dy, x, w, rstd, dres)
                        dx_same = torch.equal(p[0][0].view(torch.int16),
                                              outs[False][0][0].view(torch.int16))
                        runs_same = all(torch.equal(p[0][1].view(torch.int16),
                                                    q[1].view(torch.int16)) for q in p[1:])
                        dw_err = ((p[0][1].double() - rdw).abs().max()
                                  / rdw.abs().max().clamp_min(1e-30)).item()
                        dx_err = ((p[0][0].double() - rdx).abs().max()
                                  / rdx.abs().max()).item()
                        tol = 8e-3 if dtype == torch.bfloat16 else 1e-3
                        ok = (dx_same and runs_same and twin_same and dw_err < tol
                              and dx_err < tol)
                        fails += not ok
                        print(json.dumps(dict(dtype=str(dtype), n=n, m=m, rstd=given,
                                              dres=has_dres, dx_same=dx_same,
                                              runs_same=runs_same, twin_same=twin_same,
                                              dw_err=dw_err,
                                              dx_err=dx_err, ok=ok)), flush=True)
    print(json.dumps(dict(summary=True, failures=fails)))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
