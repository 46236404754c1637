"""What a model is, apart from any backend: config.py (ModelConfig: the metadata keys), base.py (the per-layer
plan), block.py (the layer written once: each plan as a program of operations, and run(), its eager
executor), arch/ (one module per architecture), weights.py (the tensors it needs), rope.py (RoPE tables), moe.py
(expert routing), kv_cache.py (the KV cache's types and rings)."""
