"""The memory store: a Philia-compatible WebSocket JSON-RPC server (``arona-gateway store``, and
the store ``up`` embeds) that keeps memories in SQLite, or in PostgreSQL with pgvector
(``ARONA_STORE_DATABASE_URL``, any number of store processes over one database), and recalls them
by a hybrid ranking of words (tantivy), context and meaning (an embedding model on the CPU, the
vectors in memory or in pgvector). It imports nothing of the gateway's layers, only the ground floor
(:mod:`arona_common`).

- :mod:`arona_store.base`: ``StoreBase``, the write and recall entry points, the model and the
  ranking every backend shares.
- :mod:`arona_store.pg`: the backend on PostgreSQL with pgvector.
- :mod:`arona_store.store`: ``MemoryStore``, nodes in SQLite, recalled by words, context and
  meaning; its parts: :mod:`~arona_store.nodes`, :mod:`~arona_store.schema`,
  :mod:`~arona_store.writes`,
  :mod:`~arona_store.words`, :mod:`~arona_store.cjk`, :mod:`~arona_store.scoring`,
  :mod:`~arona_store.context`, :mod:`~arona_store.lexical`, :mod:`~arona_store.hybrid` and
  :mod:`~arona_store.floor`.
- :mod:`arona_store.retrieval`: the boundary between the ranking and the engines that walk the
  whole store (the word index, the node table), with :mod:`arona_store.retrieval.fts5` over
  SQLite behind it.
- :mod:`arona_store.server`: ``StoreServer`` and ``serve_forever``, the ``/ws`` endpoint; the
  calls it takes (params, results, sessions) in :mod:`arona_store.calls`.
- :mod:`arona_store.jsonrpc`: JSON-RPC 2.0 envelope validation and reply frames.
- :mod:`arona_store.ranking`: which ranking runs (``ARONA_STORE_RANKING``: lexical or hybrid).
- :mod:`arona_store.embedding`, :mod:`arona_store.vectors`: the sentence-embedding model and the
  in-memory vector index of the hybrid ranking (the ``semantic`` extra; ``RANKING.md``).

Nothing is imported here, so importing the package costs nothing.
"""
