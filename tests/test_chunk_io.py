"""The scalar (any-alignment) chunk accesses of kernels/_rowops.ChunkIO, through the simulator's
intrinsics (plain Python on NumPy arrays): at every element alignment of a row, each chunk's load
and packed-word load give the row's elements, each store writes the chunk's elements and nothing
else, and spans inside the row go through aligned 128-bit loads and aligned stores of 4-16 bytes
(``_config.scalar_shifted``).  The row handed to the accesses is a view of exactly its
elements, and the simulator's aligned accesses check their address and bounds, so a read before
the row's start or past its end fails here."""
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from rmsnorm_hip import intrinsics
from rmsnorm_hip.kernels._rowops import ChunkIO

pytestmark = pytest.mark.quick

STORAGE = {"bfloat16": (np.uint16, ml_dtypes.bfloat16), "float16": (np.uint16, np.float16),
           "float32": (np.float32, np.float32)}


def counting(intr):
    """The simulator namespace with its aligned accesses counted."""
    counts = {}

    def count(name):
        fn = getattr(intr, name)

        def wrapped(*args):
            counts[name] = counts.get(name, 0) + 1
            return fn(*args)
        return wrapped

    names = ("load_b128", "store_b128", "store_b64", "store_b32")
    return SimpleNamespace(**(vars(intr) | {n: count(n) for n in names})), counts


