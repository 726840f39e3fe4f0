"""The GGUF blocks cache (``gguf_loader.GGUFFile.load_quantized_model``): written at the first load of a
quantized file, memory-mapped by the next, the same model either way.

The second load must not open the GGUF reader (its metadata parse is most of a cached load's time on a big
vocabulary), must hold its weights as pages of the cache file (mapped, not private copies), and must compute
bit for bit the logits of the first.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenmill.engine import Engine
from tokenmill.model import gguf_loader
from tokenmill.model.embedded import embedded_model_path
from tokenmill.model.loader import load_model
from tokenmill.model.quant import weight_breakdown
from tokenmill.sampling_params import SamplingParams

PROMPT = torch.tensor([1, 504, 3458, 282, 4649, 314, 253, 1345, 28], dtype=torch.int64)  # 9 tokens


def _logprobs(loaded) -> torch.Tensor:
    """Greedy tokens and the top-5 logprobs of each, through the engine (prefill and decode steps)."""
    engine = Engine(loaded=loaded, num_kv_blocks=16, enable_prefix_caching=False)
    engine.add_request(PROMPT.tolist(), SamplingParams(max_tokens=6, temperature=0, logprobs=5))
    rows: list[list[float]] = []
    while engine.has_unfinished():
        for out in engine.step().finished:
            for lp in out.outputs[0].logprobs:
                rows.append([lp.token_id, lp.logprob] + [v for t in lp.top_logprobs for v in t])
    assert len(rows) == 6
    return torch.tensor(rows, dtype=torch.float64)


def test_second_load_maps_the_cache_and_computes_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = embedded_model_path()
    first = load_model(str(path), device="cpu", cache_dir=str(tmp_path))
    mode = {"gguf": "exact", "gguf-q8": "q8"}[str(first.quantization)]  # the default arithmetic's blocks
    caches = sorted(tmp_path.glob("gguf-blocks-*.safetensors"))
    assert len(caches) == 1 and f"-{mode}-" in caches[0].name
    expected = _logprobs(first)

    opened: list[str] = []
    real_reader = gguf_loader.GGUFFile.reader

    def counting_reader(self):  # type: ignore[no-untyped-def]
        opened.append(str(self.path))
        return real_reader(self)

    monkeypatch.setattr(gguf_loader.GGUFFile, "reader", counting_reader)
    second = load_model(str(path), device="cpu", cache_dir=str(tmp_path))
    assert opened == [], "a cached load opened the GGUF reader"
    breakdown = weight_breakdown(second.model)
    quantized = sum(v for k, v in breakdown.items() if k.startswith(("linear", "embedding")))
    assert quantized > 0.9 * path.stat().st_size  # nearly the whole file is blocks
    assert breakdown.get("mapped", 0) >= quantized  # the blocks are the file's pages
    assert second.weight_bytes == first.weight_bytes
    assert torch.equal(_logprobs(second), expected)


@pytest.mark.slow  # 12 s: a whole rebuild of the blocks cache
def test_a_damaged_cache_is_rebuilt(tmp_path: Path) -> None:
    path = embedded_model_path()
    quantization = load_model(str(path), device="cpu", cache_dir=str(tmp_path)).quantization
    (cache,) = tmp_path.glob("gguf-blocks-*.safetensors")  # no model maps it while it is damaged
    cache.write_bytes(b"not a safetensors file")
    with pytest.warns(UserWarning, match="ignoring unreadable GGUF cache"):
        again = load_model(str(path), device="cpu", cache_dir=str(tmp_path))
    assert again.quantization == quantization
    assert cache.stat().st_size > 0.9 * path.stat().st_size  # written anew: the file's blocks


def test_a_touched_file_gets_a_new_key(tmp_path: Path) -> None:
    src = embedded_model_path()
    copy = tmp_path / "model.gguf"
    copy.write_bytes(src.read_bytes())
    key = gguf_loader.file_identity(copy)
    assert gguf_loader.file_identity(copy) == key
    copy.touch()
    import os

    os.utime(copy, ns=(copy.stat().st_atime_ns, copy.stat().st_mtime_ns + 1_000_000))
    assert gguf_loader.file_identity(copy) != key
