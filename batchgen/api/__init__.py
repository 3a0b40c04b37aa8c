"""The Python API: :class:`batchgen.Generator` (rows in memory) and :func:`batchgen.run` (a dataset file), over
the engine and the job that ``batchgen run`` uses (docs/python.md)."""
