"""Ahead-of-time compilation of every kernel variant the dispatcher can launch, with no GPU, and a
resource report per kernel (``rmsnorm-hip compile``).

AMD (``--target hip``, numba-hip): each variant of :func:`rmsnorm_hip.kernels.catalog.variants`
becomes a real HSA code object for each ``--arch`` (gfx942, gfx950, ...).  Per kernel the report
records VGPR / AGPR / SGPR counts, VGPR and SGPR spills, scratch (private segment) and LDS bytes
and the kernarg size from the code object's ``amdhsa`` metadata; occupancy (waves per SIMD, from
the registers) and the kernel's code size; and how many ``global_load_dwordx4`` /
``global_store_dwordx4`` its disassembly has.

NVIDIA (``--target cuda``, numba-cuda): PTX for ``sm_90`` (or any ``sm_XY``), with the counts of
``ld.global.v4`` / ``st.global.v4`` and whether a local-memory depot exists, and registers and
spills from ptxas (``_ptxas_resources``) where it is installed.

Gates (``--no-check`` turns all but the first off); each failing kernel counts once:

- the kernel did not compile;
- scratch bytes, VGPR or SGPR spills (AMD) / a local depot, or ptxas spills beyond
  ``SM90_SPILL_ALLOWANCE`` (NVIDIA: none, but for the kernels it lists with their reason);
- a vector-path kernel without 128-bit global loads and stores (a quantised forward without
  residual stores 8-bit q only: 64- / 32-bit stores, so 128-bit loads are what it must have), or
  storing bytes one by one;
- a main kernel (vector path, one cached row per block: what LLM-sized rows run) over 64 VGPRs
  (AMD; 8 waves per SIMD need <= 64);
- gfx950's scaled conversions (``v_cvt_scalef32_*``) in another arch's kernel, where they are
  illegal (LLVM emits them for gfx942 without an error), and a gfx950 MX kernel whose elements
  do not take ``v_cvt_scalef32_pk_fp4_f32`` / ``_fp8_f32`` (AMD; MX kernels are compiled once
  per arch with that arch's intrinsics, every other kernel once for all arches);
- any kernel whose VGPRs keep its block from being resident on one CU (AMD: a block of W
  wavefronts puts ceil(W / 4) on each SIMD, which share 512 VGPRs per lane: 1024 threads need
  <= 128).  Looped rows (N past the cached layouts, e.g. > 32768 bf16) are held to this one:
  LLVM unrolls their re-read passes and keeps more loads in flight, at 4-7 waves per SIMD.

Run as ``python -m rmsnorm_hip.aot --arch gfx942 --arch gfx950 --report out/amd-isa-{arch}.json``
(``{arch}`` in the path gives one file per arch); ``main(argv)`` is what ``rmsnorm-hip compile``
calls.  The AMD target needs numba-hip 0.2.1 and a ROCm 7.x COMGR (``.ci/rocm-compile.sh`` builds a
compile-only environment for that on a machine without ROCm); the NVIDIA target needs numba-cuda.
"""
import glob
import importlib.metadata
import importlib.util
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

from ._argparse import Parser

MAIN_KERNEL_MAX_VGPRS = 64
SM_REGISTERS = 65536   # what one sm_90 block may hold (beyond: CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES)
# sm_90 kernels whose ptxas spills are known and measured against the alternatives: the bytes
# stored each may spill at most (ptxas 13.0).  Every other kernel must spill none.
#   float32 N = 16384 backward rows (1024 threads x 4 chunks: x, dy, the weight and the dweight
#   partial are 64 floats a thread, in a block held to 64 registers); looped instead they
#   re-read x and dy and took 520 us against 359 at 4096x16384 with dresidual on the H200
#   (docs/performance.md).
#   16-bit N = 16384 unaligned (scalar) rows with rstd recomputed and dresidual: 96 B (168 before
#   they kept x and dy as words); the unaligned fallback of a 16-bit-weight call.
#   16-bit looped head rows (two row strides, N > 16384: longer than any attention head) with
#   rstd recomputed and dresidual: 16 B, the row's (outer, inner) pair beside what the one-stride
#   kernel holds (60 registers there); recomputing the division in pass 2 spilled the same.
#   Not measured on a GPU.
SM90_SPILL_ALLOWANCE = {
    f"bwd:{dtype}:w={dtype}:N=65536:looped:vec:recompute=1:dres=1:heads": 16
    for dtype in ("float16", "bfloat16")} | {
    f"bwd:{dtype}:w={dtype}:N=16384:row:{form}:recompute={rec}:dres={dres}{sink}": spilled
    for sink in ("", ":direct")     # a one-row call's kernel (direct dweight) spills the same
    for (dtype, form, rec, dres), spilled in {
        ("float32", "vec", 0, 0): 124, ("float32", "vec", 0, 1): 152,
        ("float32", "vec", 1, 0): 136, ("float32", "vec", 1, 1): 136,
        ("float32", "scalar", 0, 0): 240, ("float32", "scalar", 0, 1): 144,
        ("float32", "scalar", 1, 0): 224, ("float32", "scalar", 1, 1): 96,
        ("bfloat16", "scalar", 1, 1): 96, ("float16", "scalar", 1, 1): 96}.items()}
