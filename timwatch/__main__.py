"""``python -m timwatch``: the same program as the ``timwatch`` command."""

from timwatch.cli import main

main()
