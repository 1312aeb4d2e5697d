"""`python -m bivit ...` is the `bivit` command."""

from .cli import main

main()