def row_at(dtype, n, offset_bytes, rng):
    """(row view of n elements starting ``offset_bytes`` past a 16-byte boundary, its buffer,
    the row's start in the buffer's elements): random finite values, guards around it."""
    storage, value_type = STORAGE[dtype]
    itemsize = np.dtype(storage).itemsize
    raw = np.empty(16 * (n + 16) + 64, np.uint8)
    base = (-raw.ctypes.data) % 16
    buf = raw[base:base + 16 * (n + 8)].view(storage)
    buf[:] = rng.standard_normal(buf.size).astype(value_type).view(storage)
    start = 8 * (16 // itemsize) + offset_bytes // itemsize
    return buf[start:start + n], buf, start


def floats_of(values, dtype):
    storage, value_type = STORAGE[dtype]
    return np.asarray(values).view(value_type).astype(np.float32)


@pytest.mark.parametrize("dtype", list(STORAGE))
@pytest.mark.parametrize("extra", [0, 1, 3], ids=lambda e: f"n+{e}")
def test_scalar_chunks_at_every_alignment(dtype, extra, rng):
    intr, counts = counting(intrinsics.load("sim", 32))
    itemsize = np.dtype(STORAGE[dtype][0]).itemsize
    chunk = 16 // itemsize
    n = 5 * chunk + extra
    io = ChunkIO(intr, dtype, chunk, n, False)
    for offset in range(0, 16, itemsize):
        row, buf, start = row_at(dtype, n, offset, rng)
        expected = floats_of(row, dtype)
        for col0 in range(0, n, chunk):
            counts.clear()
            vals = np.full(chunk, np.nan, np.float32)
            io.load(row, 0, col0, vals, 0)
            live = min(chunk, n - col0)
            what = f"{dtype} offset {offset} B, n {n}, chunk at {col0}"
            np.testing.assert_array_equal(vals[:live], expected[col0:col0 + live], what)
            assert not vals[live:].any(), what      # past the row: zeros
            inside = col0 > 0 and col0 + 2 * chunk <= n
            blocks = (1 if (offset + col0 * itemsize) % 16 == 0 else 2) if inside else 0
            assert counts.get("load_b128", 0) == blocks, (what, counts)

            words = np.zeros(4, np.uint32)
            io.load_words(row, 0, col0, words, 0)
            got = np.zeros(16 // itemsize, STORAGE[dtype][0])
            got.view(np.uint32)[:] = words
            np.testing.assert_array_equal(got[:live], row[col0:col0 + live], what)
            assert not got[live:].view(np.uint8).any(), what

            before = buf.copy()
            new = floats_of(rng.standard_normal(chunk).astype(STORAGE[dtype][1])
                            .view(STORAGE[dtype][0]), dtype)
            counts.clear()
            io.store(row, 0, col0, new, 0)
            after = buf.copy()
            assert np.array_equal(floats_of(after[start + col0:start + col0 + live], dtype),
                                  new[:live]), what
            untouched = np.ones(buf.size, bool)
            untouched[start + col0:start + col0 + live] = False
            assert np.array_equal(after[untouched].view(np.uint8),
                                  before[untouched].view(np.uint8)), what
            wide = sum(counts.get(k, 0) for k in ("store_b128", "store_b64", "store_b32"))
            if live == chunk:
                # aligned: one 128-bit store; 8 bytes past: two 64-bit; 4 / 12 bytes: 32 + 64 +
                # 32; 16-bit elements 2 bytes past a word: 3 x 32 bits and two 16-bit stores
                span = (offset + col0 * itemsize) % 16
                pieces = {0: 1, 8: 2, 4: 3, 12: 3, 2: 3, 6: 3, 10: 3, 14: 3}[span]
                assert wide == pieces, (what, counts)
            else:
                assert wide == 0, (what, counts)


@pytest.mark.parametrize("extra", [0, 2])
def test_two_span_chunks_at_every_alignment(extra, rng):
    """A float32 chunk of 8 (the weight or xscale of a 16-bit row) is two spans, each shifted on
    its own where it lies inside the row, the first of them too where the chunk is not the
    row's first."""
    intr, counts = counting(intrinsics.load("sim", 32))
    n = 32 + extra
    io = ChunkIO(intr, "float32", 8, n, False)
    for offset in (0, 4, 8, 12):
        row, _, _ = row_at("float32", n, offset, rng)
        for col0 in range(0, n, 8):
            counts.clear()
            vals = np.full(8, np.nan, np.float32)
            io.load(row, 0, col0, vals, 0)
            live = min(8, n - col0)
            what = f"offset {offset} B, n {n}, chunk at {col0}"
            np.testing.assert_array_equal(vals[:live], row[col0:col0 + live], what)
            assert not vals[live:].any(), what
            spans = [col for col in (col0, col0 + 4) if col >= 4 and col + 8 <= n]
            blocks = sum(1 if (offset + 4 * col) % 16 == 0 else 2 for col in spans)
            assert counts.get("load_b128", 0) == blocks, (what, counts)


def test_elementwise_when_the_kernel_asks(rng):
    """``shifted=False`` (kernels whose registers cannot hold a span's two aligned blocks:
    _config.scalar_shifted) keeps the scalar form element by element."""
    intr, counts = counting(intrinsics.load("sim", 32))
    io = ChunkIO(intr, "bfloat16", 8, 64, False, shifted=False)
    row, _, _ = row_at("bfloat16", 64, 2, rng)
    vals = np.zeros(8, np.float32)
    io.load(row, 0, 16, vals, 0)
    io.store(row, 0, 16, vals, 0)
    assert not counts
    np.testing.assert_array_equal(vals, floats_of(row[16:24], "bfloat16"))


@pytest.mark.parametrize("quant,fma_levels", [("int8", False), ("int8", True),
                                              ("float8_e4m3fn", False)])
@pytest.mark.parametrize("chunk", [8, 4])
def test_scalar_quant_store_at_every_alignment(quant, fma_levels, chunk, rng):
    """A quantised chunk stored at any byte offset writes the element-by-element form's levels
    (NaN, infinities and saturating values among them), only its own bytes, and whole chunks as
    words where the address is word-aligned."""
    from rmsnorm_hip.kernels._rowops import make_quant_store
    intr, counts = counting(intrinsics.load("sim", 32))
    n = 4 * chunk + 3
    storage = np.int8 if quant == "int8" else np.uint8
    shifted = make_quant_store(intr, quant, chunk, n, False, fma_levels)
    elementwise = make_quant_store(intr, quant, chunk, n, False, fma_levels, shifted=False)
    special = np.array([np.nan, np.inf, -np.inf, 1e30, -300.0, 0.0], np.float32)
    for offset in range(8):
        raw = np.zeros(n + 64, np.uint8)
        start = (-raw.ctypes.data) % 16 + 16 + offset
        for col0 in range(0, n, chunk):
            vals = (rng.standard_normal(chunk) * 40).astype(np.float32)
            if not fma_levels:      # fma levels are for finite rows within +-127.5 only
                vals[rng.integers(0, chunk)] = special[rng.integers(0, special.size)]
            inv = np.float32(1.5)
            expected = raw.copy()
            elementwise(expected[start:start + n].view(storage), 0, col0, vals, 0, inv)
            got = raw.copy()
            counts.clear()
            shifted(got[start:start + n].view(storage), 0, col0, vals, 0, inv)
            what = f"{quant} chunk {chunk} offset {offset} at {col0}"
            np.testing.assert_array_equal(got, expected, what)
            assert np.count_nonzero(got != raw) <= chunk, what
            whole = col0 + chunk <= n
            aligned = (offset + col0) % 4 == 0
            assert bool(counts) == (whole and aligned), (what, counts)
