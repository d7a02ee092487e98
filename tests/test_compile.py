"""Ahead-of-time compilation of the kernel variants the dispatcher can launch
(``kernels/catalog.variants()``) to sm_90 PTX, no GPU needed, through ``rmsnorm-hip compile
--target cuda``: its gates (``aot.problems``) check per variant that it compiles; that vector
variants use 128-bit global loads (``ld.global.v4``), 128-bit stores where they store rows of x's
width, and no byte-by-byte stores; that scalar variants whose rows move their inner spans as
aligned blocks have those 128-bit loads; no local memory (``__local_depot``), and through ptxas
registers and spills (none, but for ``aot.SM90_SPILL_ALLOWANCE``), named barriers of paired rows,
evict-first loads and dweight atomics exactly where chosen.

The default tier compiles one variant per kernel family (the LLM-sized bf16 rows); the full tier
every variant of the catalog.  The pytest process runs numba.cuda as the simulator
(tests/conftest.py), so the compile runs in a subprocess with NUMBA_ENABLE_CUDASIM=0.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rmsnorm_hip import intrinsics

pytestmark = pytest.mark.quick

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
FAMILIES = ("fwd", "fused_add", "quant", "bwd", "bwd_reduce")


def representatives():
    """The label of one variant per family: N = 4096 bf16 rows on the vector path where the
    family has them (the shapes LLMs run), else its first variant."""
    from rmsnorm_hip.kernels import catalog
    chosen = {}
    for v in catalog.variants("cuda"):
        main = ":bfloat16:" in v.label and ":N=4096:" in v.label and ":vec:" in v.label
        if v.op not in chosen or (main and not chosen[v.op][1]):
            chosen[v.op] = (v.label, main)
    return [chosen[op][0] for op in FAMILIES]


def compile_sm90(tmp_path, labels=None):
    """``rmsnorm-hip compile --target cuda --arch sm_90`` of ``labels`` (None: the whole
    catalog) in a subprocess: its kernel records, or a skip without libNVVM."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    report = tmp_path / "sm90.json"
    only = [arg for label in labels or () for arg in ("--only", label)]
    done = subprocess.run([sys.executable, "-m", "rmsnorm_hip", "compile", "--target", "cuda",
                           "--arch", "sm_90", "--report", str(report), *only],
                          env=env, capture_output=True, text=True, timeout=3000)
    if "libnvvm" in done.stderr and done.returncode:
        pytest.skip("numba-cuda's NVVM is not installed")
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    return json.loads(report.read_text())["reports"][0]["kernels"]


@pytest.mark.compile
def test_one_variant_per_family_compiles_to_sm90(tmp_path):
    labels = representatives()
    kernels = compile_sm90(tmp_path, labels)
    # --only matches substrings: a label may select a few more variants
    assert set(labels) <= {k["label"] for k in kernels}
    assert not [k for k in kernels if k["problems"]], [k for k in kernels if k["problems"]]
    main = [k for k in kernels if k["label"] in labels and k["op"] != "bwd_reduce"]
    assert all(k["ld_global_v4"] for k in main), main


@pytest.mark.compile
@pytest.mark.full
def test_every_variant_compiles_to_sm90(tmp_path):
    from rmsnorm_hip.kernels import catalog
    kernels = compile_sm90(tmp_path)
    expected = [v.label for v in catalog.variants("cuda")]
    assert [k["label"] for k in kernels] == expected
    assert sum(k.get("atomic_dweight", False) for k in kernels) > 0
    failing = [f"{k['label']}: {'; '.join(k['problems'])}" for k in kernels if k["problems"]]
    assert not failing, "\n".join(failing)


def test_catalog_covers_every_forward_path():
    """The catalog (what is compiled here and for AMD) has each forward path with vector and
    scalar access for each op and dtype."""
    from rmsnorm_hip.kernels import catalog
    from _paths import path_of
    seen = {(v.op, v.spec.dtype, path_of(v.spec.layout, v.spec.rows), v.spec.vector)
            for v in catalog.variants() if v.op in ("fwd", "fused_add", "quant")}
    for op in ("fwd", "fused_add", "quant"):
        for dtype in ("float32", "float16", "bfloat16"):
            for path in ("multirow", "row", "looped"):
                for vector in (True, False):
                    assert (op, dtype, path, vector) in seen, (op, dtype, path, vector)


@pytest.mark.parametrize("shifted,ld_v4,failing", [
    (True, 2, False), (True, 0, True), (False, 0, False)])
