"""The cold tier: every row of the table with full counts, in RocksDB, and the durable ingest
log beside it (ARCHITECTURE §5).  Slow (µs to ms a read) and complete; the hot tier is chosen
from it.

Doors (what the rest of ``ngramd`` may import; ``tests/test_layering.py`` holds to them):

* ``store``: ``ColdStore``, the façade that owns the parts below, its watermarks and locks;
  its parts are reached through it (``cold.log``, ``cold.runs``, ``cold.reader``,
  ``cold.policies``);
* ``rows``: row sets, the array algebra the hot tier ranks and the warm-up runs;
* ``runs``: the page format, for the table's kernel warm-up.

Inside: ``log`` (the log's records and quarantine) over ``ingestlog`` (its files), ``reader``
(every read), ``bulk`` (the offline bulk load), ``rocks`` (RocksDB's handles and meta keys),
``sstwriter`` (the helper process that writes runs' files), ``policies`` (generators' policy
states).  This ``__init__`` imports nothing: importing one module loads no other.
"""
