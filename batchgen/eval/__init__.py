"""lm-evaluation-harness backend (docs/evaluation.md): ``import batchgen.eval`` registers ``--model batchgen``
(:class:`BatchgenLM`) in lm-eval's model registry, for ``lm_eval.simple_evaluate(model="batchgen", ...)``;
``python -m batchgen.eval ARGS`` is lm-eval's command line with it registered.

lm-eval 0.4 finds models only in its own registry, filled by imports (it reads no entry points): this import is
the registration. It needs the ``eval`` extra (``pip install "batchgen[eval]"``).
"""

from __future__ import annotations

try:
    # lm-eval fills its registry with its own models only when it finds the registry empty: filled first, here,
    # they stay found beside batchgen (``--model hf`` in the same process).
    import lm_eval.models  # noqa: F401
except ImportError:
    raise ImportError('batchgen.eval needs lm-eval: pip install "batchgen[eval]"') from None

from batchgen.eval.lm import BatchgenLM

__all__ = ["BatchgenLM"]
