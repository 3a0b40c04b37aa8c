"""Pass-through columns held as JSON text: their JSONL values share no one Arrow type."""

from __future__ import annotations

import pyarrow as pa

# Field metadata of a pass-through column stored as JSON text: its JSONL values share no one Arrow type (a number
# and a string; objects whose members differ in type: batchgen.io.passthrough.SchemaInference).
JSON_TEXT_METADATA = {b"batchgen_encoding": b"json"}


def is_json_text(field: pa.Field) -> bool:
    """Whether pass-through ``field`` holds its values as JSON text (:data:`JSON_TEXT_METADATA`)."""
    metadata = field.metadata or {}
    return all(metadata.get(key) == value for key, value in JSON_TEXT_METADATA.items())
