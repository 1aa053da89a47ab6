"""The hot tier: what is worth a draft, as slot tables in shared memory that every generator
on the host drafts from in-process (ARCHITECTURE §4).  Fast (a few µs a draft) and partial; it
is chosen from the cold tier and rebuilt as the table changes.

Doors (what the rest of ``ngramd`` and the generator may import; ``tests/test_layering.py``
holds to them):

* ``shm``: the transport readers use (``HotReader``, the in-place ``RecentTable``);
* ``segments``: shared memory's files (names, the segment header, ``HotPublisher``; numpy only);
* ``image``: the hot tier's image on disk (``start_publisher`` serves it before numba loads);
* ``selection``: what is hot (``build_hot``, ``HitCounts``, ``HotSizing``, ``RebuildBudget``);
* ``cycle``: ``HotCycle``, the hot tier's life in the daemon (rank, publish, write the image).

Inside: ``curve`` (the hot-size curve, run by the cycle).  This ``__init__`` imports nothing:
the generator loads ``shm`` and ``segments`` without the daemon's heavier modules.
"""
