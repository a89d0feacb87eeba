"""The package version (pyproject.toml names the same; tests/test_server.py checks they agree)."""

__version__ = "0.1.0"