def test_sm90_gate_wants_aligned_span_loads_in_scalar_rows(shifted, ld_v4, failing):
    """The sm_90 gate fails a scalar kernel whose rows move their inner spans as aligned 128-bit
    blocks (kernels/_config.scalar_shifted) when its PTX has no ``ld.global.v4``."""
    from rmsnorm_hip import aot
    record = dict(op="bwd", label="bwd:test", local_depot=False, vector=False,
                  ld_global_v4=ld_v4, st_global_v4=0, spill_store_bytes=0, spill_load_bytes=0,
                  shifted_spans=shifted)
    found = [p for p in aot.problems(record, "cuda") if p.startswith("scalar row")]
    assert bool(found) == failing, found


@pytest.mark.parametrize("stream_loads,cs_loads,failing", [
    (True, 4, False), (False, 0, False), (True, 0, True), (False, 4, True)])
def test_sm90_gate_puts_evict_first_loads_where_chosen(stream_loads, cs_loads, failing):
    """The sm_90 gate (aot.problems) fails a backward kernel chosen for evict-first loads
    (BwdSpec.stream_loads) whose PTX has no ``ld.global.cs``, and any other kernel that has one."""
    from rmsnorm_hip import aot
    record = dict(op="bwd", label="bwd:test", local_depot=False, vector=True, ld_global_v4=4,
                  st_global_v4=2, spill_store_bytes=0, spill_load_bytes=0,
                  stream_loads=stream_loads, ld_global_cs=cs_loads)
    found = [p for p in aot.problems(record, "cuda") if p.startswith("evict-first")]
    assert bool(found) == failing, found


@pytest.mark.parametrize("streamed,div64,failing", [
    (True, 0, False), (True, 1, True), (False, 1, False)])
def test_sm90_gate_keeps_64bit_divisions_out_of_streamed_rows(streamed, div64, failing):
    """The sm_90 gate fails a streamed forward kernel (FwdSpec.stream) whose PTX divides in 64
    bits: its programs walk rows without a trip count (kernels/rmsnorm_fwd stream_rows)."""
    from rmsnorm_hip import aot
    record = dict(op="fwd", label="fwd:test", local_depot=False, vector=True, ld_global_v4=3,
                  st_global_v4=3, spill_store_bytes=0, spill_load_bytes=0, streamed=streamed,
                  div64=div64)
    found = [p for p in aot.problems(record, "cuda") if p.startswith("streamed forward")]
    assert bool(found) == failing, found


@pytest.mark.parametrize("op,sqrt_rn,failing", [
    ("fwd", 0, False), ("fwd", 1, True), ("gated_bwd", 1, True), ("bwd", 1, False)])
def test_sm90_gate_wants_rstd_from_rsqrt(op, sqrt_rn, failing):
    """The sm_90 gate fails a row kernel whose PTX takes an IEEE square root (rstd is
    intrinsics.rsqrt's); rms_norm_backward's recomputed rstd keeps it."""
    from rmsnorm_hip import aot
    record = dict(op=op, label=f"{op}:test", local_depot=False, vector=False, ld_global_v4=0,
                  st_global_v4=0, spill_store_bytes=0, spill_load_bytes=0, sqrt_rn=sqrt_rn)
    found = [p for p in aot.problems(record, "cuda") if "square root" in p]
    assert bool(found) == failing, found


@pytest.mark.parametrize("atomic,vector,red,red_v4,failing", [
    (True, True, 4, 4, False), (False, True, 0, 0, False), (True, True, 0, 0, True),
    (True, True, 8, 0, True), (False, True, 2, 2, True), (True, False, 8, 0, False)])
def test_sm90_gate_puts_dweight_atomics_where_chosen(atomic, vector, red, red_v4, failing):
    """The sm_90 gate fails an atomic-dweight kernel (BwdSpec.atomic_dweight) with no
    ``red.global.add`` (or, on the vector path, no ``.v4.f32`` form), and a deterministic kernel
    with one."""
    from rmsnorm_hip import aot
    record = dict(op="bwd", label="bwd:test", local_depot=False, vector=vector, ld_global_v4=4,
                  st_global_v4=2, spill_store_bytes=0, spill_load_bytes=0,
                  atomic_dweight=atomic, red_global_add=red, red_global_add_v4=red_v4)
    found = [p for p in aot.problems(record, "cuda") if p.startswith("dweight atomics")]
    assert bool(found) == failing, found


def _amd_record(arch, **fields):
    """An AMD kernel record that passes every gate but the ones ``fields`` set up."""
    from rmsnorm_hip import aot
    return dict(dict(op="quant", label="quant:test", arch=arch, scratch_bytes=0, vgpr_spill=0,
                     sgpr_spill=0, dynamic_stack=False, global_loads=4, vgpr=32,
                     elf_machine=aot._EM_AMDGPU, elf_mach=aot._AMDGPU_MACH[arch]), **fields)


