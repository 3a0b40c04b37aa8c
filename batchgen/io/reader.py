"""Stream input rows from a dataset of JSON Lines, Parquet or Arrow shards (:mod:`batchgen.io.shards`), mapped by the
column options (:mod:`batchgen.io.columns`); the pass-through fields: :mod:`batchgen.io.passthrough`."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchgen.errors import BatchgenError, RowError
from batchgen.io.columns import ColumnMapping
from batchgen.io.input_options import InputOptions
from batchgen.io.input_row import FieldPlace, InputRow
from batchgen.io.json_text import JSON_TEXT_METADATA
from batchgen.io.jsonl_rows import count_jsonl_rows, jsonl_rows
from batchgen.io.openai_batch import OpenAIBatchInput, is_openai_batch_line
from batchgen.io.passthrough import (
    KNOWN_FIELDS,
    READ_AND_PASSED,
    SchemaInference,
    passthrough_names,
    table_column_problem,
)
from batchgen.io.shards import list_shards
from batchgen.io.table_shards import table_batches, table_num_rows, table_schema, unified_schema

__all__ = ["InputRow", "RowReader", "count_input_rows"]


class RowReader:
    """Stream the rows of a dataset, shard after shard, one block at a time: a ``.jsonl``/``.json`` (JSON Lines),
    ``.parquet`` or ``.arrow`` file, or a directory or glob of such shards (:func:`batchgen.io.shards.list_shards`).

    Iterating yields :class:`InputRow` for each row and :class:`RowError` (yielded, not raised) for each JSONL line
    that is not a JSON object; such lines still use up a row index, so later default ids do not shift. Row indices
    continue across shards; each row names its shard (``InputRow.source``). The reader can be iterated more than
    once; each pass re-reads the files.

    ``passthrough_schema`` is known as soon as the constructor returns: it holds every input field that is not a
    known field (``id``, the prompt and sampling fields and their aliases), all nullable, under the names
    ``passthrough_names`` gives them (a field named like an output column, ``text`` or ``error``, is renamed
    ``input_<name>``; see :func:`passthrough_names`), as in :func:`batchgen.io.rows.parse_row`'s result. For
    Parquet and Arrow the types come from the shards' schemas, which must unify. For JSONL they are inferred from
    every row, across shards, read once more before the rows are streamed (:class:`SchemaInference`: a field any
    row has gets a column; values that share no one type make it a column of their JSON text). The source columns
    of the column options stay pass-through fields. A JSONL dataset whose first row is an OpenAI Batch request
    line is an OpenAI Batch file (``openai``): each line is read as the batchgen row
    :mod:`batchgen.io.openai_batch` maps it to, before the schema is inferred.

    Args:
        path: the dataset; ``str(path)`` is its name in messages about the whole dataset.
        block_rows: rows per read block (Parquet, Arrow) and per block of the JSONL schema's inference.
        options: the column options (default: none given; a ``conversations`` column is still read as messages
            when the dataset has no prompt field).

    Raises:
        BatchgenError: ``options`` break their rules (:meth:`InputOptions.validate`); :func:`list_shards`' errors; a
            shard is unreadable or not valid Parquet/Arrow; the dataset has no rows; (JSONL) it looks like a JSON
            document instead of JSON Lines; (Parquet/Arrow) a shard repeats a column, or two shards give a column
            types that do not unify; :class:`ColumnMapping`'s errors; column options for an OpenAI Batch file;
            (while iterating too) a file mixing OpenAI Batch lines with batchgen rows.
        ValueError: ``block_rows`` < 1.
    """

    source: str
    options: InputOptions
    passthrough_schema: pa.Schema
    passthrough_names: dict[str, str]  # pass-through field → its column (:func:`passthrough_names`)
    openai: OpenAIBatchInput | None = None  # set for an OpenAI Batch file (:mod:`batchgen.io.openai_batch`)
    # JSONL: each field's first row and how many rows have it, for messages about a field (Parquet: none, every row
    # has every column).
    field_places: dict[str, FieldPlace]

    def __init__(self, path: Path, block_rows: int = 1024, options: InputOptions | None = None) -> None:
        if block_rows < 1:
            raise ValueError(f"block_rows must be >= 1, got {block_rows}")
        self.path = Path(path)
        self.source = str(path)
        self.block_rows = block_rows
        self.shards = list_shards(self.path)
        self.options = options or InputOptions()
        self.options.validate()
        self.field_places = {}
        # A lone file is named as the user gave it; a shard by its path.
        self._names = [self.source] if self.shards.root is None else [str(p) for p in self.shards.paths]
        jsonl = self.shards.format == "jsonl"
        columns = self._init_jsonl() if jsonl else self._init_table()
        # The columns of every shard: a column one shard has is the dataset's.
        self.mapping = ColumnMapping(self.options, columns, self.source)

    def __iter__(self) -> Iterator[InputRow | RowError]:
        items = self._iter_jsonl() if self.shards.format == "jsonl" else self._iter_table()
        for item in items:
            yield self._mapped(item)

    def _mapped(self, item: InputRow | RowError) -> InputRow | RowError:
        if isinstance(item, RowError) or not self.mapping.active:
            return item
        data, columns, problem = self.mapping.apply(item.data)
        return replace(item, data=data, columns=columns, problem=problem)

    @property
    def index_ids(self) -> bool:
        """Whether a row without an id takes its index as id: not where ids come from a column (``--id-column``, an
        OpenAI Batch file's ``custom_id``), whose rows' indexes may be other rows' ids."""
        return self.options.id_column is None and self.openai is None

    # --- JSON Lines -------------------------------------------------------------------------------------

    def _init_jsonl(self) -> list[str]:
        """Read every row once for the pass-through schema (:class:`SchemaInference`); return the dataset's
        columns (every field of every row, in order of first appearance)."""
        self._kind_known = False  # whether the first JSON object has said if this is an OpenAI Batch file
        inference = SchemaInference()
        block: list[dict[str, Any]] = []
        empty = True
        rows_with: Counter[str] = Counter()
        for item in self._iter_jsonl():
            empty = False
            if isinstance(item, InputRow):
                block.append(item.data)
                rows_with.update(item.data.keys())
                if len(rows_with) > len(self.field_places):  # a field no row before had
                    for key in item.data.keys() - self.field_places.keys():
                        self.field_places[key] = FieldPlace(item.source, item.line, 0)
            if len(block) == self.block_rows:
                inference.add(block)
                block = []
        if empty:
            raise BatchgenError(f"{self.source}: dataset is empty")
        inference.add(block)
        for key, place in self.field_places.items():
            self.field_places[key] = place._replace(rows=rows_with[key])
        # An OpenAI Batch file's tools are a request's, not data: its output lines, and its rows, leave them out.
        keys = [key for key in inference.keys if key not in READ_AND_PASSED] if self.openai else inference.keys
        self.passthrough_names = passthrough_names(keys)
        rows_again = lambda: (item.data for item in self._iter_jsonl() if isinstance(item, InputRow))  # noqa: E731
        self.passthrough_schema = inference.schema(self.passthrough_names, rows_again)
        return list(inference.keys)

    def _iter_jsonl(self) -> Iterator[InputRow | RowError]:
        index = 0
        for path, name in zip(self.shards.paths, self._names):
            for item in jsonl_rows(path, name, index):
                index += 1
                yield self._openai_row(item)

    def _openai_row(self, item: InputRow | RowError) -> InputRow | RowError:
        """``item`` as batchgen reads it: unchanged, or an OpenAI Batch line mapped onto batchgen's fields (a line
        asking for what batchgen cannot do gets the field and message as its ``problem``).

        Raises:
            BatchgenError: a file mixing OpenAI Batch lines with batchgen rows.
        """
        # Column options describe a dataset's own columns: its url, body or custom_id are no request's.
        if isinstance(item, RowError) or self.options.maps_prompt or self.options.id_column is not None:
            return item
        if not self._kind_known:
            self._kind_known = True
            if is_openai_batch_line(item.data):
                self.openai = OpenAIBatchInput()
        if self.openai is None:
            if is_openai_batch_line(item.data):
                raise BatchgenError(
                    f"{item.source}:{item.line}: an OpenAI Batch request line, but the file's first row is not one; "
                    "a file holds one kind of row"
                )
            return item
        return self.openai.row(item)

    # --- Parquet and Arrow ------------------------------------------------------------------------------

    def _init_table(self) -> list[str]:
        fmt = self.shards.format
        schemas = []
        for path, name in zip(self.shards.paths, self._names):
            schema = table_schema(path, fmt)
            repeated = sorted({n for n in schema.names if schema.names.count(n) > 1})
            if repeated:
                raise BatchgenError(f"{name}: column '{repeated[0]}' appears more than once; rename all but one")
            schemas.append((name, schema))
        schema = unified_schema(schemas)
        if not any(table_num_rows(path, fmt) for path in self.shards.paths):
            raise BatchgenError(f"{self.source}: dataset is empty")
        self.passthrough_names = passthrough_names(schema.names)
        fields: dict[str, pa.Field] = {}
        for field in schema:
            if field.name in KNOWN_FIELDS:
                continue
            name = self.passthrough_names[field.name]
            problem = table_column_problem(field.type)
            if problem is not None:
                raise BatchgenError(f"{self.source}: column '{field.name}' {problem}")
            # Nullable: rows that fail still get an output row, with nulls for their pass-through fields. A
            # column of an earlier output marked JSON text is plain text here: its values are not encoded again.
            metadata = {k: v for k, v in (field.metadata or {}).items() if k not in JSON_TEXT_METADATA}
            fields[name] = field.with_name(name).with_nullable(True).with_metadata(metadata)
        self.passthrough_schema = pa.schema(list(fields.values()))
        return list(schema.names)

    def _iter_table(self) -> Iterator[InputRow | RowError]:
        index = itertools.count()
        for path, name in zip(self.shards.paths, self._names):
            line = 0
            for batch in table_batches(path, self.shards.format, self.block_rows):
                for row in batch.to_pylist():
                    line += 1
                    data = {k: v for k, v in row.items() if v is not None}
                    yield InputRow(index=next(index), line=line, data=data, source=name, struct_nulls=True)


def count_input_rows(path: Path) -> int:
    """Rows in the dataset, all its shards (non-blank JSONL lines; Parquet metadata; Arrow batch lengths), streaming,
    for progress and status.

    Raises:
        BatchgenError: the dataset cannot be read.
    """
    shards = list_shards(path)
    total = 0
    for shard in shards.paths:
        if shards.format != "jsonl":
            total += table_num_rows(shard, shards.format)
            continue
        try:
            total += count_jsonl_rows(shard)
        except OSError as e:
            raise BatchgenError(f"{shard}: cannot read: {e.strerror or e}") from None
    return total
