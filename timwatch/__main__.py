"""``python -m timwatch``: the same program as the ``timwatch`` command."""

from .cli import main

main()
