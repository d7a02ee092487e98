"""rmsnorm_hip: RMSNorm kernels written in Python with Numba, for AMD gfx942/gfx950 (numba-hip),
NVIDIA (numba-cuda) and the CPU, from one kernel source.  docs/api.md is the API reference."""
from .functional import (fused_add_rms_norm, fused_add_rms_norm_, rms_norm, rms_norm_backward,
                         rms_norm_quant)
from .gated import rms_norm_gated, rms_norm_gated_backward
from .qk import qk_rms_norm, qk_rms_norm_

__all__ = ["rms_norm", "rms_norm_backward", "fused_add_rms_norm", "fused_add_rms_norm_",
           "rms_norm_quant", "qk_rms_norm", "qk_rms_norm_", "rms_norm_gated",
           "rms_norm_gated_backward"]
__version__ = "0.1.0"
