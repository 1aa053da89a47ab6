"""Every name a benchmark imports from the product exists (the benchmarks themselves run for
minutes, outside the suite: a product rename broke bench/placement.py once without a test
noticing).  Imports inside functions count too."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
PRODUCT = ("ngramd", "ngram_client", "ngram_generator")


def product_imports():
    for path in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module \
                    and node.module.split(".")[0] in PRODUCT:
                for alias in node.names:
                    yield f"{path.name}:{node.lineno}", node.module, alias.name
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in PRODUCT:
                        yield f"{path.name}:{node.lineno}", alias.name, None


def test_the_benchmarks_import_only_names_that_exist():
    missing = []
    for where, module, name in product_imports():
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            missing.append(f"{where}: {module} ({e})")
            continue
        if name is not None and not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{where}: {module}.{name}")
    assert not missing, "benchmarks import what the product no longer has:\n" + "\n".join(missing)


def test_the_check_sees_a_missing_name(tmp_path, monkeypatch):
    (tmp_path / "b.py").write_text("def f():\n    from ngram_generator.demo import gone\n")
    monkeypatch.setattr(__import__(__name__), "BENCH", tmp_path)
    assert list(product_imports()) == [("b.py:2", "ngram_generator.demo", "gone")]
    with pytest.raises(AssertionError, match="demo.gone"):
        test_the_benchmarks_import_only_names_that_exist()
