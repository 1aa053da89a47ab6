"""``python tests/slow_counting.py SECONDS NGRAMD_ARGS...``: ngramd whose every counting step
(``ColdStore.apply``, the writer's one call per batch of the ingest log) takes ``SECONDS``
longer, as a step of a table under a heavy backlog does.  A test gets a log lag that lasts as
long as it needs from a few thousand tokens, where the real thing takes millions (and 15-80 s
of counting on 2 cores, the test's restart included).  Fault injection by patching, in the
daemon's own process: the product has no hook for it.

    d = start_daemon(launcher=slow_counting.launcher(1.0))
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def launcher(seconds: float) -> list[str]:
    """The argv prefix (after the interpreter) of a daemon started through this file."""
    return [str(Path(__file__).resolve()), str(float(seconds))]


def main() -> int:
    seconds = float(sys.argv[1])
    from ngramd import service
    from ngramd.cold import store as cold

    apply = cold.ColdStore.apply  # fails here, loudly, if the writer's entry point moves

    def slow_apply(self, *args, **kwargs):
        time.sleep(seconds)
        return apply(self, *args, **kwargs)

    cold.ColdStore.apply = slow_apply
    return service.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
