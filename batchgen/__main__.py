"""`python -m batchgen` runs the CLI."""

from batchgen.entry import main

main()
