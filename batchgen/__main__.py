"""`python -m batchgen` runs the CLI."""

from batchgen.cli import main

main()
