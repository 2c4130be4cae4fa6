"""Sources of docs/reference/: page templates (``*.md`` with ``@@name@@`` markers), the
hand-written tables (tables.py) and the builders that fill the markers from the code."""
