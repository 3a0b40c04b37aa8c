"""Ray Data pipelines of your own (docs/scale-out.md; the ``ray`` extra): :class:`Predictor`, a batchgen engine for
``Dataset.map_batches``. ``batchgen run --ray`` runs on :mod:`batchgen.job.ray_rounds` and
:mod:`batchgen.job.ray_replica`."""

from batchgen.ray.predictor import Predictor

__all__ = ["Predictor"]
