"""numba's on-disk cache of the kernels, stamped with the sources of the whole package.

numba caches each ``@njit(cache=True)`` function in an index file stamped with its own source
file (a content hash from numba 0.68, modification time and size before), and a cached
function carries the machine code of every jitted function it calls, inlined or linked in.
Nothing records that ``draft`` in ``drafting.py`` holds a copy of ``probe`` from ``slots.py``:
edit ``slots.py`` and the cached ``draft`` still loads, with the old ``probe`` in it, and
constants imported from ``ngramd/wire/constants.py`` are compiled in the same way.  That is
why the kernels were once one file ("one file, one cache stamp").

``PackageStamp`` is a cache locator numba asks before its own: for a function defined in the
``ngramd`` package it stamps the index with a hash of every module of ``ngramd/kernels/``, of
``ngramd/wire/constants.py`` and of the function's own file (so a kernel module elsewhere in
``ngramd`` that calls into the package is covered too).  Where the cache lives is left to the
locator numba would have picked (``$NUMBA_CACHE_DIR``, else ``__pycache__`` beside the source,
else the user-wide directory).  So an edit anywhere in the package recompiles every kernel on
its next call, as an edit of the one file did, and an unchanged package loads each function
from the same index and data files as before: the split adds no compile and no extra load at
start-up (``tests/test_kernels_cache.py`` checks both, with a callee edited in a copy of the
package).

The locator must be in place before the first decorator of the package runs: the package's
``__init__`` imports this module first, and no module of the package can be imported without
its ``__init__`` running before it.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from numba.core import caching

_PACKAGE = Path(__file__).resolve().parent
_NGRAMD = _PACKAGE.parent
#: constants the kernels compile in, from outside the package
_SHARED = (_NGRAMD / "wire" / "constants.py",)
# numba >= 0.61 names it CacheImpl, 0.60 _CacheImpl
_IMPL = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl")


def _digest(path: Path) -> bytes:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).digest()


@functools.lru_cache(maxsize=None)
def _package_digest() -> bytes:
    """sha256 over the names and contents of the package's modules and the shared constants.

    Read once a process: numba takes a function's stamp once too, when its decorator runs, so
    a package edited while a process runs is seen by the next process either way."""
    h = hashlib.sha256()
    for p in sorted(_PACKAGE.glob("*.py")) + list(_SHARED):
        h.update(str(p.relative_to(_NGRAMD)).encode() + b"\0" + _digest(p))
    return h.digest()


def package_stamp(py_file: Path) -> str:
    """The cache stamp of a function defined in ``py_file``: the package's digest, and
    ``py_file``'s own when it lies outside the package (hex sha256)."""
    h = hashlib.sha256(_package_digest())
    if py_file.parent != _PACKAGE:
        h.update(str(py_file.relative_to(_NGRAMD)).encode() + b"\0" + _digest(py_file))
    return h.hexdigest()


class PackageStamp(caching._CacheLocator):
    """numba's usual locator for a function of ``ngramd``, with the package's stamp."""

    def __init__(self, inner, py_file: Path):
        self._inner = inner
        self._py_file = py_file

    def ensure_cache_path(self):
        self._inner.ensure_cache_path()

    def get_cache_path(self):
        return self._inner.get_cache_path()

    def get_source_stamp(self):
        return package_stamp(self._py_file)

    def get_disambiguator(self):
        return self._inner.get_disambiguator()

    @classmethod
    def from_function(cls, py_func, py_file):
        path = Path(py_file).resolve()
        if _NGRAMD not in path.parents:
            return None  # not ours: numba's own locators decide
        for other in _IMPL._locator_classes:
            if other is not cls:
                inner = other.from_function(py_func, py_file)
                if inner is not None:
                    return cls(inner, path)
        return None


def install() -> None:
    """Put ``PackageStamp`` first among numba's locators (once)."""
    if PackageStamp not in _IMPL._locator_classes:
        _IMPL._locator_classes.insert(0, PackageStamp)


install()