FORWARD_OPS = ("fwd", "fused_add", "quant")
AMD_ARCHS = ("gfx942", "gfx950")
CUDA_ARCHS = ("sm_90",)
_EM_AMDGPU = 224
_AMDGPU_MACH = {"gfx942": 0x4C, "gfx950": 0x4F}   # EF_AMDGPU_MACH_AMDGCN_* (ELF e_flags & 0xff)
# the instruction each MX element type converts with where the hardware has it (MX_HW_ARCHS)
_MX_CONVERT = {"mxfp4_e2m1": "v_cvt_scalef32_pk_fp4_f32", "mxfp8_e4m3": "v_cvt_scalef32_pk_fp8_f32"}


# ---- one kernel ------------------------------------------------------------------------------
def _describe(variant):
    """What a record says about the variant itself (the spec fields kernels commonly have)."""
    spec = variant.spec
    layout = getattr(spec, "layout", None)
    record = dict(label=variant.label, op=variant.op)
    for key, owner, attr in (("dtype", spec, "dtype"), ("weight", spec, "weight"),
                             ("n", layout, "n"), ("threads", layout, "threads"),
                             ("rows_per_block", spec, "rows"),
                             ("chunks_per_thread", layout, "chunks_per_thread"),
                             ("cached", layout, "cached"), ("vector", spec, "vector"),
                             ("store_rstd", spec, "store_rstd"), ("residual", spec, "residual"),
                             ("quant", spec, "quant"), ("xscale", spec, "xscale"),
                             ("scaling", spec, "scaling"), ("group", spec, "group")):
        if owner is not None and hasattr(owner, attr):
            record[key] = getattr(owner, attr)
    for key in ("weight", "quant", "xscale", "scaling"):
        if record.get(key) == "":
            record[key] = None
    record["full_width_store"] = getattr(variant, "full_width_store", True)
    return record


def is_main_kernel(record):
    """A forward (plain, fused add or quantised) on the vector path with one cached row per
    block: what LLM-sized rows run (the 64-VGPR gate; the backward keeps x, dy, weight and its
    dweight share live and is reported as is)."""
    return (record.get("op") in FORWARD_OPS and bool(record.get("vector"))
            and record.get("rows_per_block") == 1 and record.get("cached", True))


