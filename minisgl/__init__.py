"""minisgl: a compact, readable and fast LLM inference engine and server."""

__version__ = "0.1.0"
