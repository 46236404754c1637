"""Model names -> files: registry.py (models.toml, resolve/pull/rm), cache.py (the cache and its locks),
download.py, hf_download.py and pypi.py (bounded, verified, resumable downloads), sizes.py (the sizes
`llamacli models` shows)."""
