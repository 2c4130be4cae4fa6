"""Compiled reads of JSON bytes shared by both proxies: spans, log-prob lists, numbers."""
