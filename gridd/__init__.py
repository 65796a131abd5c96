"""gridd: load-aware, cross-site router for LLM inference fleets."""

__version__ = "0.1.0"
