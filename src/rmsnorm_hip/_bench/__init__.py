"""Benchmarks for rmsnorm_hip: device time, GB/s and % of copy bandwidth, next to the peers.

Python::

    from rmsnorm_hip._bench import run
    result = run(op="fwd", shapes=None, dtypes=None, json_path=None, plot_path=None,
                 compare=True, progress=True)
    result = run(decode=True)          # the decode mode, below

- ``op``: a key of ``ops.OPS`` (None: ``"fwd"``) or ``"all"`` (``ops.ALL``: fwd, bwd, bwd_dres,
  fused, quant, quant_fp8): those, fused_inplace, and qk and qk_rope (QK-norm in place on
  the q and k views of a QKV buffer, without and with neox RoPE; M = tokens, N = head size),
  gated and gated_bwd (Mamba 2's gated RMSNorm and its backward), and rms_norm_quant's scaled
  outputs: quant_group (fp8, a float32 scale per 1x128 group), quant_group_ue8m0 (the same with
  power-of-two scales stored column-major, DeepGEMM's), quant_group_int8, quant_static (fp8, a
  static scale) and mxfp8 / mxfp4 (OCP MX), each also as NAME_res: its fused-add form
  (``residual=``; residual_out among the outputs and the bytes).
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
- keyword-only: ``device`` ("auto", "cuda", "cpu"), ``iters`` (profiled calls per timing, 20;
  decode 10), ``flush`` ("write" or "read": the L2 flush kernel, see ``timing.L2Flush``),
  ``host_overhead`` (True), ``seed`` (0), ``print_table`` (True: the compact table at the end),
  ``pdl`` (False; True sets ``RMSNORM_HIP_PDL=1`` before our library's first call, recorded in
  ``method.pdl``), and for the decode mode ``decode`` (False), ``graph_calls`` (50),
  ``graph_replays`` (10), ``host_calls`` (300), ``host_repeats`` (5).

Command line: ``rmsnorm-hip bench [...]`` calls ``runner.main(argv)``; so does
``python -m rmsnorm_hip._bench [...]`` (``--help`` lists the options).

Method (docs/performance.md has the reasons):

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
- Host overhead at M=1 and M=32, N=4096 bf16 (QK-norm: a head size of 128): wall-clock per
  call of 1000 back-to-back calls and one sync (median of 3 runs), plus the device time.

Decode mode (``--decode``, decode.py; CUDA only): ops fwd, fused, fused_inplace (ours in place,
against the out-of-place fused peers), quant and bwd by default; any op of ``ops.OPS`` with
``--ops`` (qk, qk_rope, gated, mxfp4, ...), at M 1, 8, 32, 128, 512 x N 2048, 4096, 5120, 8192 (the
QK-norm ops: head sizes 64, 128, 256), bf16.  Checked as above, then four figures per call:
``graph_us``, the replay time of 50 calls captured in one CUDA graph / 50 (median of 10 replays,
after warm-up on the capture stream), what a serving engine's decode step sees; ``us``, the flushed
device time above; ``warm_us``, the device time with no flush (a one-element marker kernel
separates the calls in the trace); ``host_us``, 300 eager calls and one sync (median of 5 rounds
that take the implementations in turn, garbage collection off).  Checks, graph and host figures of
all cases run before the profiler's first run, which may leave CUPTI attached and add to the host
cost of every later launch.  Its result has ``mode`` "decode", ``ops`` and flat ``records`` (``op``
and the four figures in each, None where not measured); the tables give best peer / ours per
figure.

Result (the JSON): ``schema``, ``op``, ``target``, ``environment`` (device, versions, date, ...),
``method``, ``copy`` (``gbps``), ``records`` (one per case and implementation: ``M``, ``N``,
``dtype``, ``impl``, ``ok``, ``status`` ok/failed/unavailable, ``error``, ``rel_err``, ``us``,
``event_us``, ``kernels``, ``gbps``, ``pct_copy``, ``bytes``) and ``host_overhead`` (``host_us``,
``host_us_runs``, ``us``). Importing this package does not import torch.
"""
from .runner import main, run

__all__ = ["main", "run"]
