"""The OpenAI-compatible HTTP server: app.py (the Starlette app over one model), api.py (the wire format).
Starlette and uvicorn come with the `serve` extra; nothing here is imported unless the server runs."""
