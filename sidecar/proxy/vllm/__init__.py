"""The vLLM proxy: its app, answer edits, capture and wire adapter."""
