"""The manifest of a partial output directory: the job's output schema (exact, with the metadata that identifies
the job) and a checksum of its own content, so a damaged manifest is detected rather than trusted."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import pyarrow as pa

_FORMAT = "batchgen partial output"


def encode_manifest(schema: pa.Schema) -> bytes:
    """The manifest's bytes: the schema (exact, base64 of its IPC form), its metadata readable, and a checksum."""
    metadata = {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()}
    body = {
        "format": _FORMAT,
        "version": 1,
        "schema": base64.b64encode(schema.serialize().to_pybytes()).decode(),
        "metadata": metadata,
    }
    checksum = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    return json.dumps({**body, "sha256": checksum}, indent=1, sort_keys=True, ensure_ascii=False).encode()


def decode_manifest(data: bytes) -> pa.Schema:
    """The schema recorded by :func:`encode_manifest`.

    Raises:
        ValueError: not a manifest, or its checksum does not match its content.
    """
    try:
        body = json.loads(data)
        checksum = body.pop("sha256")
        if hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest() != checksum:
            raise ValueError("checksum mismatch")
        if body["format"] != _FORMAT or body["version"] != 1:
            raise ValueError(f"unknown format {body['format']!r} version {body['version']!r}")
        return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(body["schema"], validate=True)))
    except (ValueError, KeyError, TypeError, AttributeError, pa.ArrowException) as e:  # ValueError: JSON, base64
        raise ValueError(f"not a manifest: {e}") from None


def read_manifest(path: Path) -> tuple[pa.Schema | None, bool]:
    """(schema, damaged): ``(None, False)`` when there is no manifest (a crash before it was first written)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, False
    try:
        return decode_manifest(data), False
    except ValueError:
        return None, True
