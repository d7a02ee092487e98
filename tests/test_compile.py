"""Ahead-of-time compilation of every kernel variant the dispatcher can launch
(``kernels/catalog.variants()``, the set ``rmsnorm-hip compile`` builds for AMD) to sm_90 PTX, no
GPU needed.

The pytest process runs numba.cuda as the simulator (tests/conftest.py), so the compilation runs
in a subprocess with NUMBA_ENABLE_CUDASIM=0: this file run as a script (``python
tests/test_compile.py OP DTYPE``) compiles the catalog's variants of one op and dtype and prints
one JSON line per variant.  Checked per variant: it compiles; vector variants use 128-bit global
loads (``ld.global.v4``), 128-bit stores (``st.global.v4``) where they store rows of x's width,
and no byte-by-byte stores (a quantised row's chunk goes out as one 64- / 32-bit store); scalar
variants, which run on any alignment, reach their vector accesses only through addresses rounded
down to 16 bytes or checked at run time (kernels/_rowops.ChunkIO: tests/test_chunk_io.py checks
every alignment, and the simulator's aligned accesses check their addresses), so their 128-bit
loads are counted, not refused; nothing uses local memory (``__local_depot``: spills or a stack
array).
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rmsnorm_hip import intrinsics

CC = (9, 0)
TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"


def shard_of(variant):
    return variant.op, getattr(variant.spec, "dtype", "")


def catalog_variants(shard=None):
    """The catalog's forward variants (plain, fused add, quantised) of ``shard`` (op, dtype).
    The backward's are left to test_catalog_backward_compiles_to_sm90, which compiles every one
    of them once, through ptxas, with the stricter gates of ``rmsnorm-hip compile`` (the same
    checks as here plus registers, spills, atomics and evict-first loads where chosen): compiling
    them here as well cost CI about 25 CPU minutes for nothing new."""
    from rmsnorm_hip.kernels import catalog
    return [v for v in catalog.variants() if (shard is None or shard_of(v) == tuple(shard))
            and not v.op.startswith("bwd")]


def shards():
    return sorted({shard_of(v) for v in catalog_variants()})


def compile_variants(op, dtype):
    """Subprocess side: compile the variants of one shard, one JSON line each (or one skip
    line)."""
    try:
        from numba.cuda.cudadrv import nvvm
        nvvm.NVVM()
    except Exception as exc:  # no libNVVM: nothing to compile with
        print(json.dumps({"skip": f"numba-cuda's NVVM is not available: {exc}"}))
        return
    from rmsnorm_hip import aot, intrinsics
    from rmsnorm_hip.backends.cuda import compile_ptx
    intr = intrinsics.load("cuda")
    for variant in catalog_variants((op, dtype)):
        vector = bool(getattr(variant.spec, "vector", False))
        record = {"label": variant.label, "vector": vector,
                  "full_width_store": variant.full_width_store,
                  # a scalar row with spans inside it loads them as aligned 128-bit blocks
                  "shifted_spans": aot.shifted_spans(variant.spec)}
        try:
            ptx, entry = compile_ptx(variant.builder(intr, variant.spec), variant.argtypes, CC)
        except Exception as exc:
            record["error"] = f"{type(exc).__name__}: {exc}"
        else:
            record.update(
                entry=entry,
                target=(re.search(r"\.target\s+(\w+)", ptx) or [None, None])[1],
                ld_v4=bool(re.search(r"\bld\.global(\.\w+)*\.v4\.", ptx)),
                st_v4=bool(re.search(r"\bst\.global(\.\w+)*\.v4\.", ptx)),
                st_byte=bool(re.search(r"\bst\.global(\.\w+)*\.[usb]8\b", ptx)),
                global_vector=sorted(set(re.findall(r"\b(?:ld|st)\.global(?:\.\w+)*\.v\d\.\w+",
                                                    ptx))),
                local_depot="__local_depot" in ptx)
        print(json.dumps(record), flush=True)


@pytest.mark.compile
@pytest.mark.parametrize("op,dtype", shards(), ids=lambda v: str(v))
def test_compile_every_variant(op, dtype):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), str(TESTS),
                                                         os.environ.get("PYTHONPATH")])))
    # a 16-bit forward shard (90 variants) takes a few minutes on CI's 2 cores
    proc = subprocess.run([sys.executable, __file__, op, dtype], env=env, capture_output=True,
                          text=True, timeout=2400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if records and "skip" in records[0]:
        pytest.skip(records[0]["skip"])

    expected = [v.label for v in catalog_variants((op, dtype))]
    assert expected, f"no catalog variant for {op} {dtype}"
    assert [r["label"] for r in records] == expected, proc.stderr[-4000:]
    failures = []
    for r in records:
        problems = []
        if "error" in r:
            problems.append(r["error"])
        else:
            if r["target"] != f"sm_{CC[0]}{CC[1]}":
                problems.append(f"target {r['target']}")
            if r["vector"] and not (r["ld_v4"] and (r["st_v4"] or not r["full_width_store"])):
                problems.append(f"vector variant without 128-bit global load/store "
                                f"(found {r['global_vector']})")
            if r["shifted_spans"] and not r["ld_v4"]:
                problems.append("scalar variant without the aligned 128-bit loads of the spans "
                                "inside its rows")
            if r["vector"] and r["st_byte"]:
                problems.append("vector variant stores bytes one by one")
            if r["local_depot"]:
                problems.append("uses local memory (__local_depot)")
        if problems:
            failures.append(f"{r['label']}: {'; '.join(problems)}")
    assert not failures, "\n".join(failures)


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


if __name__ == "__main__":
    compile_variants(*sys.argv[1:3])


@pytest.mark.compile
def test_catalog_backward_compiles_to_sm90(tmp_path):
    """Every backward variant of kernels/catalog.py (the deterministic and atomic-dweight forms
    and the partial-row reductions) through `rmsnorm-hip compile --target cuda`: its gates
    (aot.problems) are test_compile_every_variant's and registers, spills, named barriers,
    evict-first loads and dweight atomics where chosen."""
    pytest.importorskip("numba.cuda")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONPATH=str(SRC))
    report = tmp_path / "sm90.json"
    done = subprocess.run([sys.executable, "-m", "rmsnorm_hip", "compile", "--target", "cuda",
                           "--arch", "sm_90", "--only", "bwd", "--report", str(report)],
                          env=env, capture_output=True, text=True, timeout=2400)
    if "libnvvm" in done.stderr and done.returncode:
        pytest.skip("numba-cuda's NVVM is not installed")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    from rmsnorm_hip.kernels import catalog
    kernels = json.loads(report.read_text())["reports"][0]["kernels"]
    expected = sorted(v.label for v in catalog.variants("cuda") if v.op.startswith("bwd"))
    assert sorted(k["label"] for k in kernels) == expected
    assert sum(k.get("atomic_dweight", False) for k in kernels) > 0


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
