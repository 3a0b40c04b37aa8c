"""``batchgen.ray.Predictor``: a batchgen engine as the callable class that ``ray.data.Dataset.map_batches`` runs
on a pool of actors, in a Ray pipeline of your own (docs/scale-out.md)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from batchgen.api.generator import Generator
from batchgen.api.options import check_option_names, option_names
from batchgen.io.input_options import InputOptions
from batchgen.io.writer import OUTPUT_COLUMNS
from batchgen.job.options import JobOptions
from batchgen.loop.options import EngineOptions
from batchgen.sampling.sampling_params import SamplingParams


class Predictor:
    """Loads one engine per Ray actor; maps a batch of rows to the same rows plus batchgen's output columns, a row
    per sample (a row's ``n`` samples one after another)::

        ds.map_batches(Predictor, fn_constructor_kwargs={"model": "...", "max_new_tokens": 64},
                       concurrency=2, num_gpus=1).write_parquet("out/")

    A batch's rows are what a JSONL row holds (``prompt`` or ``messages`` or ``prompt_token_ids``, ``id``,
    sampling fields such as ``temperature``), or the columns the column options name (``prompt_column``...).
    The output columns are ``batchgen.io.writer.OUTPUT_COLUMNS`` (``id`` a string, ``text``, ``output_token_ids``,
    ``finish_reason``, ``error``...); an input column of the same name is kept as ``input_<name>`` (``id``
    is replaced, as in a ``batchgen run`` output).

    Args:
        model: what ``--model`` takes.
        on_error: ``skip`` (default): a bad row gets an output row with ``finish_reason`` ``"error"`` and its
            message in ``error``; ``fail``: a bad row fails the batch (and Ray's job).
        **options: engine options, sampling defaults and column options by their Python names, as
            :class:`batchgen.Generator` and its ``generate`` take them.

    Raises (from the constructor):
        TypeError: an option ``batchgen run`` does not have, named.
        BatchgenError: a bad option value (``on_error`` too), or a model that cannot be loaded.
    """

    def __init__(self, model: str, *, on_error: str = "skip", **options: Any) -> None:
        check_option_names(options, (EngineOptions, SamplingParams, InputOptions), type(self).__name__)
        JobOptions(on_error=on_error).validate()
        per_call = option_names(SamplingParams, InputOptions)
        self.generator = Generator(model, **{k: v for k, v in options.items() if k not in per_call})
        self.on_error = on_error
        self.sampling = {k: v for k, v in options.items() if k in per_call}

    def __call__(self, batch: pa.Table | Any) -> pa.Table:
        """The output rows of ``batch`` (a ``pyarrow.Table``, a ``pandas.DataFrame`` or a dict of NumPy arrays:
        each ``batch_format`` of ``map_batches``).

        Raises:
            RowError: ``on_error="fail"`` and a bad row.
        """
        table = _as_table(batch)
        rows = [{k: v for k, v in row.items() if v is not None} for row in table.to_pylist()]
        results = self.generator.generate(rows, on_error=self.on_error, **self.sampling)
        # Results come in input order, a row's samples together; a row's first is sample 0 (None: an error row).
        source, index = [], -1
        for result in results:
            index += result["sample_index"] in (0, None)
            source.append(index)
        kept = table.take(pa.array(source, pa.int64())) if results else table.slice(0, 0)
        outputs = OUTPUT_COLUMNS.names
        kept = kept.drop_columns(["id"]) if "id" in kept.column_names else kept
        kept = kept.rename_columns([f"input_{n}" if n in outputs else n for n in kept.column_names])
        generated = pa.Table.from_pylist([{n: r.get(n) for n in outputs} for r in results], schema=OUTPUT_COLUMNS)
        for field, column in zip(generated.schema, generated.columns):
            kept = kept.append_column(field, column)
        return kept


def _as_table(batch: Any) -> pa.Table:
    if isinstance(batch, pa.Table):
        return batch
    if isinstance(batch, dict):
        # from_pandas: Ray's NumPy batches hold a missing value as NaN, which Arrow then reads as null.
        return pa.table({name: pa.array(list(values), from_pandas=True) for name, values in batch.items()})
    return pa.Table.from_pandas(batch, preserve_index=False)
