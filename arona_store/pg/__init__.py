"""The memory store on PostgreSQL with pgvector (``ARONA_STORE_DATABASE_URL``).

:mod:`arona_store.pg.schema` holds its tables and their migrations.
"""
