"""Every kernel variant the dispatcher can launch, for ahead-of-time compilation and resource
reports (``rmsnorm-hip compile``).  Built from the same spec functions the backends call, so a new
path or kernel shows up here by construction: add its enumeration next to its builder."""
from dataclasses import dataclass

from .. import _dtypes
from . import _config, rmsnorm_fwd

# one representative N per forward path (see _config.row_layout): multi-row, scalar-only (ragged),
# cached single-row at the LLM sizes, and the looped path
FWD_REPRESENTATIVE_N = (8, 127, 4096, 5000, 8192, 65536)


@dataclass(frozen=True)
class Variant:
    op: str
    builder: object
    spec: object
    argtypes: tuple

    @property
    def label(self):
        s = self.spec
        layout = s.layout
        path = ("looped" if not layout.cached else "multirow" if s.rows > 1 else "row")
        access = "vec" if s.vector else "scalar"
        return (f"{self.op}:{s.dtype}:w={s.weight or 'none'}:N={layout.n}:{path}:{access}"
                f":rstd={int(s.store_rstd)}")


def fwd_variants(ns=FWD_REPRESENTATIVE_N):
    for dtype in _dtypes.ACTIVATION_DTYPES:
        weights = ["", dtype] + ([_dtypes.FLOAT32] if dtype != _dtypes.FLOAT32 else [])
        for n in ns:
            layout = _config.row_layout(n, dtype)
            vector_ok = n % layout.chunk == 0
            for weight in weights:
                for vector in ([True, False] if vector_ok else [False]):
                    for store_rstd in (True, False):
                        spec = _config.fwd_spec(n, dtype, weight, vector, store_rstd)
                        yield Variant("fwd", rmsnorm_fwd.make_rmsnorm_fwd, spec,
                                      rmsnorm_fwd.argtypes(spec))


def variants():
    yield from fwd_variants()
