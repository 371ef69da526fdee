"""kvobs: per-turn diagnosis of vLLM P/D serving with bidirectional KV transfer."""

__all__ = ["__version__"]

__version__ = "0.1.0"
