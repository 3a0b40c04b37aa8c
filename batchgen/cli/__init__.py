"""The ``batchgen`` command line: the Typer app (``app``), one module per command group, and the console entry.

Importing this package imports nothing heavy; ``batchgen.cli.app`` pulls in torch and transformers.
"""

from batchgen import __version__


def version_line() -> str:
    """What ``batchgen --version`` prints."""
    return f"batchgen {__version__}"
