"""notebooks/quickstart.ipynb runs top to bottom in a Jupyter kernel (nbclient), on the CPU: every
entry point on NumPy arrays and through torch, each checked against the float64 references; the
GPU cells skip themselves without a GPU."""
import importlib.util
import os
import pathlib

import pytest

pytestmark = pytest.mark.quick

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"
DONE = "quickstart: every check passed"

_MISSING = [name for name in ("nbclient", "nbformat", "ipykernel", "torch")
            if importlib.util.find_spec(name) is None]


@pytest.mark.skipif(bool(_MISSING), reason=f"{', '.join(_MISSING)} not importable: the notebook "
                    "runs in an ipykernel through nbclient (pip install -e '.[test]') and its "
                    "torch section needs torch")
def test_quickstart_notebook_runs(monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    import rmsnorm_hip

    # The kernel is a subprocess with this environment: it must import this rmsnorm_hip (also
    # when it is not installed, only on sys.path), and NumPy arrays go to the CPU backend.  With
    # numba.cuda started as the simulator (conftest.py), hide any GPU so the GPU cells skip.
    package_root = str(pathlib.Path(rmsnorm_hip.__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (package_root, os.environ.get("PYTHONPATH")) if p))
    monkeypatch.delenv("RMSNORM_HIP_BACKEND", raising=False)
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")

    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()            # raises CellExecutionError, with the cell's traceback, on error

    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    text = "".join(out.get("text", "") for out in outputs if out.output_type == "stream")
    for expected in ("rms_norm y (float32)", "rms_norm_backward dweight",
                     "fused_add_rms_norm_ (in place) == fused_add_rms_norm, bitwise",
                     "rms_norm_quant float8_e4m3fn q", "RMSNorm model output vs torch.nn.RMSNorm",
                     "rms_norm on a torch bf16 tensor", DONE):
        assert expected in text, f"{expected!r} missing from the notebook's output:\n{text}"
