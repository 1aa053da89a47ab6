"""The contract below the daemon and its clients: what both sides of the wire must agree on.

``ngramd`` (the daemon), ``ngram_client`` and ``ngram_generator`` all import this package;
it imports none of them, nor numba or RocksDB (tests/test_layering.py checks every import):

* ``constants`` -- constants of the formats and the protocol (hash, slot, tiers);
* ``errors`` -- the stable error codes and their exceptions;
* ``validate`` -- token ids, offsets and per-order thresholds, checked where they arrive;
* ``rules`` -- the drafting rules every drafter of a table agrees on, and their defaults;
* ``identity`` (with ``gguf``) -- what a table records (orders, K, vocab size, the
  tokenizer's fingerprint) and how a tokenizer is named and fingerprinted;
* ``curve`` -- CurveZMQ key files, and the keys a client socket uses;
* ``settings`` -- settings files: TOML read into a frozen dataclass with every key checked
  (the daemon's config and the vLLM proposer's);
* ``protocol`` -- the frames of a request and a reply;
* ``commands`` -- every op declared once: its fields, its request (``message``) and the
  client's value of its reply (``decode``).  What the daemon does for an op is its handler in
  ``ngramd/handlers.py``;
* ``corpus`` and ``progress`` -- what ``ngramd warm`` and ``ngram-client ingest`` agree on
  about a corpus (which files, how text is decoded), and the wait lines both command lines
  print.

This file imports nothing: ``import ngramd.wire.protocol`` loads what it needs and no more.
"""
