"""Simulator backend: the same GPU kernel source run by the numba-cuda simulator on host (NumPy)
arrays, for testing kernel logic without a GPU.  ``NUMBA_ENABLE_CUDASIM=1`` must be set before
numba.cuda is first imported (the simulator cannot be switched on later in a process); the warp
width is a parameter (``RMSNORM_HIP_SIM_WARP=64`` runs the AMD wavefront layout)."""
import os
import sys

import numpy as np

from .. import _dtypes, intrinsics
from ._gpu import GpuBackend


def enable():
    """Switch the simulator on for this process, if numba.cuda is not imported yet."""
    if "numba.cuda" in sys.modules:
        from numba.cuda import config
        if not config.ENABLE_CUDASIM:
            raise RuntimeError("the sim backend needs NUMBA_ENABLE_CUDASIM=1 before numba.cuda is "
                               "imported; this process already runs numba.cuda compiled")
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"


class SimBackend(GpuBackend):
    name = "sim"

    def __init__(self, warp=32):
        enable()
        self.arch = f"sim{warp}"
        self.sm_count = 1
        super().__init__(intrinsics.load("sim", warp))

    def compile(self, pyfunc, argtypes, name, max_threads=None, min_blocks=None):
        from numba import cuda
        return cuda.jit(pyfunc)

    @staticmethod
    def arg(info, dtype):
        """The flat host memory of an array from its first element to its last."""
        if info is None:
            return np.zeros(1, _dtypes.STORAGE[dtype])
        host = info.host
        extent = info.extent_bytes() // host.itemsize
        return np.lib.stride_tricks.as_strided(host, shape=(max(extent, 1),),
                                               strides=(host.itemsize,))

    def resident_per_sm(self, kernel, block_threads):
        return 2   # two streamed forward programs on the simulated SM: rows walked with a stride

    def stream_for(self, info):
        return 0

    def launch(self, kernel, grid, block, args, stream):
        kernel[grid, block](*args)
