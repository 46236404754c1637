"""The package's version (pyproject.toml's), which `llamacli --version` prints and downloads send in their
User-Agent; llamacli.__version__ is this one."""

__version__ = "0.1.0"
