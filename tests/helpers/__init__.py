"""Test helpers: models built for the tests, the CLI run in-process, engine drivers, HF references."""

import os

# Before any helper imports transformers: huggingface_hub reads it once, at import.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
