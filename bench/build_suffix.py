"""Build SuffixDecoding, the peer our benchmarks draft beside, into a virtual environment.

SuffixDecoding (ArcticInference's suffix trees; vLLM's ``method="suffix"`` imports it) ships on
the package index only as the ``arctic-inference`` sdist, whose ``setup.py`` imports torch and
builds CUDA custom ops.  We need only its suffix tree: ``csrc/suffix_decoding`` built with cmake
and nanobind into ``_C.so``, placed beside ``arctic_inference/suffix_decoding/*.py`` in the
environment's site-packages (no dist-info, so vLLM's plug-in entry point of the full package is
not registered and nothing of vLLM is patched).  About 20 s on 2 cores.

Usage: ``python bench/build_suffix.py [VENV]`` (default: the running interpreter's environment).
Needs cmake and a C++20 compiler; the sdist's sha256 is checked.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.0"
SDIST_SHA256 = "7f22e3e1b1071c6061c0d6951be17c0fb50b08d06d6e543144c8f52faba60a36"
PY_FILES = ("__init__.py", "suffix_decoding/__init__.py", "suffix_decoding/cache.py",
            "suffix_decoding/simulator.py")


def python_of(venv: str | None) -> str:
    if venv is None:
        return sys.executable
    py = Path(venv).absolute() / "bin" / "python"  # cmake gets it: relative, it found another
    if not py.exists():
        raise SystemExit(f"error: {py} does not exist (not a virtual environment?)")
    return str(py)


def installed(py: str) -> bool:
    probe = "from arctic_inference.suffix_decoding import SuffixDecodingCache as C; C(8)"
    return subprocess.run([py, "-c", probe], capture_output=True).returncode == 0


def run(*cmd: str, cwd: Path | None = None) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"error: {' '.join(cmd)} failed ({done.returncode}):\n"
                         f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done.stdout.strip()


def fetch_sdist(py: str, into: Path) -> Path:
    # no build isolation: metadata preparation runs setup.py, which imports torch; isolation
    # would download a CUDA torch to do it (the environments we build into have torch already)
    run(py, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
        "--no-build-isolation", f"arctic-inference=={VERSION}", "-d", str(into))
    sdist = next(into.glob("arctic_inference-*.tar.gz"))
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise SystemExit(f"error: {sdist.name} has sha256 {digest}, expected {SDIST_SHA256}")
    return sdist


def build(py: str) -> Path:
    site = Path(run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"))
    run(py, "-m", "pip", "install", "-q", "nanobind")
    with tempfile.TemporaryDirectory(prefix="suffix-build-") as tmp:
        tmp_path = Path(tmp)
        sdist = fetch_sdist(py, tmp_path)
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp_path, filter="data")
        src = tmp_path / f"arctic_inference-{VERSION}"
        csrc = src / "csrc" / "suffix_decoding"
        run("cmake", "-S", str(csrc), "-B", str(csrc / "build"), f"-DPython_EXECUTABLE={py}",
            "-DCMAKE_BUILD_TYPE=Release")
        run("cmake", "--build", str(csrc / "build"), "-j2")
        target = site / "arctic_inference"
        (target / "suffix_decoding").mkdir(parents=True, exist_ok=True)
        for rel in PY_FILES:
            shutil.copy2(src / "arctic_inference" / rel, target / rel)
        for so in (csrc / "build").glob("_C*.so"):
            shutil.copy2(so, target / "suffix_decoding" / so.name)
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("venv", nargs="?", help="virtual environment (default: this interpreter's)")
    p.add_argument("--force", action="store_true", help="rebuild even if it imports already")
    args = p.parse_args(argv)
    py = python_of(args.venv)
    if not args.force and installed(py):
        print(f"SuffixDecoding (arctic-inference {VERSION}) already importable by {py}")
        return 0
    if shutil.which("cmake") is None:
        raise SystemExit("error: cmake is not installed (apt-get install cmake)")
    target = build(py)
    if not installed(py):
        raise SystemExit(f"error: built into {target}, but it does not import")
    print(f"SuffixDecoding (arctic-inference {VERSION}) built into {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
