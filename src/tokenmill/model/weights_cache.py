"""The GGUF weights caches' dead entries, removed.

An entry of ``$TOKENMILL_CACHE_DIR`` (``gguf-<identity>-v<N>.safetensors``, the dequantized weights, and
``gguf-blocks-<identity>-w<W>-<mode>-v<N>.safetensors``, the rewritten blocks) is keyed by its GGUF file's path,
size and modification time (:func:`file_identity`) and names that file in its header
(``source``). Once the file is gone, moved, replaced or touched, or the format's version has moved on, no load can
ever find the entry again: a virtualenv made anew (the embedded model's path changes), a test's temporary GGUF, a
model file edited in place (an entry of a newer version than this tokenmill's belongs to a newer install: kept
while its file is). :func:`prune_dead_entries` deletes exactly those, so the cache holds at most the entries
a later load can still use. Entries whose header cannot be read are left alone (a load rewrites them). Loads call it
each time they write an entry, the only moment the cache grows.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import struct
from pathlib import Path

_ENTRY = re.compile(
    r"(?P<kind>gguf-(?:blocks-)?)(?P<identity>[0-9a-f]{32})-(?:.+-)?v(?P<version>\d+)\.safetensors"
)
_MAX_HEADER_BYTES = 256 << 20  # safetensors' own bound on a header


def file_identity(path: Path) -> str:
    """A cache key for a file without reading it: its resolved path, size and modification time (hashing a
    1 GB file takes 1.6 s, more than a cached load may take). A file replaced or touched gets a new key."""
    stat = path.stat()
    key = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def source_of(entry: Path) -> str | None:
    """The ``source`` field of a cache entry's safetensors header (the GGUF it came from), or None if unreadable.

    Reads only the header: its 8-byte length, then the JSON (the tokenizer's fields make it a few MB at most).
    """
    try:
        with entry.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > _MAX_HEADER_BYTES:
                return None
            header = json.loads(f.read(length))
        source = header.get("__metadata__", {}).get("source")
    except (OSError, ValueError, struct.error, AttributeError):
        return None
    return source if isinstance(source, str) else None


def is_dead(entry: Path, identity: str, version: int, current_version: int) -> bool:
    """Whether no load can find ``entry`` again: an older format version, or its source file gone or changed (a
    newer version's entry is a newer install's, sharing the folder: kept while its file is as it was)."""
    if version < current_version:
        return True
    source = source_of(entry)
    if source is None or not os.path.isabs(source):
        return False  # cannot tell: a damaged entry is rewritten by the next load of its file
    try:
        return file_identity(Path(source)) != identity
    except OSError:  # the source file is gone
        return True


def prune_dead_entries(cache_dir: Path, versions: dict[str, int]) -> list[Path]:
    """Delete the GGUF cache entries in ``cache_dir`` that no load can use again (see the module's text); returns
    them. ``versions``: each kind's current format version (``"gguf-"``, ``"gguf-blocks-"``). Never raises: a file
    another process removes first, or a read-only folder, leaves the entry as it is."""
    removed: list[Path] = []
    try:
        names = sorted(os.listdir(cache_dir))
    except OSError:
        return removed
    for name in names:
        match = _ENTRY.fullmatch(name)
        if match is None:
            continue
        entry = cache_dir / name
        if is_dead(entry, match["identity"], int(match["version"]), versions[match["kind"]]):
            with contextlib.suppress(OSError):
                entry.unlink()
                removed.append(entry)
    return removed
