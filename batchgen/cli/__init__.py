"""The ``batchgen`` command line: the Typer app (``app``), one module per command group, and the console entry.

Importing this package imports nothing heavy; ``batchgen.cli.app`` pulls in torch and transformers.
"""
