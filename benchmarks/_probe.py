"""What the session-24 probes (carveout_ab, carveout_probe, clock_probe, flush_gap_probe,
sm_ceiling) share: their command line, one benchmark case set up as the benchmark sets it up
(bf16, its inputs and bytes), the reference workloads they time beside ours, and the JSON they
write.  Needs a CUDA GPU and torch (imported on use)."""
import argparse
import json
import os
from dataclasses import dataclass


def parser(case=True):
    """--out (default $OUT or .), --tag, and --case op:MxN unless ``case`` is False."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    if case:
        ap.add_argument("--case", default="quant:4096x4096", help="op:MxN (bfloat16)")
    ap.add_argument("--tag", default="", help="suffix of the output file name")
    return ap


@dataclass
class Case:
    name: str           # op:MxN
    op: str
    m: int
    n: int
    spec: object        # the benchmark's Op
    impls: dict         # name -> callable: ours, and the peers when asked for
    inputs: tuple
    nbytes: int         # the op's minimal bytes at this shape

    def run(self, impl="ours"):
        return self.impls[impl](*self.inputs)

    def pct_of(self, us, copy_gbps):
        return 100 * self.nbytes / us / 1e3 / copy_gbps


def load_case(target, case, peers=False):
    """The benchmark's case ``op:MxN`` in bf16 on ``target``: ours (and the peers with ``peers``),
    its inputs (seed 1000) and bytes."""
    from rmsnorm_hip._bench import ops, runner
    op, shape = case.split(":")
    m, n = runner._shape(shape)
    spec = ops.OPS[op]
    return Case(name=case, op=op, m=m, n=n, spec=spec,
                impls=runner._implementations(spec, "cuda", peers),
                inputs=spec.make_inputs(target, m, n, "bfloat16", 1000),
                nbytes=spec.bytes_moved(m, n, target.itemsize("bfloat16")))


def same_bytes_copy(nbytes):
    """A torch device-to-device copy moving ``nbytes`` (half read, half written): the copy
    engine's rate for an op's bytes (copy_ceiling.py)."""
    import torch
    src = torch.randint(0, 255, (nbytes // 2,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return lambda *_: dst.copy_(src)


def matmul_burn(calls):
    """``calls`` bf16 8192^3 matmuls and a synchronize: the GPU warm and power-capped."""
    import torch
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def burn():
        for _ in range(calls):
            a @ a
        torch.cuda.synchronize()
    return burn


def set_carveout(carveout):
    """CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT on every kernel of ours loaded so far
    (-1: no preference; 0: the largest L1; 100: the largest shared memory); the kernels."""
    from cuda.bindings import driver

    from rmsnorm_hip import _cache
    from rmsnorm_hip.backends.cuda import CudaKernel, _check
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    kernels = [k for k in _cache.entries().values() if isinstance(k, CudaKernel)]
    for kernel in kernels:
        _check(driver.cuFuncSetAttribute(kernel.function, attr, carveout), "cuFuncSetAttribute")
    return kernels


def write(out, stem, tag, **payload):
    """``payload`` as JSON to out/{stem}{tag}.json."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{stem}{tag}.json"), "w") as f:
        json.dump(payload, f, indent=1)


def per_call_us(fn, flush, calls, names=None):
    """Device time of each of ``calls`` x (flush; fn), in order (CUPTI, as timing.
    cuda_device_time), leaving out torch's sleep kernel (``torch.cuda._sleep``: spin_kernel),
    which a probe uses to put idle time before a call.  ``names``: a set that takes the names of
    every activity of the calls, the sleep kernel's included."""
    from rmsnorm_hip._bench import timing
    split = timing._split_calls(timing._profile_activities(fn, flush, calls), flush.kernel_names)
    if names is not None:
        names.update(name for call in split for name, _ in call)
    return [sum(us for name, us in call if "spin" not in name.lower()
                and "sleep" not in name.lower()) for call in split]
