"""The CUDA backend's launch on a machine with several GPUs, without a GPU: a fake driver keeps a
context stack, and the launch records which context was current when it ran.  A function of one
device's context launched while another's is current fails with CUDA_ERROR_INVALID_HANDLE on a
real driver, so the launch must make its own context current around it, and leave the caller's
as it was (tests/test_multi_gpu.py checks the same on two real GPUs)."""
import ctypes
import threading

import pytest

from rmsnorm_hip.backends import cuda as cuda_backend
from rmsnorm_hip.backends.cuda import CudaBackend, CudaKernel

pytestmark = pytest.mark.quick

OWN, OTHER = 0x1000, 0x2000


class FakeDriver:
    """cuCtxGetCurrent / cuCtxPushCurrent / cuCtxPopCurrent over a list (the thread's stack)."""

    CUresult = int

    def __init__(self, stack):
        self.stack = stack

    def cuCtxGetCurrent(self):
        return 0, (self.stack[-1] if self.stack else 0)

    def cuCtxPushCurrent(self, context):
        self.stack.append(int(context))
        return (0,)

    def cuCtxPopCurrent(self):
        return 0, self.stack.pop()


def fake_backend(stack, devices=2, fail=False):
    backend = CudaBackend.__new__(CudaBackend)
    backend.device_index = 1
    backend._driver = FakeDriver(stack)
    backend._context = backend._context_id = OWN
    backend._single_device = devices == 1
    backend._slots = threading.local()
    queries = []

    def get_current(address):
        queries.append(address)
        ctypes.c_void_p.from_address(address).value = stack[-1] if stack else None
        return 0

    launched = []

    def launch(handle, *rest):
        launched.append(stack[-1] if stack else 0)
        return 400 if fail else 0       # CUDA_ERROR_INVALID_HANDLE

    backend._get_current, backend._launch = get_current, launch
    return backend, launched, queries


KERNEL = CudaKernel(1, (), "", "k")


@pytest.mark.parametrize("caller", [[OWN], [OTHER], [], [OWN, OTHER]],
                         ids=["own-current", "other-current", "none-current", "own-under-other"])
def test_launch_runs_in_its_own_context_and_restores_the_callers(caller):
    stack = list(caller)
    backend, launched, _ = fake_backend(stack)
    backend.launch(KERNEL, (1, 1, 1), (32, 1, 1), (), 0)
    assert launched == [OWN], f"launched with context {launched} current"
    assert stack == caller, f"the caller's context stack {caller} became {stack}"


def test_one_device_launches_without_asking():
    stack = [OWN]
    backend, launched, queries = fake_backend(stack, devices=1)
    backend.launch(KERNEL, (1, 1, 1), (32, 1, 1), (), 0)
    assert launched == [OWN] and queries == []


def test_failed_launch_still_restores_the_callers_context():
    stack = [OTHER]
    backend, launched, _ = fake_backend(stack, fail=True)
    with pytest.raises(Exception):
        backend.launch(KERNEL, (1, 1, 1), (32, 1, 1), (), 0)
    assert launched == [OWN] and stack == [OTHER]


def test_launch_config_is_the_drivers_layout():
    """CUlaunchConfig / CUlaunchAttribute as cuda.h lays them out (x86-64), filled per grid and
    block once, the PDL attribute only on kernels launched with it."""
    assert ctypes.sizeof(cuda_backend._LaunchAttribute) == 72
    assert cuda_backend._LaunchAttribute.value.offset == 8
    config = cuda_backend._LaunchConfig
    assert (config.stream.offset, config.attrs.offset, config.num_attrs.offset,
            ctypes.sizeof(config)) == (32, 40, 48, 56)
    plain, address = CudaKernel(1, (), "", "k").config((3, 2, 1), (128, 2, 1))
    assert (list(plain.grid), list(plain.block), plain.num_attrs) == ([3, 2, 1], [128, 2, 1], 0)
    assert address == ctypes.addressof(plain)
    kernel = CudaKernel(1, (), "", "k", programmatic=True)
    pdl, _ = kernel.config((5, 1, 1), (64, 1, 1))
    assert kernel.config((5, 1, 1), (64, 1, 1))[0] is pdl     # built once per shape
    attribute = cuda_backend._LaunchAttribute.from_address(pdl.attrs)
    assert pdl.num_attrs == 1 and attribute.id == 6 and attribute.value[0] == 1


@pytest.mark.parametrize("value,expected", [("", False), ("0", False), ("off", False),
                                            ("1", True), ("TRUE", True), (" on ", True)])
def test_pdl_switch_reads_its_variable(monkeypatch, value, expected):
    monkeypatch.setenv("RMSNORM_HIP_PDL", value)
    assert cuda_backend.pdl_requested() is expected


def test_pdl_switch_refuses_other_values(monkeypatch):
    monkeypatch.setenv("RMSNORM_HIP_PDL", "2")
    with pytest.raises(ValueError, match="RMSNORM_HIP_PDL must be 1 or 0.*got '2'"):
        cuda_backend.pdl_requested()
