"""Where the proposer's helper threads run: off the CPUs the engine's thread is pinned to.

vLLM's CPU backend pins its worker thread, the one that runs the model's forward and calls
``propose()``, to CPUs of its own (``VLLM_CPU_OMP_THREADS_BIND``; on a 2-core host, CPU 0 alone),
and a thread inherits the affinity of the thread that starts it.  So every helper the proposer
starts in the worker ran on the model's CPU: the daemon link's thread (feedback, probes), the
client's I/O thread, the hot tier's prefault thread, and libzmq's own I/O threads.  A daemon
ask is queued by ``propose()`` and sent by libzmq's I/O thread, which, woken on the same CPU,
preempts the step that woke it; its reply is read there too, in the middle of a forward.
Measured in a vLLM engine on this 2-core host (batch 8, a SmolLM2 model, ``propose()``'s parts
timed in the engine): the step's asks cost 265 µs a step on average (p90 of a send 1.6 ms)
with the helpers on the model's CPU, 95 µs (p90 0.3 ms) with them on the other one; the step,
1.40 ms -> 1.18 ms on average (bench/RESULTS.md, "propose() inside vLLM").

``helper_cpus`` decides where they go (the proposer's ``helper_cpus`` setting): ``"auto"``,
the CPUs this process may use that the calling thread is not pinned to, when there are any
(an engine not pinned, as on a GPU host, changes nothing); ``"off"``, where they start; or a
list such as ``"1,3"`` / ``"2-5"``.  :class:`HelperPlacement` applies it: a ZeroMQ context
whose background threads start there (``context``, for the link's client), and ``place``,
which moves the process's threads named ``ngram-*`` that it has not moved yet (at start, and
again from the proposer's idle watch, for a thread started later: a client made after a
reconnect, the prefault thread of a new hot generation).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)

#: the name prefix of every thread this package and the client start
THREAD_PREFIX = "ngram-"


def parse_cpus(text: str) -> frozenset[int]:
    """A CPU list as the kernel writes one ("0-3,5"); ``ValueError`` when it is not one."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part.strip():
            continue
        lo, _, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError:
            a, b = 0, -1
        if a < 0 or b < a:
            raise ValueError(f"{text!r}: not a CPU list such as 0-3,5")
        cpus.update(range(a, b + 1))
    if not cpus:
        raise ValueError(f"{text!r}: no CPU in the list")
    return frozenset(cpus)


def allowed_cpus() -> frozenset[int]:
    """The CPUs this process may run on: its cgroup's cpuset (cgroup v2), else every CPU."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                path = Path("/sys/fs/cgroup") / line[3:].lstrip("/") / "cpuset.cpus.effective"
                return parse_cpus(path.read_text())
    except (OSError, ValueError):
        pass
    return frozenset(range(os.cpu_count() or 1))


def helper_cpus(setting: str = "auto") -> frozenset[int] | None:
    """The CPUs for the helper threads (module doc), or None: leave them where they start."""
    setting = setting.strip()
    if setting == "off":
        return None
    if setting != "auto":
        return parse_cpus(setting)
    rest = allowed_cpus() - os.sched_getaffinity(0)  # 0: the calling thread (the engine's)
    return frozenset(rest) if rest else None


class HelperPlacement:
    """Keeps the helper threads on ``cpus`` (None: does nothing)."""

    def __init__(self, cpus: frozenset[int] | None):
        self.cpus = cpus
        self.moved = 0  # threads moved so far
        self._done: set[int] = set()  # native ids of the threads moved (or that refused)
        self._context = None

    def context(self):
        """A ZeroMQ context whose I/O threads start on ``cpus`` (None when there is nothing
        to place: the client's shared context then)."""
        if self.cpus is None:
            return None
        if self._context is None:
            import zmq

            ctx = zmq.Context()
            for cpu in sorted(self.cpus):  # before its first socket: its threads start then
                ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)
            self._context = ctx
        return self._context

    def place(self) -> int:
        """Move the threads named ``ngram-*`` not moved yet to ``cpus``; returns how many.  A
        thread the kernel refuses to move (a CPU outside the process's cpuset) is left, once
        logged."""
        if self.cpus is None:
            return 0
        n = 0
        for t in threading.enumerate():
            tid = t.native_id
            if tid is None or tid in self._done or not t.name.startswith(THREAD_PREFIX):
                continue
            self._done.add(tid)
            try:
                os.sched_setaffinity(tid, self.cpus)
                n += 1
            except OSError as e:  # gone already, or CPUs this process may not use
                if t.is_alive():
                    log.warning("cannot move thread %s to CPUs %s: %s", t.name,
                                format_cpus(self.cpus), e)
        self.moved += n
        return n

    def close(self) -> None:
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None


def format_cpus(cpus) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"``."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)
