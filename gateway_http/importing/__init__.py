"""``arona-gateway import``: chat history (OpenAI messages, JSON lines) into memory.

``lines`` is the file's format, ``ledger`` the progress file that makes a run resumable,
``display`` the progress bar, ``run`` the import itself through the gRPC ``MemoryService``.
"""

from gateway_http.importing.run import import_command, run_import

__all__ = ["import_command", "run_import"]
