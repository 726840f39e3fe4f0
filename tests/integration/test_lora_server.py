"""LoRA adapters through the server, with the openai SDK as the client: a request's `model` picks the adapter
(answers equal to peft's merged model's greedy tokens), /v1/models lists adapters with their parent, an unknown
name is a 404 `model_not_found` naming it, adapters load and unload at run time while a request runs, /metrics
carries vLLM's `vllm:lora_requests_info`, and `--lora-modules` takes vLLM's two forms."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
peft = pytest.importorskip("peft")

from test_lora import make_adapter, merged  # noqa: E402
from test_model_families import build_hf, prompts, save_dir, tokenizer_files  # noqa: E402,F401

from tokenmill.engine import Engine  # noqa: E402
from tokenmill.server.app import build_app  # noqa: E402
from tokenmill.server.async_engine import AsyncEngine  # noqa: E402
from tokenmill.server.launch import load_lora_modules, parse_lora_modules  # noqa: E402

PROMPT = prompts([19], seed=11)[0]


@pytest.fixture(scope="module")
def setup(tokenizer_files, tmp_path_factory) -> Iterator[dict[str, Any]]:  # noqa: F811
    root = tmp_path_factory.mktemp("lora-server")
    hf_model = build_hf("llama")
    base = save_dir(hf_model, tokenizer_files, root / "base")
    adapters = {
        name: make_adapter(hf_model, root / name, seed=i, rank=8, targets=["q_proj", "v_proj", "down_proj"])
        for i, name in enumerate(["sql", "law", "extra"])
    }
    engine = Engine(model=str(base), device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8,
                    num_kv_blocks=128, speculative_config=None)  # fmt: skip
    loras = load_lora_modules(
        engine, [f"sql={adapters['sql']}", json.dumps({"name": "law", "path": str(adapters["law"])})]
    )
    async_engine = AsyncEngine(engine, max_queue=16)
    mp = pytest.MonkeyPatch()
    mp.setenv("TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING", "1")
    app = build_app(async_engine, "base", lora_modules=loras, enable_per_request_metrics=True)
    async_engine.start()
    yield {"app": app, "hf": hf_model, "adapters": adapters, "engine": engine}
    async_engine.stop()
    mp.undo()


def client(app: Any) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120)
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)


def greedy(hf_model: Any, n: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(PROMPT) :].tolist()


async def _complete(c: openai.AsyncOpenAI, model: str, n: int = 6) -> Any:
    return await c.completions.create(model=model, prompt=PROMPT, max_tokens=n, temperature=0)


def test_model_picks_the_adapter_and_models_lists_them(setup) -> None:
    c, engine = client(setup["app"]), setup["engine"]
    for model, reference in (("base", setup["hf"]), ("sql", merged(setup["hf"], setup["adapters"]["sql"])),
                             ("law", merged(setup["hf"], setup["adapters"]["law"]))):  # fmt: skip
        out = asyncio.run(_complete(c, model))
        expected = engine.tokenizer.decode(greedy(reference, 6))
        assert out.choices[0].text == expected, model
        assert out.model == model

    async def list_models() -> list[Any]:
        return [m async for m in c.models.list()]

    listed = asyncio.run(list_models())
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"]}
    structured = asyncio.run(c.completions.create(
        model="sql", prompt=PROMPT, max_tokens=30, temperature=0, extra_body={"guided_json": schema}
    ))  # fmt: skip
    assert json.loads(structured.choices[0].text)["n"] in (1, 2) and structured.model == "sql"
    assert structured.model_extra["metrics"]["num_output_tokens"] == structured.usage.completion_tokens
    assert [m.id for m in listed] == ["base", "law", "sql"]
    assert [m.model_extra.get("parent") for m in listed] == [None, "base", "base"]
    assert listed[2].model_extra["root"] == str(setup["adapters"]["sql"])
    with pytest.raises(openai.NotFoundError) as info:
        asyncio.run(_complete(c, "nope"))
    assert info.value.code == "model_not_found" and "`nope`" in info.value.message


def test_load_and_unload_while_a_request_runs(setup) -> None:
    app = setup["app"]

    async def scenario() -> None:
        c = client(app)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120)
        long = {
            "model": "sql",
            "prompt": PROMPT,
            "max_tokens": 480,
            "temperature": 0,
            "extra_body": {"ignore_eos": True},
        }
        running = asyncio.create_task(c.completions.create(**long))  # type: ignore[arg-type]
        for _ in range(2000):  # until the engine runs it
            await asyncio.sleep(0.005)
            if setup["engine"].num_running:
                break
        assert setup["engine"].num_running == 1
        path = str(setup["adapters"]["extra"])
        loaded = await http.post("/v1/load_lora_adapter", json={"lora_name": "extra", "lora_path": path})
        assert loaded.status_code == 200 and "added successfully" in loaded.text
        again = await http.post("/v1/load_lora_adapter", json={"lora_name": "extra", "lora_path": path})
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        bad = await http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nonexistent"})
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
        busy = await http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert busy.status_code == 400 and "still has requests running" in busy.json()["error"]["message"]
        out = await _complete(c, "extra")
        expected = setup["engine"].tokenizer.decode(
            greedy(merged(setup["hf"], setup["adapters"]["extra"]), 6)
        )
        assert out.choices[0].text == expected
        text = (await running).choices[0].text
        alone = await c.completions.create(**long)  # type: ignore[arg-type]
        assert (
            text == alone.choices[0].text
        )  # it ran through the load, the unload refused and another adapter
        gone = await http.post("/v1/unload_lora_adapter", json={"lora_name": "extra"})
        assert gone.status_code == 200 and "removed successfully" in gone.text
        with pytest.raises(openai.NotFoundError):
            await _complete(c, "extra")
        missing = await http.post("/v1/unload_lora_adapter", json={"lora_name": "extra"})
        assert missing.status_code == 404
        metrics = (await http.get("/metrics")).text
        assert (
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}'
            in metrics
        )

    asyncio.run(scenario())


def test_runtime_routes_are_absent_without_the_flag(setup, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    app = build_app(AsyncEngine(setup["engine"], max_queue=4), "base")
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    response = asyncio.run(http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"}))
    assert response.status_code == 404


def test_lora_modules_forms_and_refusals(tmp_path: Path) -> None:
    sql, law = parse_lora_modules(["sql=/a/sql", '{"name": "law", "path": "/a/law", "base_model_name": "m"}'])
    assert (sql.lora_name, sql.lora_int_id, sql.lora_path, sql.base_model_name) == ("sql", 1, "/a/sql", None)
    assert (law.lora_name, law.lora_int_id, law.lora_path, law.base_model_name) == ("law", 2, "/a/law", "m")
    for bad, words in (("sql", "name=path"), ("=/a", "name=path"), ('{"name": "x"}', "JSON object"),
                       ('{"name": "x", "path": "/p", "rank": 4}', "JSON object"), ("{nope", "not JSON")):  # fmt: skip
        with pytest.raises(ValueError, match=words):
            parse_lora_modules([bad])
    with pytest.raises(ValueError, match="given twice"):
        parse_lora_modules(["a=/x", "a=/y"])
