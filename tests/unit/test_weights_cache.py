"""The GGUF caches' dead entries (``model/weights_cache.py``): an entry goes when no load can find it again (its
source file gone, replaced or touched, or its format's version moved on) and stays while its file is as it was;
an entry whose header cannot be read, or names a relative path, is left alone."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tokenmill.model.weights_cache import file_identity, prune_dead_entries, source_of

VERSIONS = {"gguf-": 3, "gguf-blocks-": 5}


def entry(cache: Path, source: Path | str, identity: str, name: str = "gguf-{id}-v3.safetensors") -> Path:
    """A cache entry as the loader writes one: a tensor and a header naming its source."""
    path = cache / name.format(id=identity)
    save_file({"w": torch.zeros(2)}, str(path), metadata={"source": str(source), "tokenmill_config": "{}"})
    return path


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    folder = tmp_path / "cache"
    folder.mkdir()
    return folder


def model_file(tmp_path: Path, name: str, data: bytes = b"GGUF model bytes") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_the_entries_of_a_removed_file_go_and_a_kept_files_stay(tmp_path: Path, cache: Path) -> None:
    kept, removed = model_file(tmp_path, "kept.gguf"), model_file(tmp_path, "removed.gguf")
    live = [
        entry(cache, kept, file_identity(kept)),
        entry(cache, kept, file_identity(kept), "gguf-blocks-{id}-w16-q8-v5.safetensors"),
    ]
    dead = [
        entry(cache, removed, file_identity(removed)),
        entry(cache, removed, file_identity(removed), "gguf-blocks-{id}-w32-exact-v5.safetensors"),
    ]
    removed.unlink()
    assert sorted(prune_dead_entries(cache, VERSIONS)) == sorted(dead)
    assert sorted(cache.iterdir()) == sorted(live)


def test_a_touched_or_rewritten_file_orphans_its_entries(tmp_path: Path, cache: Path) -> None:
    touched, rewritten = model_file(tmp_path, "touched.gguf"), model_file(tmp_path, "rewritten.gguf")
    old = [entry(cache, touched, file_identity(touched)), entry(cache, rewritten, file_identity(rewritten))]
    stat = touched.stat()
    os.utime(touched, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    rewritten.write_bytes(b"other, longer GGUF model bytes")
    new = entry(cache, touched, file_identity(touched))
    assert sorted(prune_dead_entries(cache, VERSIONS)) == sorted(old)
    assert list(cache.iterdir()) == [new]


def test_an_entry_of_an_older_format_version_goes_and_a_newer_stays(tmp_path: Path, cache: Path) -> None:
    model = model_file(tmp_path, "model.gguf")
    identity = file_identity(model)
    stale = [
        entry(cache, model, identity, "gguf-{id}-v2.safetensors"),
        entry(cache, model, identity, "gguf-blocks-{id}-w16-q8-v4.safetensors"),
    ]
    current = entry(cache, model, identity, "gguf-blocks-{id}-w16-q8-v5.safetensors")
    newer = entry(cache, model, identity, "gguf-blocks-{id}-w16-q8-v6.safetensors")  # a newer install's
    assert sorted(prune_dead_entries(cache, VERSIONS)) == sorted(stale)
    assert sorted(cache.iterdir()) == sorted([current, newer])
    model.unlink()  # a newer install's entry of a file gone goes too
    assert sorted(prune_dead_entries(cache, VERSIONS)) == sorted([current, newer])


def test_what_it_cannot_judge_stays(tmp_path: Path, cache: Path) -> None:
    """A damaged header, a relative source path, no source at all, and files that are not entries."""
    identity = "0" * 32
    damaged = cache / f"gguf-{identity}-v3.safetensors"
    damaged.write_bytes(b"not a safetensors file")
    relative = entry(cache, "models/m.gguf", "1" * 32)
    unnamed = cache / f"gguf-blocks-{'2' * 32}-w16-q8-v5.safetensors"
    save_file({"w": torch.zeros(2)}, str(unnamed), metadata={"tokenmill_config": "{}"})
    others = [cache / ".gguf-x.safetensors.abc.tmp", cache / "limits.json", cache / f"gguf-{identity}.bin"]
    for path in others:
        path.write_bytes(b"{}")
    (cache / "models").mkdir()
    assert (
        source_of(damaged) is None and source_of(relative) == "models/m.gguf" and source_of(unnamed) is None
    )
    assert prune_dead_entries(cache, VERSIONS) == []
    assert len(list(cache.iterdir())) == 7


def test_a_missing_folder_prunes_nothing(tmp_path: Path) -> None:
    assert prune_dead_entries(tmp_path / "absent", VERSIONS) == []
