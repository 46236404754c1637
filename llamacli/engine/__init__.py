"""Running a model: generate.py (Model: load,
tokenize, the decode loop, streaming; llamacli.load), chat_session.py (a conversation over the KV cache),
bench.py (`llamacli bench`'s measurements)."""
