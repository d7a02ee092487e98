"""Benchmarks for rmsnorm_hip: device time, GB/s and % of copy bandwidth, next to the peers.

Python::

    from rmsnorm_hip._bench import run
    result = run(op="fwd", shapes=None, dtypes=None, json_path=None, plot_path=None,
                 compare=True, progress=True)

- ``op``: a key of ``ops.OPS`` (``"fwd"`` now; ``"bwd"``, ``"fused"``, ``"quant"`` once registered).
- ``shapes``: ``[(M, N) or "MxN", ...]``; None: the target's default cases (``runner.CUDA_CASES``,
  ``runner.CPU_CASES``).
- ``dtypes``: ``"bfloat16"``/``"bf16"``, ``"float16"``/``"fp16"``, ``"float32"``/``"fp32"``.
  None: bf16 for given shapes, else the default cases; given alone: the default shapes in them.
- ``json_path``: write the result there, rewritten after every case (a cut run keeps its data).
- ``plot_path``: a PNG of GB/s per case and implementation, the copy bandwidth as a line
  (needs matplotlib).
- ``compare``: True, every peer of the op; False, ours only; or peer names (``"torch"`` also selects
  ``"torch_compile"``).
- ``progress``: a tqdm bar on a terminal, one printed line per case otherwise.
- keyword-only: ``device`` ("auto", "cuda", "cpu"), ``iters`` (profiled calls per timing, 20),
  ``flush`` ("write" or "read": the L2 flush kernel, see ``timing.L2Flush``), ``host_overhead``
  (True), ``seed`` (0), ``print_table`` (True: the compact table at the end).

Command line: ``rmsnorm-hip bench [...]`` calls ``runner.main(argv)``; so does
``python -m rmsnorm_hip._bench [...]`` (``--help`` lists the options).

Method (benchmarks/NOTES.md has the reasons):

- CUDA (torch tensors): every implementation runs in the same process on the same inputs. Device
  time per call = median over 20 calls of the summed durations of the GPU activities one call
  issues (CUPTI through torch.profiler), with a 256 MB L2 flush before each call, the flush's own
  kernel excluded. CUDA events around each call are kept as a cross-check (``event_us``).
- CPU (NumPy arrays; no GPU or no torch): median wall-clock time per call.
- Before timing, each implementation's output is compared with a float64 reference on the same
  random inputs: ||out - ref|| / ||ref|| under 1e-2 (16-bit) or 1e-5 (float32); NaN fails. A
  failing or missing implementation is recorded with its error and skipped.
- CUDA: the implementations that passed are each timed once and that timing discarded before
  the recorded pass (``method.warm_up_pass``; device timings only, not the host cases): the first
  one timed after a large case could run slow for about a second.
- GB/s = the op's minimal bytes (fwd: 2*M*N*e + N*e) / time; % of a device-to-device copy of
  2 GiB (bytes read + written) measured in the same run.
- Host overhead at M=1 and M=32, N=4096 bf16: wall-clock per call of 1000 back-to-back calls and
  one sync (median of 3 runs), plus the device time.

Result (the JSON): ``schema``, ``op``, ``target``, ``environment`` (device, versions, date, ...),
``method``, ``copy`` (``gbps``), ``records`` (one per case and implementation: ``M``, ``N``,
``dtype``, ``impl``, ``ok``, ``status`` ok/failed/unavailable, ``error``, ``rel_err``, ``us``,
``event_us``, ``kernels``, ``gbps``, ``pct_copy``, ``bytes``) and ``host_overhead`` (``host_us``,
``host_us_runs``, ``us``). Importing this package does not import torch.
"""
from .runner import main, run

__all__ = ["main", "run"]
