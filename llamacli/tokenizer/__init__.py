"""Tokenizers from a GGUF's tokenizer.ggml.* metadata: tokenizer.py (Tokenizer, StreamDecoder) over the BPE
(bpe.py) and SentencePiece (spm.py) vocabularies; text_chunks.py cuts long texts and special tokens out."""
