"""The files of a dataset: one file, a directory of shards, a glob of shards (expanded here, so a quoted pattern works
on any shell), or a Hugging Face ``save_to_disk`` directory (Arrow shards listed in its ``state.json``)."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from batchgen.errors import BatchgenError

# File suffix → shard format.
SHARD_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
_SUPPORTED = ".jsonl, .parquet or .arrow"
_GLOB_CHARACTERS = "*?["
# Compressed files' suffixes: a directory's x.jsonl.gz is a shard batchgen cannot read, not a file to pass over.
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zstd", ".lz4")


@dataclass(frozen=True)
class Shards:
    """A dataset's files, in reading order.

    Attributes:
        paths: the shard files (a lone file: itself).
        format: ``jsonl``, ``parquet`` or ``arrow`` (Arrow IPC, stream or file format).
        root: the directory the shards' names are taken relative to, in fingerprints (a glob's: the folder before its
            first wildcard); ``None`` for a lone file.
    """

    paths: list[Path]
    format: str
    root: Path | None

    def name(self, path: Path) -> str:
        """``path``'s name relative to :attr:`root` (its full name for a lone file)."""
        return str(path) if self.root is None else os.path.relpath(path, self.root)


def list_shards(dataset: Path) -> Shards:
    """The shards of ``dataset``: a file, a directory (its ``.jsonl``/``.json``/``.parquet``/``.arrow`` files in
    sorted name order; other files, as a README, are not read), a Hugging Face ``save_to_disk`` directory (the
    ``.arrow`` files its ``state.json`` lists, in that order), or a glob pattern (``data/*.parquet``, ``**``
    crossing directories: its files in sorted name order).

    Raises:
        BatchgenError: (one line) no such file, a directory or glob with no shards, shards of two formats, a glob
            matching a file of another format, a link to a file that does not exist, a compressed shard in a
            directory, a ``DatasetDict`` directory (naming its splits), an unreadable ``state.json``, or a lone file
            of an unsupported format.
    """
    source = str(dataset)
    try:
        if dataset.is_dir():
            return _directory_shards(dataset)
        if dataset.exists():
            return Shards([dataset], _format(dataset, source), None)
    except OSError as e:
        raise BatchgenError(f"{source}: cannot read: {e.strerror or e}") from None
    if not any(c in source for c in _GLOB_CHARACTERS):
        raise BatchgenError(f"{source}: no such file")
    matches = [Path(p) for p in glob.glob(source, recursive=True)]
    _check_links(matches)
    paths = sorted(path for path in matches if path.is_file())
    if not paths:
        raise BatchgenError(f"{source}: the pattern matches no file")
    formats = {path: SHARD_FORMATS.get(path.suffix.lower()) for path in paths}
    unsupported = next((path for path, fmt in formats.items() if fmt is None), None)
    if unsupported is not None:
        raise BatchgenError(f"{source}: matches {unsupported}, which is not a {_SUPPORTED} file; narrow the pattern")
    return Shards(paths, _one_format(formats, source), _literal_folder(source))


def _literal_folder(pattern: str) -> Path:
    """The folder a glob ``pattern`` names before its first wildcard (``data`` for ``data/**/*.jsonl``): the root
    its shards are named from, whichever files it matches (their common folder moved when a shard was added beside
    the others, renaming them all in a fingerprint's differences; found by a helper)."""
    parts = Path(pattern).parts
    literal = next(i for i, part in enumerate(parts) if any(c in part for c in _GLOB_CHARACTERS))
    return Path(*parts[:literal]) if literal else Path(".")


