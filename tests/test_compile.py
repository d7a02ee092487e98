"""Ahead-of-time compilation of every forward kernel variant to sm_90 PTX, no GPU needed.

The pytest process runs numba.cuda as the simulator (tests/conftest.py), so the compilation runs
in a subprocess with NUMBA_ENABLE_CUDASIM=0: this file run as a script (``python
tests/test_compile.py DTYPE FLAVOR``) compiles the variants of one dtype and path flavor
(tests/_paths.py) and prints one JSON line per variant.  Checked per variant: it compiles;
vector variants use 128-bit global loads and stores (``ld.global.v4`` / ``st.global.v4``);
scalar variants, which run on any alignment, issue no vector global access; nothing uses local
memory (``__local_depot``: spills or a stack array).
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

CC = (9, 0)
DTYPES = ("float32", "float16", "bfloat16")
TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"

# flavor of tests/_paths.py -> also compile a ragged N.  The multi-row path with one thread, one
# warp and several warps per row, the cached single-row path and the looped one.
COMPILE_FLAVORS = {"multirow_1thread": False, "multirow_warp": True, "multirow_warps": False,
                   "row": False, "looped": True}


def fwd_variants(dtype, flavors=tuple(COMPILE_FLAVORS)):
    """Every forward kernel variant for ``dtype``: (flavor, N, weight dtype, vector, store_rstd).
    Per flavor an N that allows vector access (N a whole number of 16-byte chunks: vector and
    scalar variants) and, for some, a ragged one (scalar only).  These are the flags the
    dispatcher picks among (backends/_gpu.py); `rmsnorm-hip compile` may take this over."""
    from _paths import pick_n
    weights = ["", dtype] + (["float32"] if dtype != "float32" else [])
    out = []
    for flavor in flavors:
        ns = [(pick_n(flavor, dtype, True), True)]
        if COMPILE_FLAVORS[flavor]:
            ns.append((pick_n(flavor, dtype, False), False))
        for n, vector_ok in ns:
            for weight in weights:
                for vector in ((True, False) if vector_ok else (False,)):
                    for store_rstd in (True, False):
                        out.append((flavor, n, weight, vector, store_rstd))
    return out


def label(variant):
    flavor, n, weight, vector, store_rstd = variant
    return (f"{flavor}:N={n}:w={weight or 'none'}:{'vec' if vector else 'scalar'}"
            f":rstd={int(store_rstd)}")


def compile_variants(dtype, flavor):
    """Subprocess side: compile the variants of one dtype and flavor, one JSON line each (or one
    skip line)."""
    try:
        from numba.cuda.cudadrv import nvvm
        nvvm.NVVM()
    except Exception as exc:  # no libNVVM: nothing to compile with
        print(json.dumps({"skip": f"numba-cuda's NVVM is not available: {exc}"}))
        return
    from rmsnorm_hip import intrinsics
    from rmsnorm_hip.backends.cuda import compile_ptx
    from rmsnorm_hip.kernels import _config, rmsnorm_fwd
    intr = intrinsics.load("cuda")
    for variant in fwd_variants(dtype, (flavor,)):
        _, n, weight, vector, store_rstd = variant
        spec = _config.fwd_spec(n, dtype, weight, vector, store_rstd)
        record = {"label": label(variant), "vector": vector}
        try:
            ptx, entry = compile_ptx(rmsnorm_fwd.make_rmsnorm_fwd(intr, spec),
                                     rmsnorm_fwd.argtypes(spec), CC)
        except Exception as exc:
            record["error"] = f"{type(exc).__name__}: {exc}"
        else:
            record.update(
                entry=entry,
                target=(re.search(r"\.target\s+(\w+)", ptx) or [None, None])[1],
                ld_v4=bool(re.search(r"\bld\.global(\.\w+)*\.v4\.", ptx)),
                st_v4=bool(re.search(r"\bst\.global(\.\w+)*\.v4\.", ptx)),
                global_vector=sorted(set(re.findall(r"\b(?:ld|st)\.global(?:\.\w+)*\.v\d\.\w+",
                                                    ptx))),
                local_depot="__local_depot" in ptx)
        print(json.dumps(record), flush=True)


@pytest.mark.compile
@pytest.mark.parametrize("flavor", list(COMPILE_FLAVORS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_compile_every_fwd_variant(dtype, flavor):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), str(TESTS),
                                                         os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, __file__, dtype, flavor], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if records and "skip" in records[0]:
        pytest.skip(records[0]["skip"])

    expected = [label(v) for v in fwd_variants(dtype, (flavor,))]
    assert [r["label"] for r in records] == expected, proc.stderr[-4000:]
    failures = []
    for r in records:
        problems = []
        if "error" in r:
            problems.append(r["error"])
        else:
            if r["target"] != f"sm_{CC[0]}{CC[1]}":
                problems.append(f"target {r['target']}")
            if r["vector"] and not (r["ld_v4"] and r["st_v4"]):
                problems.append(f"vector variant without 128-bit global load/store "
                                f"(found {r['global_vector']})")
            if not r["vector"] and r["global_vector"]:
                problems.append(f"scalar variant issues vector global accesses "
                                f"{r['global_vector']}")
            if r["local_depot"]:
                problems.append("uses local memory (__local_depot)")
        if problems:
            failures.append(f"{dtype} {r['label']}: {'; '.join(problems)}")
    assert not failures, "\n".join(failures)


if __name__ == "__main__":
    compile_variants(*sys.argv[1:3])


def test_catalog_backward_compiles_to_sm90(tmp_path):
    """Every backward variant of kernels/catalog.py through `rmsnorm-hip compile --target cuda`
    (its gates: compiles, 128-bit accesses on the vector path, no local memory, no spills)."""
    pytest.importorskip("numba.cuda")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONPATH=str(SRC))
    report = tmp_path / "sm90.json"
    done = subprocess.run([sys.executable, "-m", "rmsnorm_hip", "compile", "--target", "cuda",
                           "--arch", "sm_90", "--only", "bwd", "--report", str(report)],
                          env=env, capture_output=True, text=True, timeout=1200)
    if "libnvvm" in done.stderr and done.returncode:
        pytest.skip("numba-cuda's NVVM is not installed")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    kernels = json.loads(report.read_text())["reports"][0]["kernels"]
    assert len(kernels) >= 100 and all(k["op"].startswith("bwd") for k in kernels)
