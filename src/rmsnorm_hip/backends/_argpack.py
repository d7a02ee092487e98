"""Kernel parameters packed by the project for ``cuLaunchKernel`` / ``hipModuleLaunchKernel``: one
ctypes struct per kernel signature and thread, refilled in place by a single ``__init__`` call, and
the ``void*[]`` of its field addresses that the driver reads."""
import ctypes
import threading

from numba import types

_CTYPES = {types.int64: ctypes.c_int64, types.float32: ctypes.c_float, types.int32: ctypes.c_int32}


def _ctype(numba_type):
    if isinstance(numba_type, types.CPointer):
        return ctypes.c_uint64
    return _CTYPES[numba_type]


class ArgPack:
    def __init__(self, argtypes):
        fields = [(f"a{i}", _ctype(t)) for i, t in enumerate(argtypes)]
        self._struct = type("KernelArgs", (ctypes.Structure,), {"_fields_": fields})
        self._offsets = [getattr(self._struct, name).offset for name, _ in fields]
        self._local = threading.local()

    def pack(self, args):
        """Address of the ``void*`` array for ``args`` (valid until this thread's next pack)."""
        slot = getattr(self._local, "slot", None)
        if slot is None:
            values = self._struct()
            base = ctypes.addressof(values)
            pointers = (ctypes.c_void_p * len(self._offsets))(*[base + o for o in self._offsets])
            slot = self._local.slot = (values, pointers, ctypes.addressof(pointers))
        slot[0].__init__(*args)
        return slot[2]
