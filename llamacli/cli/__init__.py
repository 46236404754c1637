"""The command line: app.py (the typer app, shared options, model loading, main), the commands in generate.py
(generate, chat, run), models.py (inspect, models, pull, rm, tokenize, bench) and serve.py, parser.py
(llama.cpp-style options), chat_repl.py (the interactive loop), inspect.py (what `inspect` shows)."""
