"""HTTP routes: REST (OpenAI-compatible chat completions, models, conversations, health), the
OpenAI routes passed through to a backend, JSON-RPC, and the console's files."""
