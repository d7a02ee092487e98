"""Simulator backend: the same GPU kernel source run by the numba-cuda simulator on host (NumPy)
arrays, for testing kernel logic without a GPU.  ``NUMBA_ENABLE_CUDASIM=1`` must be set before
numba.cuda is first imported (the simulator cannot be switched on later in a process); the warp
width is a parameter (``RMSNORM_HIP_SIM_WARP=64`` runs the AMD wavefront layout)."""
import os
import sys

import numpy as np

from .. import _arrays, _dtypes, intrinsics
from ._gpu import GpuBackend


def enable():
    """Switch the simulator on for this process, if numba.cuda is not imported yet."""
    if "numba.cuda" in sys.modules:
        from numba.cuda import config
        if not config.ENABLE_CUDASIM:
            raise RuntimeError("the sim backend needs NUMBA_ENABLE_CUDASIM=1 before numba.cuda is "
                               "imported; this process already runs numba.cuda compiled")
        return
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    # numba-cuda's config is numba's (numba.cuda.core.config aliases numba.core.config), read
    # from the environment when numba was imported, which the package has done: read it again
    numba_config = sys.modules.get("numba.core.config")
    if numba_config is not None:
        numba_config.reload_config()


class SimBackend(GpuBackend):
    name = "sim"

    def __init__(self, warp=32):
        enable()
        self.arch = f"sim{warp}"
        self.sm_count = 1
        super().__init__(intrinsics.load("sim", warp))

    # The dweight reduction runs 8 simulated threads per column of dweight (32768 at N = 4096:
    # most of a simulated backward call's time).  Its kernel is checked bitwise against its
    # documented order on its own (tests/test_backward.py::test_sim_dweight_reduce_keeps_its_order)
    # and in a few whole calls; other calls add the partial rows in that order on the host,
    # unless ``reduce_on_host`` is switched off.
    reduce_on_host = True

    def compile(self, builder, spec, argtypes):
        from numba import cuda
        kernel = cuda.jit(builder(self.intrinsics, spec))
        if builder.__name__ == "make_dweight_reduce":
            kernel.reduce_spec = spec
        return kernel

    @staticmethod
    def arg(info, dtype):
        """The flat host memory of an array from its first element to its last."""
        if info is None:
            return np.zeros(1, _dtypes.STORAGE[dtype])
        if info.host is None:   # a __cuda_array_interface__ array: simulated device memory
            info.host = _arrays.host_memory(info)
        host = info.host
        extent = info.extent_bytes() // host.itemsize
        return np.lib.stride_tricks.as_strided(host, shape=(max(extent, 1),),
                                               strides=(host.itemsize,))

    def resident_per_sm(self, kernel, block_threads):
        return 2   # two streamed forward programs on the simulated SM: rows walked with a stride

    def stream_for(self, info):
        return 0

    def launch(self, kernel, grid, block, args, stream):
        spec = getattr(kernel, "reduce_spec", None)
        if spec is not None and self.reduce_on_host:
            return _reduce_in_order(spec, *args)
        # arrays go in as device arrays over the caller's memory, not as NumPy arrays: numba
        # would copy each in and back out, and the copy-back of one array's span would overwrite
        # what the kernel wrote through another interleaved with it (x and residual as column
        # slices of one buffer)
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        kernel[grid, block](*[FakeCUDAArray(a) if isinstance(a, np.ndarray) and a.ndim else a
                              for a in args])


def _reduce_in_order(spec, ws, dweight, ws_rows, n):
    """make_dweight_reduce's sums on the host, in its order: column j of group g adds rows g,
    g + G, ... (a row: workspace rows 2q + 2q + 1 with spec.pairs) one after the other from 0;
    the G group sums are then added in group order, and rounded once to dweight's dtype."""
    span = 2 if spec.pairs else 1
    rows = ws_rows // span
    table = ws[:ws_rows * n].reshape(ws_rows, n)
    if spec.pairs:
        table = table[0::2] + table[1::2]
    parts = []
    for g in range(spec.groups):
        part = np.zeros(n, np.float32)
        for row in table[g:rows:spec.groups]:
            part = part + row
        parts.append(part)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    dweight[:n] = total.astype(_dtypes.NUMPY[spec.weight]).view(dweight.dtype)
