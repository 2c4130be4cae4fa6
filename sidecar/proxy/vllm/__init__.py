"""The vLLM proxy: its app, answer edits and capture."""
