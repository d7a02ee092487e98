"""Whether each forward kernel fits an NVIDIA SM, from its sm_90 PTX through ptxas (no GPU):
threads a block, registers a thread and spills, for the streamed program, the one-shot block
and the one-shot block built to its launch bounds (FwdSpec.bounded), per kind of row.  A block
needs registers x threads <= 65536; the dispatcher runs a streamed program that does not fit
one-shot, and a one-shot block that does not fit bounded (backends/_gpu.GpuBackend._fwd_kernel).

    PYTHONPATH=src python3 benchmarks/kernel_fit.py [--ns 8192,16384,32768] [--out FILE]
"""
import argparse
import json
from dataclasses import replace

KINDS = {   # fwd_spec's keyword arguments of each kind of row (weight in x's dtype)
    "plain": {},
    "fused": dict(residual=True),
    "quant": dict(quant="int8", xscale="float32", offset=False),
    "quant_residual": dict(residual=True, quant="int8", xscale="float32", offset=False),
    "static_residual": dict(residual=True, quant="float8_e4m3fn", scaling="static", offset=False),
    "group_residual": dict(residual=True, quant="float8_e4m3fn", scaling="group", group=128,
                           offset=False),
}
REGISTERS_PER_SM = 65536


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default="8192,16384,32768")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    from rmsnorm_hip import aot
    from rmsnorm_hip.backends.cuda import variant_ptx
    from rmsnorm_hip.kernels import _config, rmsnorm_fwd

    rows = []
    for dtype in args.dtypes.split(","):
        for n in map(int, args.ns.split(",")):
            for kind, kwargs in KINDS.items():
                streamed = _config.fwd_spec(n, dtype, dtype, True, False, stream=True, **kwargs)
                one_shot = _config.fwd_spec(n, dtype, dtype, True, False, **kwargs)
                forms = {"one-shot": one_shot, "bounded": replace(one_shot, bounded=True)}
                if streamed.stream:
                    forms["streamed"] = streamed
                for form, spec in forms.items():
                    ptx, _ = variant_ptx(rmsnorm_fwd.make_rmsnorm_fwd, spec,
                                         rmsnorm_fwd.argtypes(spec), (9, 0))
                    found = aot._ptxas_resources(ptx, "sm_90")
                    threads = spec.layout.threads * spec.rows
                    row = dict(dtype=dtype, n=n, kind=kind, form=form, threads=threads,
                               registers=found.get("registers"),
                               spill_bytes=found.get("spill_store_bytes"))
                    row["fits"] = (row["registers"] is not None
                                   and row["registers"] * threads <= REGISTERS_PER_SM)
                    rows.append(row)
                    print(f"{dtype:9s} N={n:<6d} {kind:16s} {form:9s} {threads:5d} threads "
                          f"x {row['registers']} registers, spills {row['spill_bytes']} B"
                          f"{'' if row['fits'] else '  does not fit'}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(arch="sm_90", rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
