"""rmsnorm_hip: RMSNorm kernels written in Python with Numba, for AMD gfx942/gfx950 (numba-hip),
NVIDIA (numba-cuda) and the CPU, from one kernel source.  See API.md for the contract."""
from .functional import rms_norm, rms_norm_backward

__all__ = ["rms_norm", "rms_norm_backward"]
__version__ = "0.1.0"
