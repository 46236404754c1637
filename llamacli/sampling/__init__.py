"""Choosing the next token: sampling.py (penalties, top-k, top-p, min-p, temperature; seeded; its settings,
SamplingParams, in params.py, which does not load numpy) and
structured.py (constraints that mask the logits to what keeps the output valid). Below the backends, which
sample on the device with the same semantics."""
