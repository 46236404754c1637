"""The OpenAI-compatible HTTP server: server.py (the socket and the uvicorn server), app.py (the Starlette app
over one model), api.py (the wire format). Starlette and uvicorn come with the `serve` extra; nothing here
imports them unless a server is made. The command is cli/serve.py. loadgen.py and loadclient.py are the other
side: `bench --url`'s clients, which load any OpenAI-compatible server (standard library only)."""
