"""The op registry: for each op, what it must move, how to call it, and its reference.

An `Op` holds everything the runner needs to benchmark one entry point against its peers:

- `bytes_moved(M, N, itemsize)`: the fewest bytes the op must move through memory (each input read
  once, each output written once), from which GB/s are computed; `bytes_formula` says it in words.
- `make_inputs(target, M, N, dtype, seed)`: the positional arguments every implementation gets.
  It may use seeds `seed` to `seed + 99`.
- `reference(target, *args)`: the float64 result computed from the same (rounded) inputs.
- `ours` and `peers`: `{target name: {implementation name: factory}}` (peers.py).
- `tolerance`: `{dtype: largest relative error ||out - ref|| / ||ref|| that passes}`.

To add an op (`bwd`, `fused`, `quant`): write those functions and add an entry to `OPS`. An op with
several outputs returns a tuple from its implementations and its reference; the error is the
largest over the outputs.
"""
import math
from dataclasses import dataclass, field
from typing import Callable, Mapping

from . import peers

EPS = 1e-6
TOLERANCE = {"bfloat16": 1e-2, "float16": 1e-2, "float32": 1e-5}


@dataclass(frozen=True)
class Op:
    name: str
    summary: str
    bytes_formula: str
    bytes_moved: Callable[[int, int, int], int]
    make_inputs: Callable
    reference: Callable
    ours: Mapping[str, Mapping[str, Callable]]
    peers: Mapping[str, Mapping[str, Callable]]
    tolerance: Mapping[str, float] = field(default_factory=lambda: dict(TOLERANCE))

    def max_rel_err(self, target, outputs, reference):
        """Largest relative error over the outputs; NaN (which fails every check) on a mismatch."""
        if not isinstance(reference, tuple):
            outputs, reference = (outputs,), (reference,)
        if not isinstance(outputs, tuple) or len(outputs) != len(reference):
            return float("nan")
        errors = [target.rel_err(out, ref) for out, ref in zip(outputs, reference)]
        return float("nan") if any(math.isnan(e) for e in errors) else max(errors)

    def passes(self, dtype, rel_err):
        return rel_err < self.tolerance[dtype]  # False for NaN


def _rms_norm_inputs(target, M, N, dtype, seed):
    x = target.randn((M, N), dtype, seed)
    weight = target.randn((N,), dtype, seed + 1, mean=1.0, std=0.1)
    return x, weight, EPS


def _rms_norm_reference(target, x, weight, eps):
    # Only operators that torch tensors and NumPy arrays share (see targets.py).
    x = target.float64(x)
    rstd = ((x * x).sum(-1) / x.shape[-1] + eps) ** -0.5
    return x * rstd[:, None] * target.float64(weight)


OPS = {
    "fwd": Op(
        name="fwd",
        summary="y = rms_norm(x, weight, eps), x (M, N), weight (N,) in x's dtype",
        bytes_formula="2*M*N*e + N*e (read x and weight, write y)",
        bytes_moved=lambda M, N, e: 2 * M * N * e + N * e,
        make_inputs=_rms_norm_inputs,
        reference=_rms_norm_reference,
        ours={
            "cuda": {"ours": peers.ours_rms_norm, "ours_torch": peers.ours_torch_rms_norm},
            "cpu": {"ours": peers.ours_rms_norm},
        },
        peers={
            "cuda": {
                "torch": peers.torch_rms_norm,
                "torch_compile": peers.torch_compile_rms_norm,
                "liger": peers.liger_rms_norm,
                "quack": peers.quack_rms_norm,
            },
            "cpu": {"numpy": peers.numpy_rms_norm},
        },
    ),
}
