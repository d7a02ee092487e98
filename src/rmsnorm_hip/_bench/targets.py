"""Where a benchmark runs: CUDA through torch tensors, or the CPU through NumPy arrays.

A target makes the inputs, upcasts to float64 for the reference, measures the error, times calls
and describes the machine. Op definitions (ops.py) use only these methods and the arithmetic
operators that torch tensors and NumPy arrays share, so one reference serves both targets.
"""
import datetime
import importlib.metadata
import os
import platform
import subprocess

from . import timing

DTYPE_NAMES = ("bfloat16", "float16", "float32")
SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}

# Distributions whose versions go into the JSON (absent ones are skipped).
_DISTRIBUTIONS = (
    "torch", "triton", "numpy", "numba", "numba-cuda", "cuda-bindings", "cupy-cuda13x", "ml_dtypes",
    "liger-kernel", "quack-kernels", "nvidia-cutlass-dsl", "apache-tvm-ffi", "rmsnorm-hip",
)


def _versions():
    found = {}
    for name in _DISTRIBUTIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def _git_commit():
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        # "-dirty" where the tracked files differ from HEAD: a working tree copied over an
        # older checkout (a device machine's) is not that commit
        done = subprocess.run(["git", "-C", here, "describe", "--always", "--dirty",
                               "--abbrev=7", "--exclude=*"],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def _common_environment():
    import rmsnorm_hip

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "versions": _versions(),
        "rmsnorm_hip": getattr(rmsnorm_hip, "__version__", None),
        "rmsnorm_hip_path": os.path.dirname(rmsnorm_hip.__file__ or ""),
        "git_commit": _git_commit(),
    }


class CudaTarget:
    """torch CUDA tensors on the current device; device time through CUPTI (timing.py)."""

    name = "cuda"
    timer = "cupti"
    device = "cuda"
    warm_up_pass = True     # device timings of a case after a discarded one (runner._warm_up)

    def __init__(self, flush_mode="write", iters=20):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("CudaTarget: torch sees no CUDA device")
        self.torch = torch
        self.iters = iters
        # None: no flush yet; decode.py makes it after its host timings, since making it runs
        # the profiler, which may leave CUPTI attached and add to the host cost of launches.
        self.flush = None if flush_mode is None else timing.L2Flush(flush_mode)

    def dtype(self, name):
        return getattr(self.torch, name)

    def itemsize(self, name):
        return self.dtype(name).itemsize

    def randn(self, shape, dtype, seed, mean=0.0, std=1.0):
        generator = self.torch.Generator(device=self.device).manual_seed(seed)
        values = self.torch.randn(shape, generator=generator, device=self.device,
                                  dtype=self.torch.float32)
        return (values * std + mean).to(self.dtype(dtype))

    def float64(self, array):
        return self._as_tensor(array).to(self.torch.float64)

    def rel_err(self, out, ref):
        """||out - ref|| / ||ref|| in float64; NaN or Inf (both fail) for bad values or shapes."""
        out = self._as_tensor(out)
        if tuple(out.shape) != tuple(ref.shape):
            return float("nan")
        norm = self.torch.linalg.vector_norm
        return (norm(out.to(self.torch.float64) - ref) / norm(ref)).item()

    def _as_tensor(self, array):
        return array if isinstance(array, self.torch.Tensor) else self.torch.from_dlpack(array)

    def sync(self):
        self.torch.cuda.synchronize()

    def time(self, fn):
        for _ in range(3):
            fn()
        result = timing.cuda_device_time(fn, self.flush, self.iters)
        result.update(timing.cuda_event_time(fn, self.flush, self.iters))
        return result

    def host_time(self, fn):
        result = timing.host_time(fn, self.sync)
        result["us"] = timing.cuda_device_time(fn, self.flush, self.iters)["us"]
        return result

    def copy_bandwidth(self):
        return timing.cuda_copy_bandwidth()

    def free_memory(self):
        self.torch.cuda.empty_cache()

    def environment(self):
        torch = self.torch
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env = _common_environment()
        env.update({
            "device": props.name,
            "capability": f"{props.major}.{props.minor}",
            "sm_count": props.multi_processor_count,
            "l2_bytes": getattr(props, "L2_cache_size", None),
            "memory_bytes": props.total_memory,
            "torch_cuda": torch.version.cuda,
            "nvidia_smi": _nvidia_smi(),
        })
        return env


def _nvidia_smi():
    """Driver and clocks as nvidia-smi reads them (read-only query), or None."""
    query = "driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw"
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.splitlines()
    if done.returncode != 0 or not lines:
        return None
    return dict(zip(query.split(","), (v.strip() for v in lines[0].split(","))))


class CpuTarget:
    """NumPy arrays (bfloat16 from ml_dtypes); median wall-clock time per call."""

    name = "cpu"
    timer = "wall"
    warm_up_pass = False    # wall-clock medians over ~1 s: nothing a first timing pays for

    def __init__(self):
        import numpy

        self.np = numpy

    def dtype(self, name):
        if name == "bfloat16":
            import ml_dtypes

            return self.np.dtype(ml_dtypes.bfloat16)
        return self.np.dtype(name)

    def itemsize(self, name):
        return self.dtype(name).itemsize

    def randn(self, shape, dtype, seed, mean=0.0, std=1.0):
        values = self.np.random.default_rng(seed).standard_normal(shape, dtype=self.np.float32)
        return (values * std + mean).astype(self.dtype(dtype))

    def float64(self, array):
        return self.np.asarray(array).astype(self.np.float64)

    def rel_err(self, out, ref):
        out = self.np.asarray(out)
        if out.shape != ref.shape:
            return float("nan")
        norm = self.np.linalg.norm
        with self.np.errstate(invalid="ignore", over="ignore"):
            return float(norm((out.astype(self.np.float64) - ref).ravel()) / norm(ref.ravel()))

    def sync(self):
        pass

    def time(self, fn):
        return timing.wall_time(fn)

    def host_time(self, fn):
        return timing.host_time(fn, self.sync)

    def copy_bandwidth(self):
        return timing.cpu_copy_bandwidth()

    def free_memory(self):
        pass

    def environment(self):
        env = _common_environment()
        env["device"] = platform.processor() or platform.machine()
        return env


def make_target(device="auto", **cuda_options):
    """'cuda', 'cpu', or 'auto': CUDA when torch imports and sees a GPU, else the CPU."""
    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"make_target: device must be 'auto', 'cuda' or 'cpu', got {device!r}")
    if device == "auto":
        try:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            device = "cpu"
    return CudaTarget(**cuda_options) if device == "cuda" else CpuTarget()
