"""Array-in, array-out kernels of the n-gram table, one module a topic.

Everything on the hot path lives here as plain numba functions over numpy arrays, so that the
daemon, every ``HotReader`` in a generator process, the request-local table and the tests all
run the very same code.  Classes elsewhere only own resources (segments, databases, sockets).

=============  ==================================================================================
``hashing``    the key hash of a context (the one mix every process computes), the context window
``slots``      the 32-byte slot; building, probing, reading and checksumming slot tables
``local``      the request-local table a generator counts its request into
``recent``     the recent table the daemon's writer counts into, in place
``drafting``   ``draft``, the one drafting kernel, and the layout of its inputs and outputs
``batch``      ``draft_rows``: an engine step's rows in one call, each with its own first table
``refine``     the daemon's cold refine: keys a cold read could add, the warm cache
``topk``       candidate lists: the best k next tokens by count, merged and saturating
``count``      counting events of a batch of sequences into rows
``rowset``     row sets: their layout, merges, lookups and slices
``pages``      the on-disk page form of a row set
``bloom``      blocked Bloom filters (the pruned-key filter, the runs' filters)
``rank``       the hot build's ranking
``cachekey``   numba's cache stamped with the whole package's sources (why a split is safe)
=============  ==================================================================================

Callers import what they use from the topic modules.  The format constants (tiers, slot
size, ``HOT_K``, ``EMPTY_TOKEN`` ...) live in ``ngramd/wire/constants.py``, the one place both
the daemon and its clients read them.  Only the names every drafter uses together are
re-exported here: ``draft``, ``draft_out``, the empty table and filter they default to, and
the tier ids ``draft`` reports.  The kernel's ``source`` tuple is built in one place,
``ngramd.drafttiers.DraftTiers``.
"""

from . import cachekey  # noqa: F401 (first: numba must stamp every kernel below with the package)
from ..wire.constants import TIER_COLD, TIER_HOT, TIER_LOCAL, TIER_RECENT
from .drafting import NO_FILTER, draft, draft_out
from .slots import EMPTY_SLOTS

__all__ = ["EMPTY_SLOTS", "NO_FILTER", "TIER_COLD", "TIER_HOT", "TIER_LOCAL", "TIER_RECENT",
           "draft", "draft_out"]