def _directory_shards(directory: Path) -> Shards:
    source = str(directory)
    if (directory / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in directory.iterdir() if (p / "state.json").is_file())
        example = directory / (splits[0] if splits else "train")
        raise BatchgenError(
            f"{source}: is a DatasetDict with splits {', '.join(splits) or '(none found)'}; pass one split's "
            f"directory, as {example}"
        )
    state = directory / "state.json"
    if state.is_file():
        try:
            names = [item["filename"] for item in json.loads(state.read_text())["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise BatchgenError(f"{state}: not a Hugging Face dataset state ({e})") from None
        if not names:
            raise BatchgenError(f"{source}: dataset is empty (state.json lists no data files)")
        return Shards([directory / name for name in names], "arrow", directory)
    entries = list(directory.iterdir())
    _check_links(entries)
    for entry in entries:
        if entry.suffix.lower() in _COMPRESSED and Path(entry.stem).suffix.lower() in SHARD_FORMATS:
            raise BatchgenError(f"{entry}: a compressed shard, which batchgen does not read; decompress it")
    paths = sorted(p for p in entries if p.is_file() and p.suffix.lower() in SHARD_FORMATS)
    if not paths:
        raise BatchgenError(f"{source}: the directory holds no {_SUPPORTED} files")
    formats = {path: SHARD_FORMATS[path.suffix.lower()] for path in paths}
    return Shards(paths, _one_format(formats, source), directory)


def _check_links(paths: list[Path]) -> None:
    """Refuse a data file's link to a file that does not exist (a half-downloaded hub snapshot's): its rows would be
    left out unseen (a broken link of another file, as a README, is not read either way)."""
    for path in paths:
        if path.suffix.lower() in SHARD_FORMATS and path.is_symlink() and not path.exists():
            raise BatchgenError(f"{path}: cannot read: a link to {os.readlink(path)}, which does not exist")


def _one_format(formats: Mapping[Path, str | None], source: str) -> str:
    kinds = sorted({fmt for fmt in formats.values() if fmt is not None})
    if len(kinds) > 1:
        first, second = (next(p for p, fmt in formats.items() if fmt == kind) for kind in kinds[:2])
        raise BatchgenError(
            f"{source}: mixes {kinds[0]} and {kinds[1]} shards ({first.name}, {second.name}); pass a glob that picks "
            "one kind, as DIR/*.parquet"
        )
    return kinds[0]


def _format(path: Path, source: str) -> str:
    fmt = SHARD_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise BatchgenError(f"{source}: unsupported input format '{path.suffix.lower()}' (use {_SUPPORTED})")
    return fmt


def is_read_as_shard(dataset: Path, out: Path) -> bool:
    """Whether the output file ``out`` would be read as one of ``dataset``'s shards by a later run (an output
    written into the dataset's directory, or one that its glob would list: asked of ``glob.glob`` itself, which
    follows the pattern through ``..`` and symbolic links as the dataset's listing does, :func:`_listed`)."""
    if out.suffix.lower() not in SHARD_FORMATS:
        return False
    source = str(dataset)
    if dataset.is_dir():
        return out.parent.resolve() == dataset.resolve() and not (dataset / "state.json").exists()
    if dataset.exists() or not any(c in source for c in _GLOB_CHARACTERS):
        return False
    return _listed(out, source)


def reads_part_files(dataset: Path, directory: Path) -> bool:
    """Whether a later run of the glob ``dataset`` could read Arrow files written into ``directory`` (a partial
    output's part files, ``part-<number>-<hex>.arrow``): its folder part reaches ``directory`` and its last name
    could end in ``.arrow`` (a literal end after its last wildcard that ``.arrow`` rules out, as ``*.jsonl``, keeps it
    out; any other may take some part's name)."""
    source = str(dataset)
    if dataset.exists() or not any(c in source for c in _GLOB_CHARACTERS):
        return False  # a directory dataset reads no subfolder
    folder, name = os.path.split(source)
    magic = [i for i, c in enumerate(name) if c in _GLOB_CHARACTERS]
    if not magic:
        return False
    end = name[max(magic) + 1 :].split("]")[-1].lower()  # the literal end after the last wildcard or class
    if not (end.endswith(".arrow") or ".arrow".endswith(end)):
        return False
    return _listed(directory, source) if name == "**" else _names(directory, folder)


def _listed(path: Path, pattern: str) -> bool:
    """Whether ``glob.glob(pattern, recursive=True)`` lists ``path`` (resolved), or would once ``path`` and the
    folders it lacks exist: for a path that exists, glob is asked; else its name is matched as glob matches names
    (fnmatch; wildcards take no leading dot; ``**`` takes any folder below its own) and its folder asked in turn."""
    folder, name = os.path.split(pattern)
    if name == "**" and _names(path, folder):  # `**` takes no folder too: `**/*.jsonl` takes ./x.jsonl
        return True
    if path.exists():
        return path.resolve() in {Path(p).resolve() for p in glob.glob(pattern, recursive=True)}
    if path.name.startswith(".") and not name.startswith("."):
        return False
    if name == "**":
        return _listed(path.parent, pattern)
    return fnmatch(path.name, name) and _names(path.parent, folder)


def _names(path: Path, folder: str) -> bool:
    """Whether ``path`` is one of the folders the pattern ``folder`` names (``""``: the working folder)."""
    if any(c in folder for c in _GLOB_CHARACTERS):
        return _listed(path, folder)
    return path.resolve() == Path(folder or os.curdir).resolve()
