"""GGUF files: file.py opens and validates one (the bounded header walk, tensors read on demand; cursor.py
reads the header's values), metadata.py reads its metadata values and keeps arrays compact, ggml_types.py
the tensor and value types' numbers, quants.py dequantizes tensors with gguf.quants. (Named ggufio, not gguf:
quants.py imports the PyPI package `gguf`.)"""
