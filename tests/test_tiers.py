"""Every test module declares its tier (tests/conftest.py, ``TIERS``) in a module-level
``pytestmark``, so that no test lands in the default run, or drops out of CI, by omission."""
import ast
from pathlib import Path

import pytest
from conftest import TIERS

pytestmark = pytest.mark.quick

TESTS = Path(__file__).resolve().parent


def declared_tiers(path):
    """The tier marker names in the module's top-level ``pytestmark`` (None: no pytestmark)."""
    tree = ast.parse(path.read_text(), str(path))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            return [n.attr for n in ast.walk(node.value)
                    if isinstance(n, ast.Attribute) and n.attr in TIERS]
    return None


@pytest.mark.parametrize("path", sorted(TESTS.glob("test_*.py")), ids=lambda p: p.name)
def test_module_declares_one_tier(path):
    tiers = declared_tiers(path)
    assert tiers is not None, f"{path.name} has no module-level pytestmark naming its tier {TIERS}"
    assert len(tiers) == 1, f"{path.name} declares {tiers or 'no tier'}; one of {TIERS} expected"


def test_guard_fails_without_a_tier(tmp_path):
    bare = tmp_path / "test_bare.py"
    bare.write_text("import pytest\npytestmark = pytest.mark.sim\n")
    assert declared_tiers(bare) == []
    (tmp_path / "test_none.py").write_text("def test_x():\n    pass\n")
    assert declared_tiers(tmp_path / "test_none.py") is None
    both = tmp_path / "test_both.py"
    both.write_text("import pytest\npytestmark = [pytest.mark.quick, pytest.mark.full]\n")
    assert declared_tiers(both) == ["quick", "full"]
