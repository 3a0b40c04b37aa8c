"""`python -m batchgen` runs the CLI."""

from batchgen.cli.entry import main

main()
