"""numba's on-disk cache of the kernels package (``ngramd/kernels/cachekey.py``).

numba stamps a cached function with its own source file only, while the cached code holds
copies of the jitted functions it calls.  Split into modules, the kernels would load stale
code after an edit of a callee's module; ``cachekey.PackageStamp`` stamps every kernel with
the sources of the whole package instead.  These tests run a kernel that calls across modules
(``slots.slots_checksum`` inlines ``hashing.hash_step`` and ``hashing.fmix64``) in fresh
processes over a copy of the package and a scratch ``NUMBA_CACHE_DIR``:

* a second start loads the kernel from the cache (no compile: the split costs no start-up);
* an edit of the callee's module, or of the constants the kernels compile in, recompiles the
  caller, and the result changes with the edit.

Without the package stamp the edited runs load the stale kernel and give the old value (checked
by hand when the stamp was written: numba 0.68 reports a cache hit there).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: one checksum through the package, and whether numba compiled it or loaded it
PROBE = """
import json
import numpy as np
from ngramd.kernels.slots import slots_checksum
slots = np.arange(64, dtype=np.uint32).reshape(8, 8)
value = int(slots_checksum(slots))
st = slots_checksum.stats
print(json.dumps({"value": value, "hits": sum(st.cache_hits.values()),
                  "misses": sum(st.cache_misses.values())}))
"""


@pytest.fixture
def tree(tmp_path):
    """A copy of ``ngramd/kernels`` and ``ngramd/wire`` under ``tmp_path/src`` (an ``ngramd``
    of its own, so the edits below touch no file of the checkout)."""
    src = tmp_path / "src" / "ngramd"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("")
    for part in ("kernels", "wire"):
        shutil.copytree(ROOT / "ngramd" / part, src / part,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def run(tree: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"), NUMBA_CACHE_DIR=str(tree / "cache"),
               OMP_NUM_THREADS="1")
    # cwd: ``python -c`` puts it first on sys.path, and the checkout's own ngramd/ is there
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=str(tree),
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new))


def test_a_warm_start_loads_and_a_callee_edit_recompiles_the_caller(tree):
    first = run(tree)
    assert (first["misses"], first["hits"]) == (1, 0)  # an empty cache: compiled
    warm = run(tree)
    assert (warm["misses"], warm["hits"]) == (0, 1)  # loaded, not compiled
    assert warm["value"] == first["value"]
    # the finaliser's first multiplier, in the callee's module (the caller's is untouched)
    edit(tree / "src/ngramd/kernels/hashing.py", "0xFF51AFD7ED558CCD", "0xFF51AFD7ED558CCF")
    edited = run(tree)
    assert (edited["misses"], edited["hits"]) == (1, 0)
    assert edited["value"] != first["value"]
    again = run(tree)  # the new stamp's cache serves the next start
    assert (again["misses"], again["hits"], again["value"]) == (0, 1, edited["value"])


def test_an_edit_of_the_shared_constants_recompiles_the_kernels(tree):
    first = run(tree)
    edit(tree / "src/ngramd/wire/constants.py", "HASH_SEED = np.uint64(0x9E3779B97F4A7C15)",
         "HASH_SEED = np.uint64(0x9E3779B97F4A7C17)")
    edited = run(tree)
    assert (edited["misses"], edited["hits"]) == (1, 0)
    assert edited["value"] != first["value"]
