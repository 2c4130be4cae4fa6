"""The SGLang proxy: its app, wire format, answer and stream capture, prefill probe."""
