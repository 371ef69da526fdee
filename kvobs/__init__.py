"""kvobs: per-turn diagnosis of vLLM P/D serving with bidirectional KV transfer."""

__version__ = "0.1.0"
