"""House rules of the product's code that a machine can check exactly (issue 20).

No function in ``ngramd/``, ``client/`` or ``generator/`` is over ``MAX_LINES`` lines, counted
from its first decorator to its last line (comments, docstring and nested functions
included), except the ones in ``LONG``: a kernel whose docstring says why it is one piece, or
one whose split is pending.  Every entry of ``LONG`` gives the length it may not grow past.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("ngramd", "client", "generator")
MAX_LINES = 80

#: ``path:qualified name`` -> the most lines it may have, and why it is over MAX_LINES.
#: Remove an entry once its function is split (a stale entry is warned about).
LONG: dict[str, tuple[int, str]] = {}


def function_lengths(root: Path = ROOT) -> dict[str, int]:
    """``path:qualified name`` -> lines, for every function and method of the product
    (nested ones too, as ``outer.inner``)."""
    out = {}
    for d in PRODUCT:
        for f in sorted((root / d).rglob("*.py")):
            rel = f.relative_to(root).as_posix()
            tree = ast.parse(f.read_text(encoding="utf-8"), rel)
            stack = [(tree, "")]
            while stack:
                node, prefix = stack.pop()
                for ch in ast.iter_child_nodes(node):
                    if isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        name = prefix + ch.name
                        if not isinstance(ch, ast.ClassDef):
                            first = min([ch.lineno] + [x.lineno for x in ch.decorator_list])
                            out[f"{rel}:{name}"] = ch.end_lineno - first + 1
                        stack.append((ch, name + "."))
                    else:
                        stack.append((ch, prefix))
    return out


def test_no_product_function_is_over_80_lines_but_the_listed_ones():
    lengths = function_lengths()
    assert len(lengths) > 500  # the walk saw the product (about 900 functions)
    over = {name: n for name, n in lengths.items() if n > MAX_LINES}
    new = sorted(f"{name} ({n} lines)" for name, n in over.items() if name not in LONG)
    assert not new, (f"functions over {MAX_LINES} lines: {', '.join(new)} -- split them "
                     f"(STYLE: keep functions short)")
    grown = sorted(f"{name} ({over[name]} lines, listed at {LONG[name][0]})"
                   for name in over.keys() & LONG.keys() if over[name] > LONG[name][0])
    assert not grown, f"listed long functions grew: {', '.join(grown)}"
    stale = sorted(set(LONG) - set(over))
    if stale:
        warnings.warn(f"tests/test_house.py LONG lists functions no longer over {MAX_LINES} "
                      f"lines: {', '.join(stale)}; remove them")


SAMPLE = """\
class C:
    @staticmethod
    def f():
        def g():
            return 1

        return g


async def h():
    pass
"""


def test_the_length_check_counts_decorators_nested_functions_and_methods(tmp_path):
    (tmp_path / "client").mkdir()
    (tmp_path / "client" / "m.py").write_text(SAMPLE)
    assert function_lengths(tmp_path) == {"client/m.py:C.f": 6, "client/m.py:C.f.g": 2,
                                          "client/m.py:h": 2}


def test_comments_cite_only_documents_in_the_repository():
    """The design is docs/ARCHITECTURE.md; no comment, docstring or README line sends a reader
    to a DESIGN file that a clone does not have."""
    cited = []
    for f in sorted([*ROOT.glob("*.md"), *(p for d in (*PRODUCT, "bench", "tests", "systemd")
                                           for p in (ROOT / d).rglob("*")
                                           if p.suffix in (".py", ".md", ".service", ".toml"))]):
        if f == Path(__file__):
            continue
        for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            if "DESIGN §" in line or "DESIGN.md" in line:
                cited.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not cited, "cite docs/ARCHITECTURE.md instead:\n" + "\n".join(cited)
