"""llamacli: GGUF language models on NVIDIA GPUs from readable Python."""

__version__ = "0.1.0"
