"""``python -m zoopick``: the ``zoopick`` command."""

from zoopick.cli import main

main()