@pytest.mark.parametrize("arch,scaling,quant,scaled,mx,failing", [
    ("gfx942", "mx", "mxfp4_e2m1", 0, 0, False), ("gfx942", "mx", "mxfp4_e2m1", 4, 4, True),
    ("gfx942", "group", "float8_e4m3fn", 2, 0, True),
    ("gfx950", "mx", "mxfp4_e2m1", 4, 4, False), ("gfx950", "mx", "mxfp8_e4m3", 0, 0, True),
    ("gfx950", "mx", "mxfp8_e4m3", 4, 0, True), ("gfx950", "group", "float8_e4m3fn", 0, 0, False)])
def test_amd_gate_keeps_scaled_converts_on_gfx950(arch, scaling, quant, scaled, mx, failing):
    """The AMD gate fails gfx950's v_cvt_scalef32_* in any other arch's kernel (LLVM emits them
    for gfx942 without an error) and a gfx950 MX kernel without its element conversion."""
    from rmsnorm_hip import aot
    record = _amd_record(arch, scaling=scaling, quant=quant, scaled_converts=scaled,
                         mx_converts=mx)
    found = [p for p in aot.problems(record, "hip") if "scalef32" in p]
    assert bool(found) == failing, found


@pytest.mark.parametrize("vgpr,agpr,waves", [
    (20, 0, 8), (64, 0, 8), (65, 0, 7), (72, 0, 7), (126, 0, 4), (128, 0, 4), (129, 0, 3),
    (256, 0, 2), (30, 40, 7), (62, 66, 3)])
def test_amd_occupancy_from_registers(vgpr, agpr, waves):
    """Waves per SIMD from a kernel's registers: what LLVM's listing printed as ``Occupancy``
    for all 1646 catalog kernels when the report read it from there."""
    from rmsnorm_hip import aot
    assert aot.waves_per_simd(vgpr, agpr) == waves


def test_gfx950_intrinsics_compile_for_gfx950_alone():
    """A namespace with the hardware MX conversions is refused for any other arch before
    anything compiles (its code objects would hold gfx950-only instructions)."""
    from types import SimpleNamespace

    from rmsnorm_hip.backends.hip import variant_code_objects
    gfx950 = SimpleNamespace(name="hip", features=frozenset({"gpu", "mx_hw_convert"}))
    for archs in (("gfx942",), ("gfx950", "gfx942")):
        with pytest.raises(ValueError, match="cannot compile"):
            variant_code_objects(None, None, (), archs, gfx950)


_ATOMICS_PTX = """
import re
from numba import types
from rmsnorm_hip import intrinsics
from rmsnorm_hip.backends.cuda import compile_ptx
intr = intrinsics.load("cuda")
gpu, red, red4 = intr.gpu, intr.atomic_add_f32, intr.atomic_add_f32x4
def add(ws, a):
    i = gpu.threadIdx.x
    red(ws, i, a)
    red4(ws, i * 4, a, a, a, a)
f32 = types.CPointer(types.float32)
ptx, _ = compile_ptx(add, (f32, types.float32), (9, 0))
print(len(re.findall(r"\\bred\\.global\\.add\\.f32\\b", ptx)),
      len(re.findall(r"\\bred\\.global\\.add\\.v4\\.f32\\b", ptx)),
      len(re.findall(r"\\batom\\.", ptx)))
"""


def test_cuda_float_atomics_are_ptx_reductions():
    """intrinsics atomic_add_f32 / atomic_add_f32x4 on CUDA: one ``red.global.add.f32`` and one
    ``red.global.add.v4.f32`` (NVVM refuses LLVM's ``atomicrmw fadd``, which the other backends
    use); no returning ``atom``."""
    pytest.importorskip("numba.cuda")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONPATH=str(SRC))
    done = subprocess.run([sys.executable, "-c", _ATOMICS_PTX], env=env, capture_output=True,
                          text=True, timeout=600)
    if "libnvvm" in done.stderr and done.returncode:
        pytest.skip("numba-cuda's NVVM is not installed")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["1", "1", "0"], done.stdout


def test_sim_float_atomics_add():
    """The simulator's atomic_add_f32 / atomic_add_f32x4 add into their elements only."""
    sim = intrinsics.load("sim")
    ws = np.zeros(8, np.float32)
    sim.atomic_add_f32(ws, 1, np.float32(0.5))
    sim.atomic_add_f32x4(ws, 4, np.float32(1), np.float32(2), np.float32(3), np.float32(4))
    sim.atomic_add_f32x4(ws, 4, np.float32(1), np.float32(1), np.float32(1), np.float32(1))
    assert ws.tolist() == [0, 0.5, 0, 0, 2, 3, 4, 5]
