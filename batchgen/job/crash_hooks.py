"""TEST HOOKS ONLY: let a test kill a run at an exact point, as ``kill -9`` would, to check that it resumes.

``BATCHGEN_TEST_CRASH_AFTER_ROWS=N``: the process dies once it has finished N rows (samples) since it started.
``BATCHGEN_TEST_CRASH_IN_FLUSH=N``: it dies while writing its N-th part file, with half of it written.
The process ends with ``os._exit(137)``: no ``finally`` block, no flush, no cleanup runs, like a SIGKILL.
Unset (always, outside tests), each hook costs one environment lookup.
"""

from __future__ import annotations

import os

CRASH_AFTER_ROWS = "BATCHGEN_TEST_CRASH_AFTER_ROWS"
CRASH_IN_FLUSH = "BATCHGEN_TEST_CRASH_IN_FLUSH"

_counts: dict[str, int] = {}


def crash_point(variable: str) -> None:
    """Count one event of kind ``variable``; die like ``kill -9`` when the count reaches the variable's value."""
    limit = os.environ.get(variable)
    if limit is None:
        return
    _counts[variable] = _counts.get(variable, 0) + 1
    if _counts[variable] >= int(limit):
        os._exit(137)
