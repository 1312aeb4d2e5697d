"""`python -m bivit.cli ...` is the `bivit` command."""

from . import main

main()