def block_vgpr_limit(record, wavefront=64):
    """The most VGPRs with which one block of the record's kernel fits on a CU (4 SIMDs of 512
    VGPRs per lane), or None when the record does not say its block size."""
    threads, rows = record.get("threads"), record.get("rows_per_block")
    if not threads or not rows:
        return None
    waves = -(-threads * rows // wavefront)
    return 512 // -(-waves // 4)


def waves_per_simd(vgpr, agpr=0):
    """The wavefronts one SIMD of gfx942 / gfx950 holds with these registers: 512 per lane,
    allocated 8 at a time, AGPRs after the VGPRs (4-aligned), at most 8 waves (LLVM's
    ``Occupancy``: equal for every kernel of the catalog, none of which is LDS-bound)."""
    total = (-(-vgpr // 4) * 4 + agpr) if agpr else vgpr
    return min(8, 512 // max(8, -(-total // 8) * 8))


def _elf_mach(code_object):
    """(e_machine, e_flags & 0xff) of an ELF64 code object."""
    if code_object[:4] != b"\x7fELF":
        return None, None
    return (int.from_bytes(code_object[18:20], "little"),
            int.from_bytes(code_object[48:52], "little") & 0xFF)


def amd_records(variant, archs, intr, keep_dir=None):
    """{arch: record} of one variant compiled for every AMD arch: one numba compile, or for an
    MX kernel one per arch with that arch's intrinsics (gfx950 converts MX elements in
    hardware)."""
    from rocm import comgr

    from .backends.hip import intrinsics_for, is_mx, variant_code_objects

    def compile_for(archs, intr):
        return variant_code_objects(variant.builder, variant.spec, variant.argtypes, archs, intr)

    if is_mx(variant.spec):
        compiled = {arch: compile_for((arch,), intrinsics_for(variant.spec, arch))[arch]
                    for arch in archs}
    else:
        compiled = compile_for(archs, intr)
    records = {}
    for arch, (code_object, isa, metadata) in compiled.items():
        kernel = metadata["amdhsa.kernels"][0]

        def num(key, kernel=kernel):
            return int(kernel[key]) if key in kernel else None

        def count(pattern, isa=isa):
            return len(re.findall(rf"^\s*{pattern}\b", isa, re.MULTILINE))

        machine, mach = _elf_mach(code_object)
        records[arch] = record = _describe(variant)
        mx_convert = _MX_CONVERT.get(record.get("quant"))
        record.update(
            arch=arch, target=metadata.get("amdhsa.target"), elf_machine=machine, elf_mach=mach,
            vgpr=num(".vgpr_count"), agpr=num(".agpr_count"), sgpr=num(".sgpr_count"),
            vgpr_spill=num(".vgpr_spill_count"), sgpr_spill=num(".sgpr_spill_count"),
            scratch_bytes=num(".private_segment_fixed_size"),
            lds_bytes=num(".group_segment_fixed_size"),
            dynamic_stack=bool(num(".uses_dynamic_stack")),
            kernarg_bytes=num(".kernarg_segment_size"),
            wavefront=num(".wavefront_size"),
            occupancy=waves_per_simd(num(".vgpr_count"), num(".agpr_count") or 0),
            code_bytes=comgr.parse_code_symbols(code_object, len(code_object))[kernel[".name"]]
            ["size"],
            code_object_bytes=len(code_object),
            global_load_dwordx4=count("global_load_dwordx4"),
            global_loads=count("(?:global|buffer|flat)_load\\w*"),
            global_store_dwordx4=count("global_store_dwordx4"),
            global_store_byte=count("global_store_byte"),
            global_atomic_cmpswap=count("global_atomic_cmpswap\\w*"),
            # gfx950's scaled conversions: all, and the one an MX kernel's elements take
            scaled_converts=count("v_cvt_scalef32\\w*"),
            mx_converts=count(mx_convert) if mx_convert else 0,
        )
        if keep_dir:
            stem = os.path.join(keep_dir, f"{arch}-{_file_stem(variant.label)}")
            with open(stem + ".co", "wb") as f:
                f.write(code_object)
            with open(stem + ".s", "w") as f:
                f.write(isa)
    return records


def shifted_spans(spec):
    """Whether a scalar kernel of ``spec`` loads the 16-byte spans inside its rows as aligned
    128-bit blocks (kernels/_config.scalar_shifted: rows of three chunks or more)."""
    from .kernels import _config
    layout = getattr(spec, "layout", None)
    return bool(not getattr(spec, "vector", False) and layout is not None
                and layout.n >= 3 * layout.chunk and _config.scalar_shifted(spec))


def cuda_records(variant, archs, intr, keep_dir=None):
    """{arch: record} of one variant compiled to PTX for every ``sm_XY`` in ``archs``."""
    from .backends.cuda import variant_ptx

    records = {}
    for arch in archs:
        ptx, _ = variant_ptx(variant.builder, variant.spec, variant.argtypes, _cuda_cc(arch), intr)
        records[arch] = record = _describe(variant)
        record.update(
            arch=arch,
            ptx_bytes=len(ptx),
            ld_global_v4=len(re.findall(r"\bld\.global(?:\.\w+)*\.v4\.", ptx)),
            st_global_v4=len(re.findall(r"\bst\.global(?:\.\w+)*\.v4\.", ptx)),
            st_global_byte=len(re.findall(r"\bst\.global(?:\.\w+)*\.[usb]8\b", ptx)),
            ld_shared_f32=len(re.findall(r"\bld\.shared\.f32\b", ptx)),
            ld_shared_v4=len(re.findall(r"\bld\.shared\.v4\.f32\b", ptx)),
            local_depot="__local_depot" in ptx,
            # bar.sync with a thread count: a named barrier (``bar.sync 0;`` is syncthreads)
            named_barriers=len(re.findall(r"\bbar\.sync\s+[^;,]+,[^;]+;", ptx)),
            paired=bool(getattr(variant.spec, "paired", False)),
            stream_loads=bool(getattr(variant.spec, "stream_loads", False)),
            streamed=bool(getattr(variant.spec, "stream", False)),
            div64=len(re.findall(r"\b(?:div|rem)\.[su]64\b", ptx)),
            sqrt_rn=len(re.findall(r"\bsqrt\.rn\.f32\b", ptx)),
            ld_global_cs=len(re.findall(r"\bld\.global\.cs\.", ptx)),
            atomic_dweight=bool(getattr(variant.spec, "atomic_dweight", False)),
            shifted_spans=shifted_spans(variant.spec),
            red_global_add=len(re.findall(r"\bred\.global\.add\.", ptx)),
            red_global_add_v4=len(re.findall(r"\bred\.global\.add\.v4\.f32\b", ptx)),
            e2m1_halves=len(re.findall(r"\bfma\.rn\.f16x2\b", ptx)),
            shared_bytes=sum(int(n) for n in re.findall(
                r"\.shared\s+\.align\s+\d+\s+\.b8\s+\w+\[(\d+)\]", ptx)),
        )
        record.update(_ptxas_resources(ptx, arch))
        if keep_dir:
            with open(os.path.join(keep_dir, f"{arch}-{_file_stem(variant.label)}.ptx"), "w") as f:
                f.write(ptx)
    return records


def _ptxas():
    """ptxas of the nvidia-cuda-nvcc wheel (the CUDA release of the NVVM that wrote the PTX;
    ``pip install nvidia-cuda-nvcc``), else the one on PATH."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations if spec else []):
        for candidate in sorted(glob.glob(os.path.join(root, "cu*", "bin", "ptxas"))):
            return candidate
    return shutil.which("ptxas")


def _ptxas_resources(ptx, arch):
    """Registers, spills and stack of the PTX assembled by ptxas for ``arch`` (what the driver's
    JIT does when the kernel is loaded), or {} when no ptxas is installed.  A ptxas older than
    the NVVM that wrote the PTX refuses its ``.version``: the PTX is then assembled as the newest
    version that ptxas takes (``ptx_version_as``), which our kernels' instructions all predate,
    rather than leaving the register and spill gates unchecked."""
    ptxas = _ptxas()
    if ptxas is None:
        return {}
    done, text = _run_ptxas(ptxas, arch, ptx)
    record = {}
    refused = re.search(r"Unsupported \.version \d+\.\d+; current version is '(\d+\.\d+)'", text)
    if done.returncode and refused:
        ptx = re.sub(r"^\.version \d+\.\d+", f".version {refused.group(1)}", ptx, count=1,
                     flags=re.M)
        record["ptx_version_as"] = refused.group(1)
        done, text = _run_ptxas(ptxas, arch, ptx)
    if done.returncode:
        return {"ptxas_error": text.strip()[-500:]}
    number = lambda pattern: int(m.group(1)) if (m := re.search(pattern, text)) else 0  # noqa: E731
    return dict(record, registers=number(r"Used (\d+) registers"),
                stack_frame_bytes=number(r"(\d+) bytes stack frame"),
                spill_store_bytes=number(r"(\d+) bytes spill stores"),
                spill_load_bytes=number(r"(\d+) bytes spill loads"))


def _run_ptxas(ptxas, arch, ptx):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        done = subprocess.run([ptxas, f"-arch={arch}", "-v", "-o", os.devnull, path],
                              capture_output=True, text=True)
    return done, done.stdout + done.stderr


def byte_scales(record):
    """Whether the kernel's scales are bytes (MX's E8M0, one per 32 elements, stored by the
    block's first lane; float32 x's four fp4 elements are two bytes too): its byte stores are
    those, not a vector path's rows stored byte by byte."""
    return record.get("scaling") == "mx"


def _scaled_convert_problems(record):
    """gfx950's v_cvt_scalef32_* in another arch's kernel (LLVM selects them for gfx942 without
    a word, and they are illegal there), or a gfx950 MX kernel converting without them."""
    from .intrinsics import MX_HW_ARCHS
    if record["arch"] not in MX_HW_ARCHS:
        if record.get("scaled_converts"):
            return [f"{record['scaled_converts']} v_cvt_scalef32 (gfx950 only) in a "
                    f"{record['arch']} kernel"]
        return []
    wanted = _MX_CONVERT.get(record.get("quant")) if record.get("scaling") == "mx" else None
    if wanted and not record.get("mx_converts"):
        return [f"MX kernel without {wanted}"]
    return []


def problems(record, target):
    """Why ``record`` fails the gates (empty when it passes)."""
    if record.get("error"):
        return ["compile error"]
    out = []
    if target == "hip":
        if record["scratch_bytes"]:
            out.append(f"scratch {record['scratch_bytes']} B")
        if record["vgpr_spill"] or record["sgpr_spill"]:
            out.append(f"spills vgpr {record['vgpr_spill']} sgpr {record['sgpr_spill']}")
        if record["dynamic_stack"]:
            out.append("dynamic stack")
        if not record.get("global_loads"):
            # every kernel reads its rows: one without a load lost its row loop in code
            # generation (as backward rows of one wavefront did: kernels/_config.BWD_MIN_THREADS)
            out.append("no global loads")
        if record.get("vector") and not (record["global_load_dwordx4"] and (
                record["global_store_dwordx4"] or not record.get("full_width_store", True))):
            out.append("vector path without global_load/store_dwordx4")
        if record.get("vector") and record.get("global_store_byte") and not byte_scales(record):
            out.append("vector path stores bytes one by one")
        if is_main_kernel(record) and record["vgpr"] > MAIN_KERNEL_MAX_VGPRS:
            out.append(f"main kernel {record['vgpr']} VGPRs > {MAIN_KERNEL_MAX_VGPRS}")
        limit = block_vgpr_limit(record, record.get("wavefront") or 64)
        if limit is not None and record["vgpr"] > limit:
            out.append(f"{record['vgpr']} VGPRs > {limit}: the block does not fit on a CU")
        out.extend(_scaled_convert_problems(record))
        expected = _AMDGPU_MACH.get(record["arch"])
        if record["elf_machine"] != _EM_AMDGPU or (expected and record["elf_mach"] != expected):
            out.append(f"not a {record['arch']} code object")
    else:
        if record.get("ptxas_error"):
            out.append("ptxas refused the PTX")
        if record["local_depot"]:
            out.append("local memory depot")
        block = (record.get("threads") or 0) * (record.get("rows_per_block") or 0)
        registers = -(-(record.get("registers") or 0) // 8) * 8     # allocated 8 at a time
        if block and registers * block > SM_REGISTERS:
            out.append(f"{record['registers']} registers x {block} threads > {SM_REGISTERS}: "
                       "the block cannot launch")
        # an atomic-dweight kernel (label suffix ":atomic") is its deterministic twin's row
        allowed = SM90_SPILL_ALLOWANCE.get(record.get("label", "").removesuffix(":atomic"), 0)
        if (record.get("spill_store_bytes") or 0) > allowed or (
                not allowed and record.get("spill_load_bytes")):
            out.append(f"spills {record['spill_store_bytes']} B stored"
                       + (f" (allowed {allowed})" if allowed else ""))
        if record.get("vector") and not (record["ld_global_v4"] and (
                record["st_global_v4"] or not record.get("full_width_store", True))):
            out.append("vector path without ld/st.global.v4")
        if record.get("vector") and record.get("st_global_byte") and not byte_scales(record):
            out.append("vector path stores bytes one by one")
        if record.get("streamed") and record.get("div64"):
            # a streamed program's whole call at decode sizes is one row: a 64-bit division
            # (a subroutine of some 40 dependent instructions) ahead of its loads costs 0.1-0.3 us
            out.append(f"streamed forward with {record['div64']} 64-bit integer divisions")
        if record.get("sqrt_rn") and record["op"] not in ("bwd", "bwd_reduce"):
            # rstd by the IEEE square root and division: two dependent slow-path sequences on
            # every row's critical path, where intrinsics.rsqrt is one instruction
            # (rms_norm_backward keeps them: kernels/rmsnorm_bwd)
            out.append(f"rstd from {record['sqrt_rn']} IEEE square roots, not intrinsics.rsqrt")
        if record.get("shifted_spans") and not record["ld_global_v4"]:
            out.append("scalar row without the aligned 128-bit loads of its spans")
        if record.get("paired") and not record.get("named_barriers"):
            # the rows of a paired block wait for each other at syncthreads: what pairing
            # exists to avoid (kernels/_config.BWD_PAIRED_ROWS)
            out.append("paired rows without named barriers")
        if record.get("stream_loads", False) != bool(record.get("ld_global_cs", 0)):
            # the evict-first loads (intrinsics load_b128_stream) are in the kernels that
            # _config.bwd_stream_rows picks them for, and in no other
            out.append("evict-first loads " + ("missing" if record.get("stream_loads")
                                               else "in a kernel not chosen for them"))
        if record.get("atomic_dweight", False) != bool(record.get("red_global_add", 0)) or (
                record.get("atomic_dweight") and record.get("vector")
                and not record.get("red_global_add_v4")):
            # dweight by atomics (deterministic=False, _config.bwd_atomic_dweight), 4 columns a
            # reduction on the vector path; the deterministic kernels have none
            out.append("dweight atomics " + ("missing" if record.get("atomic_dweight")
                                             else "in a deterministic kernel"))
        if (record.get("quant") == "mxfp4_e2m1" and _cuda_cc(record["arch"]) >= (9, 0)
                and not record.get("e2m1_halves")):
            # MXFP4 rows are issue-bound: e2m1 pairs in 16-bit halves (intrinsics/_llvm.py)
            out.append("MXFP4 kernel without the e2m1 pairs in 16-bit halves")
        # (a neox QK-norm row reads its rotation partners from shared memory, one at a time)
        if (record["op"] != "bwd_reduce" and record.get("ld_shared_f32", 0) >= 4
                and ":rope=neox" not in record.get("label", "")
                and not record.get("ld_shared_v4")):
            # rows of 4 warps or more read their warps' partials 4 at a time
            # (kernels/_rowops.reduce_buffer_shape): the buffer lost its alignment
            out.append("row reduction reads shared memory one float at a time")
    return out


# ---- many kernels ----------------------------------------------------------------------------
def _cuda_cc(arch):
    m = re.fullmatch(r"sm_(\d+)(\d)a?", arch)
    if not m:
        raise ValueError(f"CUDA arch must look like sm_90, got {arch!r}")
    return int(m.group(1)), int(m.group(2))


def _file_stem(label):
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", label)


def _select(only, target):
    from .kernels import catalog
    variants = list(catalog.variants(target))
    if only:
        variants = [v for v in variants if any(s in v.label for s in only)]
    return variants


def _compile_shard(job):
    """Worker: variants ``shard::shards`` for every arch.  Returns [(index, {arch: record})]."""
    target, archs, shard, shards, only, keep_dir, check = job
    from . import intrinsics
    intr = intrinsics.load(target)
    compile_variant = amd_records if target == "hip" else cuda_records
    done = []
    for index, variant in list(enumerate(_select(only, target)))[shard::shards]:
        try:
            records = compile_variant(variant, archs, intr, keep_dir)
        except Exception as e:  # reported per kernel; the run fails at the end
            error = dict(error=f"{type(e).__name__}: {e}",
                         traceback=traceback.format_exc(limit=-8))
            records = {arch: dict(_describe(variant), arch=arch, **error) for arch in archs}
        for record in records.values():
            record["problems"] = problems(record, target) if check or record.get("error") else []
        done.append((index, records))
    return done


def _toolchain(target):
    import platform
    versions = {"python": platform.python_version()}
    from importlib import metadata
    packages = (("numba", "llvmlite", "numba-hip", "rocm-bindings-compiler") if target == "hip"
                else ("numba", "llvmlite", "numba-cuda", "cuda-bindings"))
    for package in packages:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    comgr = os.environ.get("RMSNORM_HIP_COMGR_VERSION")
    if comgr:
        versions["amd-comgr"] = comgr
    return versions


def _summary(records, target):
    ok = [r for r in records if not r.get("error")]
    summary = dict(kernels=len(records), compile_errors=len(records) - len(ok),
                   failing=sum(1 for r in records if r["problems"]))
    if target == "hip" and ok:
        summary.update(
            max_vgpr=max(r["vgpr"] for r in ok),
            max_vgpr_main=max((r["vgpr"] for r in ok if is_main_kernel(r)), default=None),
            max_sgpr=max(r["sgpr"] for r in ok),
            min_occupancy=min(r["occupancy"] or 0 for r in ok),
            scratch_kernels=sum(1 for r in ok if r["scratch_bytes"]),
            spill_kernels=sum(1 for r in ok if r["vgpr_spill"] or r["sgpr_spill"]),
            vector_kernels=sum(1 for r in ok if r.get("vector")),
            vector_kernels_with_dwordx4=sum(1 for r in ok if r.get("vector")
                                            and r["global_load_dwordx4"]
                                            and (r["global_store_dwordx4"]
                                                 or not r.get("full_width_store", True))),
            max_lds_bytes=max(r["lds_bytes"] for r in ok))
    elif ok:
        summary.update(
            local_depot_kernels=sum(1 for r in ok if r["local_depot"]),
            vector_kernels=sum(1 for r in ok if r.get("vector")),
            vector_kernels_with_v4=sum(1 for r in ok if r.get("vector") and r["ld_global_v4"]
                                       and (r["st_global_v4"]
                                            or not r.get("full_width_store", True))))
    return summary


def _report(target, arch, records):
    return {
        "target": target,
        "arch": arch,
        "generated_by": "rmsnorm-hip compile (rmsnorm_hip.aot)",
        "toolchain": _toolchain(target),
        "gates": {"scratch_bytes": 0, "spills": 0, "vector_path_128bit_access": True,
                  **({"main_kernel_max_vgpr": MAIN_KERNEL_MAX_VGPRS} if target == "hip" else {})},
        "summary": _summary(records, target),
        "kernels": records,
    }


def _write(path, data):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=False)
        f.write("\n")


def compile_all(archs, report_path=None, target="hip", *, only=None, jobs=None, keep_dir=None,
                check=True, out=sys.stdout):
    """Compile every catalog variant for every arch in ``archs``; returns the number of failing
    kernel compilations (compile errors, plus gate violations when ``check``).

    ``report_path``: a JSON file; with ``{arch}`` in it, one file per arch, else one file with a
    report per arch.  ``only``: label substrings to select variants.  ``jobs``: worker processes
    (default: the CPU count), each compiling a share of the variants for every arch (AMD: one
    numba compile per variant, one link and code generation per arch).
    ``keep_dir``: also write each code object and its disassembly (or PTX) there.
    """
    if target not in ("hip", "cuda"):
        raise ValueError(f"target must be 'hip' or 'cuda', got {target!r}")
    archs = list(dict.fromkeys(archs or (AMD_ARCHS if target == "hip" else CUDA_ARCHS)))
    if target == "cuda":
        for arch in archs:
            _cuda_cc(arch)
    if keep_dir:
        os.makedirs(keep_dir, exist_ok=True)
    jobs = max(1, jobs or os.cpu_count() or 1)
    work = [(target, archs, shard, jobs, tuple(only or ()), keep_dir, check)
            for shard in range(jobs)]
    start = time.perf_counter()
    if jobs == 1:
        done = _compile_shard(work[0])
    else:
        # spawn: a fresh interpreter per worker (numba / LLVM state is not fork-safe)
        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            done = [item for shard in pool.map(_compile_shard, work, chunksize=1)
                    for item in shard]
    done.sort(key=lambda item: item[0])
    results = {arch: [records[arch] for _, records in done] for arch in archs}
    elapsed = time.perf_counter() - start
    reports = {arch: _report(target, arch, results[arch]) for arch in archs}
    if report_path:
        if "{arch}" in report_path:
            for arch, report in reports.items():
                _write(report_path.format(arch=arch), report)
        else:
            _write(report_path, {"reports": list(reports.values())})
    print_table(reports, target, out)
    failing = sum(report["summary"]["failing"] for report in reports.values())
    print(f"{sum(len(r['kernels']) for r in reports.values())} kernel compilations for "
          f"{', '.join(archs)} in {elapsed:.0f} s: {failing} failing", file=out)
    return failing


def print_table(reports, target, out=sys.stdout):
    """One line per kernel, one column group per arch; failures spelled out below."""
    archs = list(reports)
    first = reports[archs[0]]["kernels"]
    if target == "hip":
        head = "vgpr sgpr agpr occ  lds scr spill ld4/st4"
        def cell(r):
            return (f"{r['vgpr']:>4} {r['sgpr']:>4} {r['agpr']:>4} {r['occupancy'] or 0:>3} "
                    f"{r['lds_bytes']:>4} {r['scratch_bytes']:>3} "
                    f"{r['vgpr_spill'] + r['sgpr_spill']:>5} "
                    f"{r['global_load_dwordx4']:>3}/{r['global_store_dwordx4']:<3}")
    else:
        head = "ld4 st4 depot shared"
        def cell(r):
            return (f"{r['ld_global_v4']:>3} {r['st_global_v4']:>3} "
                    f"{'yes' if r['local_depot'] else 'no':>5} {r['shared_bytes']:>6}")
    width = max(len(r["label"]) for r in first)
    print(f"{'kernel':<{width}}  " + "  ".join(f"{a:^{len(head)}}" for a in archs), file=out)
    print(f"{'':<{width}}  " + "  ".join(head for _ in archs), file=out)
    for i, r0 in enumerate(first):
        cells = []
        for arch in archs:
            r = reports[arch]["kernels"][i]
            cells.append(f"{'ERROR':^{len(head)}}" if r.get("error") else cell(r))
        mark = " *" if any(reports[a]["kernels"][i]["problems"] for a in archs) else ""
        print(f"{r0['label']:<{width}}  " + "  ".join(cells) + mark, file=out)
    for arch in archs:
        s = reports[arch]["summary"]
        print(f"{arch}: " + ", ".join(f"{k}={v}" for k, v in s.items()), file=out)
        for r in reports[arch]["kernels"]:
            if r["problems"]:
                print(f"  FAIL {arch} {r['label']}: {'; '.join(r['problems'])}", file=out)
                if r.get("error"):
                    print("    " + r["error"].replace("\n", "\n    ")[:2000], file=out)


def main(argv=None):
    """``rmsnorm-hip compile [--target hip|cuda] [--arch ARCH]... [--report FILE]``; exit status
    is 0 when every kernel compiled and passed the gates, 1 otherwise."""
    parser = Parser(
        prog="rmsnorm-hip compile",
        description="Compile every kernel variant the dispatcher can launch ahead of time (no GPU "
                    "needed) and report each kernel's resource usage.")
    parser.add_argument("--target", choices=("hip", "cuda"), default="hip",
                        help="hip: AMD code objects via numba-hip (default); cuda: PTX via "
                             "numba-cuda")
    parser.add_argument("--arch", action="append", dest="archs", metavar="ARCH",
                        help="gfx942, gfx950, ... (hip) or sm_90, ... (cuda); repeatable; "
                             f"default {' '.join(AMD_ARCHS)} / {' '.join(CUDA_ARCHS)}")
    parser.add_argument("--report", metavar="FILE",
                        help="write the JSON report here; '{arch}' in FILE gives one file per "
                             "arch")
    parser.add_argument("--only", action="append", metavar="TEXT",
                        help="only variants whose label contains TEXT (repeatable)")
    parser.add_argument("--jobs", type=int, metavar="N",
                        help="worker processes (default: the CPU count)")
    parser.add_argument("--keep", metavar="DIR",
                        help="also write each code object + its disassembly (or PTX) to DIR")
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="report resources without failing on scratch, spills, missing "
                             "128-bit accesses or the main-kernel VGPR limit")
    args = parser.parse_args(argv)
    for arch in args.archs or ():
        if args.target == "cuda" and not re.fullmatch(r"sm_(\d+)(\d)a?", arch):
            parser.error(f"--arch: a CUDA arch looks like sm_90, got {arch!r}")
        if args.target == "hip" and not re.fullmatch(r"gfx[0-9a-f]{3,4}", arch):
            parser.error(f"--arch: an AMD arch looks like gfx942, got {arch!r}")
    if args.jobs is not None and args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.only and not _select(args.only, args.target):
        parser.error(f"--only: no variant's label contains any of {args.only} (labels look "
                     f"like {_select(None, args.target)[0].label!r})")
    # The compiler is an optional extra: without it every worker would fail with a traceback.
    dist, extra = ("numba-cuda", "cuda") if args.target == "cuda" else ("numba-hip", "rocm")
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        parser.exit(1, f"{parser.prog}: --target {args.target} needs {dist}, which is not "
                       f"installed: pip install \"rmsnorm-hip[{extra}]\"\n")
    failing = compile_all(args.archs, args.report, args.target, only=args.only, jobs=args.jobs,
                          keep_dir=args.keep, check=args.check)
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
