"""The suite's folders are subpackages of `tests`, never top-level modules: a folder named like
an installed distribution (tests/kernels and the `kernels` package transformers imports) must not
shadow it, whatever order pytest collects in."""
import importlib.util
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_no_test_folder_is_importable_as_a_top_level_module():
    folders = sorted(p.parent.name for p in TESTS.glob("*/__init__.py"))
    assert "kernels" in folders and "server" in folders
    shadowing = []
    for name in folders:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin and Path(spec.origin).resolve().is_relative_to(TESTS):
            shadowing.append(name)
    assert not shadowing, f"tests/ is on sys.path; these folders shadow top-level names: {shadowing}"
