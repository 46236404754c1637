"""Model names -> files: registry.py (models.toml, resolve/pull/rm; entry.py: one model's table), cache.py (the
cache and its locks), sources.py (a model's sources tried in order) over download.py, hf_download.py and pypi.py
(bounded, verified, resumable downloads), sizes.py (the sizes `llamacli models` shows)."""
