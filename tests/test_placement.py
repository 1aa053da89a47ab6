"""Where the vLLM proposer's helper threads run (``ngram_generator.placement``): off the CPUs
the engine's thread is pinned to, libzmq's I/O threads included."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from ngram_generator.placement import (HelperPlacement, allowed_cpus, format_cpus, helper_cpus,
                                       parse_cpus)

two_cpus = pytest.mark.skipif(len(allowed_cpus()) < 2, reason="needs two CPUs")


def test_cpu_lists_read_and_write_as_the_kernel_writes_them():
    assert parse_cpus("0-2,5") == {0, 1, 2, 5} and parse_cpus("3\n") == {3}
    assert format_cpus({5, 0, 1, 2}) == "0-2,5" and format_cpus({1, 3}) == "1,3"
    for bad in ("x", "3-1", "-1", "", ","):
        with pytest.raises(ValueError, match="CPU"):
            parse_cpus(bad)
    assert helper_cpus("off") is None and helper_cpus("1,3") == {1, 3}


def _in_thread(fn, pinned: set[int] | None = None):
    """``fn()`` on a new thread, pinned to ``pinned`` first (as vLLM pins its worker)."""
    out = {}

    def run():
        if pinned is not None:
            os.sched_setaffinity(0, pinned)
        out["v"] = fn()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out["v"]


@two_cpus
def test_auto_is_off_the_engine_threads_cpus_and_nothing_when_it_is_not_pinned():
    cpus = allowed_cpus()
    first = min(cpus)
    assert _in_thread(lambda: helper_cpus("auto"), {first}) == cpus - {first}
    assert _in_thread(lambda: helper_cpus("auto"), set(cpus)) is None


def _affinity_of_new_threads(before: set[str], prefix: str) -> dict[str, set[int]]:
    """Name -> CPUs of the threads not in ``before``, once they are all named ``prefix...``
    (a libzmq thread names itself, and sets its CPUs, as it starts)."""
    deadline = time.monotonic() + 10.0
    while True:
        new = {t: Path(f"/proc/self/task/{t}/comm").read_text().strip()
               for t in os.listdir("/proc/self/task") if t not in before}
        if (new and all(n.startswith(prefix) for n in new.values())) \
                or time.monotonic() > deadline:
            return {n: os.sched_getaffinity(int(t)) for t, n in new.items()}
        time.sleep(0.01)


@two_cpus
def test_helpers_move_off_the_engine_cpu_and_other_threads_stay():
    """From a thread pinned to one CPU (the engine's), the placement moves threads named
    ``ngram-*`` (started there, so pinned there too) to the other CPUs, leaves a thread of
    another name alone, and gives libzmq's I/O threads of its context the other CPUs from
    their start; a thread started later is moved by the next ``place``."""
    import zmq

    cpus = allowed_cpus()
    first = min(cpus)
    stop = threading.Event()
    seen = {}

    def engine():
        os.sched_setaffinity(0, {first})
        placement = HelperPlacement(helper_cpus("auto"))
        helpers = [threading.Thread(target=stop.wait, name=n) for n in ("ngram-link", "other")]
        for t in helpers:
            t.start()
        before = set(os.listdir("/proc/self/task"))
        sock = placement.context().socket(zmq.DEALER)  # its I/O threads start now
        zmq_threads = _affinity_of_new_threads(before, "ZMQbg")
        moved = placement.place()
        late = threading.Thread(target=stop.wait, name="ngram-prefault")
        late.start()
        seen.update(moved=moved, zmq=zmq_threads, late_before=os.sched_getaffinity(late.native_id),
                    helpers={t.name: os.sched_getaffinity(t.native_id) for t in helpers})
        seen["moved_later"] = placement.place()
        seen["late"] = os.sched_getaffinity(late.native_id)
        seen["again"] = placement.place()  # nothing new: nothing moved twice
        sock.close(linger=0)
        placement.close()
        stop.set()

    t = threading.Thread(target=engine)
    t.start()
    t.join()
    rest = cpus - {first}
    assert seen["helpers"] == {"ngram-link": rest, "other": {first}}
    assert seen["moved"] >= 1 and seen["moved_later"] == 1 and seen["again"] == 0
    assert seen["late_before"] == {first} and seen["late"] == rest
    io = {name: a for name, a in seen["zmq"].items() if name.startswith("ZMQbg")}
    assert io and all(a == rest for a in io.values()), seen["zmq"]


def test_no_placement_changes_nothing():
    p = HelperPlacement(None)
    assert p.context() is None and p.place() == 0
    p.close()
