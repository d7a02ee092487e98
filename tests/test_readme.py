"""The README's Python examples run as written (on the CPU backend)."""
import importlib.util
import pathlib
import re
import pytest

pytestmark = pytest.mark.quick

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run(monkeypatch):
    monkeypatch.setenv("RMSNORM_HIP_BACKEND", "cpu")
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python example"
    for block in blocks:
        if "import torch" in block and importlib.util.find_spec("torch") is None:
            continue                    # the torch adapter's example; torch is optional
        exec(compile(block, str(README), "exec"), {})
