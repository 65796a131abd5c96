"""The fault suite (docs/reliability.md): a package, so its conftest does not shadow tests/conftest.py."""
