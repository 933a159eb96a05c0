"""dgemma serve: the Ollama- and OpenAI-compatible REST server (FastAPI app, scheduler, routes, security)."""
