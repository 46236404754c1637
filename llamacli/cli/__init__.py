"""The command line: app.py (the typer app, shared options, model loading, main), the commands in generate.py
(generate, chat, run), models.py (inspect, models, pull, rm, tokenize, bench), serve.py and ps.py (ps, stop: the models --keep-alive keeps loaded;
keep_alive.py the hand-off, resident.py the server it starts, rendezvous.py where the two meet), parser.py
(llama.cpp-style options), chat_repl.py (the interactive loop), inspect.py (what `inspect` shows).

A command module registers its commands on `app` when it is imported (it takes `command` and the shared
options from app.py); importing the package imports them all, so `main` here runs the whole CLI.
"""

from . import generate, models, ps, serve  # noqa: F401 (registers their commands)
from .app import app, main

__all__ = ["app", "main"]
