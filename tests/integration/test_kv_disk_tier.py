"""The prefix cache's disk tier through a real Engine on the embedded model: a restarted engine reads a long
prompt's blocks back instead of computing them, and answers with the same tokens; a corrupt file is computed
again; salts and the KV's dtype keep blocks apart."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import pytest

from tokenmill import SamplingParams
from tokenmill.engine import Engine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    from tokenmill.model.loader import load_model

    return load_model(None, device="cpu")


def _engine(loaded, folder: Path, **overrides) -> Engine:
    settings = dict(
        kv_cache_disk_bytes=256 << 20, kv_cache_disk_dir=str(folder), num_kv_blocks=256,
        speculative_config={"method": "none"}, hardware_limits="none",
    )  # fmt: skip
    settings.update(overrides)
    return Engine(loaded=loaded, **settings)


def _run(engine: Engine, prompt: list[int], salt: str | None = None) -> list[int]:
    request_id = engine.add_request(prompt, GREEDY, cache_salt=salt)
    tokens: list[int] = []
    while engine.has_unfinished():
        for delta in engine.step().deltas:
            if delta.request_id == request_id:
                tokens += delta.new_token_ids
    engine.check_integrity()
    return tokens


def _chain_hashes(tokens: list[int], salt: str = "", block_size: int = 16) -> list[bytes]:
    """The documented block names, written independently: sha256(parent || int32 token ids), the first parent
    sha256 of the salt."""
    parent, out = hashlib.sha256(salt.encode()).digest(), []
    for i in range((len(tokens) - 1) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        parent = hashlib.sha256(parent + struct.pack(f"<{block_size}i", *block)).digest()
        out.append(parent)
    return out


def _prompt(loaded) -> list[int]:
    text = " ".join(f"Line {i}: the lighthouse keeper counts {i * 7} ships." for i in range(40))
    return loaded.tokenizer.encode(text)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
def test_a_restarted_engine_reads_the_prompt_back(loaded, tmp_path: Path, kv_cache_dtype: str) -> None:
    prompt = _prompt(loaded)
    assert len(prompt) > 400
    cold = _engine(loaded, tmp_path, kv_cache_dtype=kv_cache_dtype)
    expected = _run(cold, prompt)
    cold.kv_disk.flush()
    num_blocks = (len(prompt) - 1) // 16
    assert cold.kv_disk.store.num_blocks >= num_blocks
    assert all(h in cold.kv_disk.store for h in _chain_hashes(prompt))  # every prompt block, by its name
    assert cold.stats.num_disk_hit_tokens == 0
    cold.close()

    warm = _engine(loaded, tmp_path, kv_cache_dtype=kv_cache_dtype)  # a restart: the memory tier is empty
    assert _run(warm, prompt) == expected
    assert warm.stats.num_disk_hit_tokens == num_blocks * 16
    assert warm.stats.num_prefix_hit_tokens == num_blocks * 16  # counted computed, not computed
    assert warm.stats.num_prefill_tokens <= len(prompt) - num_blocks * 16 + 16
    # a salt names other blocks: computed, not read
    assert _run(warm, prompt, salt="tenant-b") == expected
    assert warm.stats.num_disk_hit_tokens == num_blocks * 16
    warm.close()


def test_a_corrupt_block_is_computed_again(loaded, tmp_path: Path) -> None:
    prompt = _prompt(loaded)
    cold = _engine(loaded, tmp_path)
    expected = _run(cold, prompt)
    cold.kv_disk.flush()
    folder = cold.kv_disk.store.folder
    cold.close()
    victim = folder / f"{_chain_hashes(prompt)[4].hex()}.kv"  # the fifth block of the prompt's chain
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))

    warm = _engine(loaded, tmp_path)
    assert _run(warm, prompt) == expected
    assert warm.stats.num_disk_corrupt_blocks == 1
    assert warm.stats.num_disk_hit_tokens == 4 * 16  # up to the bad block only
    assert not victim.exists() or victim.read_bytes() != bytes(raw)  # deleted, or written again whole
    warm.close()


def test_the_kv_dtype_and_the_arithmetic_name_the_folder(loaded, tmp_path: Path) -> None:
    a = _engine(loaded, tmp_path)
    folder = a.kv_disk.store.folder
    a.close()
    other = _engine(loaded, tmp_path, block_size=32)
    assert other.kv_disk.store.folder != folder
    other.close()
    folders = {folder}
    for kv_cache_dtype in ("bf16", "int8", "fp8"):
        other = _engine(loaded, tmp_path, kv_cache_dtype=kv_cache_dtype)
        folders.add(other.kv_disk.store.folder)
        other.close()
    assert len(folders) == 4


def test_off_by_default_in_the_library_and_with_zero(loaded, tmp_path: Path) -> None:
    assert Engine(loaded=loaded, num_kv_blocks=64, hardware_limits="none").kv_disk is None
    assert _engine(loaded, tmp_path, kv_cache_disk_bytes=0).kv_disk is None
    with pytest.raises(ValueError, match="kv_cache_disk_bytes"):
        _engine(loaded, tmp_path, kv_cache_disk_bytes=-5)


def test_a_failing_disk_costs_hits_never_the_request(loaded, tmp_path: Path, monkeypatch) -> None:
    prompt = _prompt(loaded)
    cold = _engine(loaded, tmp_path)
    expected = _run(cold, prompt)
    cold.kv_disk.flush()
    cold.close()
    warm = _engine(loaded, tmp_path)

    def broken(*_args) -> bool:
        raise OSError("the disk went away")

    monkeypatch.setattr(warm.kv_disk, "load", broken)
    monkeypatch.setattr(warm.kv_disk, "_offload", broken)
    assert _run(warm, prompt) == expected  # computed, not read; nothing written; the step went on
    assert warm.stats.num_disk_hit_tokens == 0 and warm.stats.num_failed_steps == 0
    assert warm.stats.num_disk_failed_writes > 0
    warm.close()
