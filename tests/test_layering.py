"""The import graph of the product proves its layering (issue 20, item 1).

Every import statement of every module in ``ngramd/``, ``client/`` and ``generator/`` is read
with ``ast`` -- function-level and conditional imports included, since they run too -- and:

* no module takes part in an import circle (a circle is a module holding two jobs);
* the daemon's package never imports the client or the generator;
* the wire contract (``ngramd/wire/``) imports nothing of ours outside itself, and neither
  numba nor RocksDB;
* the client imports nothing of ``ngramd`` but the contract, and nothing that loads numba or
  RocksDB, directly or through what it imports;
* the generator (the vLLM proposer included) imports of ``ngramd`` only the contract and the
  drafting core it drafts with in-process (``DRAFTING``: the kernels, the drafting front end
  and the shared-memory reader with its files' module, which themselves import only the
  contract and each other); never the server, the table or the cold
  tier;
* the kernels (``ngramd/kernels/``, a package of topics) sit at the bottom: they import only
  each other and the contract.
* the table's parts (``TABLE_PARTS``: the hot cycle, the write front, the threads) never load
  the table that owns them, and the threads import neither of the other two: they reach the
  hot cycle through ``maintenance.HotWork`` only (issue 31);
* the daemon is built in ``LAYERS``, bottom first, and no module imports a layer above its
  own; the two tiers are rooms (``ngramd/cold/``, ``ngramd/hot/``): the cold room imports
  nothing of the hot one, each room's ``__init__`` imports nothing (importing one module of a
  room loads no other), and the rest of the product enters a room only by its doors
  (``DOORS``, the modules each room's ``__init__`` names).

The graph is read from the source, not from ``sys.modules``: a lazy import that a test run
never reaches is checked all the same.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: import name -> source directory (pyproject.toml's package-dir)
PACKAGES = {"ngramd": "ngramd", "ngram_client": "client", "ngram_generator": "generator"}
CONTRACT = "ngramd.wire"
#: the numba kernels' package, one module a topic
KERNELS = "ngramd.kernels"
#: third-party packages the contract and the client must not load
HEAVY = {"numba", "llvmlite", "rocksdict"}
#: the parts ``ngramd.table.Table`` owns and coordinates
TABLE_PARTS = {"ngramd.hot.cycle", "ngramd.writefront", "ngramd.maintenance"}


def _modules() -> dict[str, Path]:
    """Every first-party module name -> its file."""
    mods = {}
    for name, d in PACKAGES.items():
        for f in sorted((ROOT / d).rglob("*.py")):
            parts = [name, *f.relative_to(ROOT / d).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = f
    return mods


MODULES = _modules()
#: daemon modules the generator drafts with in-process (the numba kernels, the drafting front
#: end, the hot-tier reader)
DRAFTING = ({m for m in MODULES if m == KERNELS or m.startswith(KERNELS + ".")}
            | {"ngramd.drafttiers", "ngramd.hot", "ngramd.hot.shm", "ngramd.hot.segments"})
#: the daemon's layers, bottom first: a module imports only its own layer and those below
#: (a package here stands for every module in it)
LAYERS = [
    ("the contract", {CONTRACT}),
    ("settings and bookkeeping", {"ngramd.config", "ngramd.stats", "ngramd.health"}),
    ("the kernels", {KERNELS}),
    ("the drafting front end", {"ngramd.drafttiers"}),
    ("the cold tier", {"ngramd.cold"}),
    ("the hot tier", {"ngramd.hot"}),
    ("the table", {"ngramd.table", "ngramd.writefront", "ngramd.maintenance"}),
    ("the daemon", {"ngramd.server", "ngramd.handlers", "ngramd.service", "ngramd.metrics",
                    "ngramd.fleet", "ngramd.snapshots", "ngramd.tools"}),
]
#: the rooms of the two tiers -> the modules the rest of the product may import from them
DOORS = {
    "ngramd.cold": {"ngramd.cold.store", "ngramd.cold.rows", "ngramd.cold.runs"},
    "ngramd.hot": {"ngramd.hot.shm", "ngramd.hot.segments", "ngramd.hot.image",
                   "ngramd.hot.selection", "ngramd.hot.cycle"},
}


def _imports(mod: str, path: Path) -> tuple[set[str], set[str]]:
    """(first-party modules, top-level third-party packages) that ``mod`` imports anywhere in
    its file.  ``from pkg import name`` imports ``pkg.name`` when that is a module."""
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    ours, theirs = set(), set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]  # trimmed to a module below
        else:
            continue
        for n in names:
            if n.split(".")[0] in PACKAGES:
                while n and n not in MODULES:  # ngramd.wire.errors.BadInput -> the module
                    n = n.rpartition(".")[0]
                if n and n != mod:
                    ours.add(n)
            elif n:
                theirs.add(n.split(".")[0])
    return ours, theirs


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _closure(mod: str) -> set[str]:
    """``mod`` and every first-party module it loads, with the packages they live in."""
    seen, todo = set(), [mod]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo += GRAPH[m][0]
        parent = m.rpartition(".")[0]
        if parent:
            todo.append(parent)  # importing a.b.c runs a/__init__.py and a/b/__init__.py
    return seen


def _cycles() -> list[list[str]]:
    """The import circles: strongly connected components of two modules or more (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(GRAPH[v][0]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def _in(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def test_the_graph_is_read():
    """The test reads what it claims to: the three packages, the contract, lazy imports."""
    assert len(MODULES) > 30 and CONTRACT in MODULES and DRAFTING <= set(MODULES)
    assert "ngramd.wire.protocol" in GRAPH["ngram_client.client"][0]
    assert "ngramd.table" in GRAPH["ngramd.service"][0]  # a function-level import
    assert "numba" in GRAPH["ngramd.kernels.drafting"][1]
    assert {"ngramd.kernels.slots", "ngramd.kernels.cachekey"} <= DRAFTING


def test_no_import_circles():
    assert _cycles() == []


def test_the_daemon_never_imports_its_clients():
    bad = {m: sorted(i for i in GRAPH[m][0] if not _in(i, "ngramd"))
           for m in MODULES if _in(m, "ngramd")}
    assert not {m: v for m, v in bad.items() if v}


def test_the_contract_imports_only_itself():
    for m in MODULES:
        if _in(m, CONTRACT):
            ours, theirs = GRAPH[m]
            assert all(_in(i, CONTRACT) for i in ours), (m, ours)
            assert not theirs & HEAVY, (m, theirs & HEAVY)


def test_the_client_loads_only_the_contract():
    """Directly and through everything it imports: no daemon module, no numba, no RocksDB."""
    for m in MODULES:
        if _in(m, "ngram_client"):
            loaded = _closure(m)
            daemon = sorted(i for i in loaded if _in(i, "ngramd")
                            and not _in(CONTRACT, i) and not _in(i, CONTRACT))
            assert daemon == [], (m, daemon)
            assert not set().union(*(GRAPH[i][1] for i in loaded)) & HEAVY, m


def test_the_generator_imports_the_contract_and_the_drafting_core_only():
    for m in MODULES:
        if _in(m, "ngram_generator"):
            daemon = sorted(i for i in _closure(m) if _in(i, "ngramd") and i != "ngramd"
                            and not _in(i, CONTRACT) and i not in DRAFTING)
            assert daemon == [], (m, daemon)
    for d in DRAFTING:  # what the generator may load imports only the contract
        assert all(_in(i, CONTRACT) or i in DRAFTING for i in GRAPH[d][0]), (d, GRAPH[d][0])


def test_the_kernels_sit_at_the_bottom():
    """Every layer may draft, count and probe with the kernels; they use no other layer."""
    for m in MODULES:
        if _in(m, KERNELS):
            assert all(_in(i, KERNELS) or _in(i, CONTRACT) for i in GRAPH[m][0]), (m, GRAPH[m][0])


def test_the_tables_parts_never_load_the_table_and_the_threads_know_no_part():
    assert TABLE_PARTS <= set(MODULES) and TABLE_PARTS <= GRAPH["ngramd.table"][0]
    for m in TABLE_PARTS:
        assert "ngramd.table" not in _closure(m), m
    assert not GRAPH["ngramd.maintenance"][0] & TABLE_PARTS, GRAPH["ngramd.maintenance"][0]


def _layer(mod: str) -> int:
    """The index in ``LAYERS`` of the layer ``mod`` belongs to."""
    found = [i for i, (_, mods) in enumerate(LAYERS) if any(_in(mod, m) for m in mods)]
    assert len(found) == 1, f"{mod} is in {len(found)} layers of LAYERS: place it in one"
    return found[0]


def test_every_daemon_module_has_a_layer_and_imports_none_above_it():
    daemon = [m for m in MODULES if _in(m, "ngramd") and m != "ngramd"]
    up = sorted(f"{m} ({LAYERS[_layer(m)][0]}) imports {i} ({LAYERS[_layer(i)][0]})"
                for m in daemon for i in GRAPH[m][0]
                if i != "ngramd" and _layer(i) > _layer(m))
    assert up == [], "imports of a layer above:\n" + "\n".join(up)


def test_the_rooms_are_entered_by_their_doors_and_their_inits_import_nothing():
    assert all(d in MODULES for doors in DOORS.values() for d in doors)
    for room, doors in DOORS.items():
        assert GRAPH[room] == (set(), set()), (room, GRAPH[room])
        # the doors are named where a reader of the room looks first
        init = MODULES[room].read_text(encoding="utf-8")
        assert all(f"``{d.rpartition('.')[2]}``" in init for d in doors), room
        bad = sorted(f"{m} -> {i}" for m in MODULES if not _in(m, room)
                     for i in GRAPH[m][0] if _in(i, room) and i != room and i not in doors)
        assert bad == [], f"imports of {room} that pass by its doors: {bad}"


def test_the_layer_check_sees_an_upward_import():
    """A cold module that imported the hot tier (or the table) would fail the test above."""
    assert _layer("ngramd.cold.store") < _layer("ngramd.hot.cycle") < _layer("ngramd.table")
    assert _layer("ngramd.kernels.slots") < _layer("ngramd.cold.rows")
    assert _layer("ngramd.snapshots") == len(LAYERS) - 1


def test_the_readmes_module_map_names_every_module_and_only_real_ones():
    """README "Where to read first": each module of the three packages is in the module map,
    and each file the map names exists (a bare name continues the directory of the path
    before it in the same cell: ``ngramd/wire/constants.py``, ``errors.py``)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text.split("\nModule map:\n", 1)[1].strip().split("\n\n", 1)[0]
    named = set()
    for row in table.splitlines()[2:]:
        cells = row.split("|")[1:3]
        where = cells[0].strip()
        # the package rows list their modules in the second cell: `client/` (`ngram_client`)
        pkg_dir = where.split("`")[1] if where.endswith("`)") else ""
        d = ""
        for cell in cells if pkg_dir else cells[:1]:
            for name in re.findall(r"`([\w./]+\.py|[\w]+/)`", cell):
                if name.endswith("/"):
                    path = name
                elif "/" in name:
                    path, d = name, name.rpartition("/")[0]
                else:
                    path = f"{pkg_dir.rstrip('/') or d}/{name}"
                assert (ROOT / path).exists(), f"README module map: {path} is not in the tree"
                named.add(path)
    missing = sorted(str(f.relative_to(ROOT)) for f in MODULES.values()
                     if f.name != "__init__.py" and str(f.relative_to(ROOT)) not in named)
    assert missing == [], f"README module map misses {missing}"
