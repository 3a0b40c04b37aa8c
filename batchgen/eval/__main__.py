"""``python -m batchgen.eval ARGS``: lm-eval's command line (``lm_eval ARGS``) with ``--model batchgen``
registered; a batchgen error (a bad model or option in ``--model_args``) is one line on stderr and exit code 2."""

from __future__ import annotations

import sys

from lm_eval.__main__ import cli_evaluate

from batchgen.errors import BatchgenError
from batchgen.eval import BatchgenLM  # noqa: F401  (the import registers it)


def main() -> None:
    try:
        cli_evaluate()
    except BatchgenError as e:
        print(f"batchgen: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
