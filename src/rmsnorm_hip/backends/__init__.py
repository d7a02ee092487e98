"""Backend selection: ``RMSNORM_HIP_BACKEND=cuda|hip|cpu|sim`` overrides; otherwise the array's
device decides (host memory -> cpu, CUDA -> cuda, ROCm -> hip).  One backend object per
(name, device), created on first use."""
import os
import threading

from .. import _arrays

NAMES = ("cuda", "hip", "cpu", "sim")
ENV = "RMSNORM_HIP_BACKEND"
_backends = {}
_lock = threading.Lock()


def get(name, device_index=0):
    key = (name, device_index)
    backend = _backends.get(key)
    if backend is None:
        with _lock:
            backend = _backends.get(key)
            if backend is None:
                backend = _backends[key] = _create(name, device_index)
    return backend


def _create(name, device_index):
    if name == "cpu":
        from .cpu import CpuBackend
        return CpuBackend()
    if name == "sim":
        from .sim import SimBackend
        return SimBackend(int(os.environ.get("RMSNORM_HIP_SIM_WARP", "32")))
    if name == "cuda":
        from .cuda import CudaBackend
        return CudaBackend(device_index)
    if name == "hip":
        from .hip import HipBackend
        return HipBackend(device_index)
    raise ValueError(f"unknown backend {name!r}")


def requested(fn="rmsnorm_hip"):
    """The backend RMSNORM_HIP_BACKEND names, or None; ``fn`` heads the error."""
    name = os.environ.get(ENV, "").strip().lower()
    if name and name not in NAMES:
        raise ValueError(f"{fn}: {ENV} must be one of {', '.join(NAMES)}, got {name!r}")
    return name or None


def for_array(info, fn):
    """The backend that runs a call whose x is ``info``."""
    name = requested(fn)
    if info.device == "cpu":
        if name in ("cuda", "hip"):
            raise ValueError(f"{fn}: {ENV}={name} needs device arrays, got host (NumPy) memory; "
                             f"pass CuPy/torch device arrays or use cpu")
        return get(name or "cpu")
    expected = "hip" if info.device == "rocm" else "cuda"
    if name == "sim" and expected == "cuda" and _arrays.simulated():
        return get("sim")       # numba.cuda runs as the simulator: its device memory is the host's
    if name not in (None, expected):
        raise ValueError(f"{fn}: {ENV}={name} cannot run {info.device} device arrays "
                         f"(use {expected})")
    return get(expected, info.device_index)
