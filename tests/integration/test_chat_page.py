"""The chat page at ``/``: served from the package (no CDN: every script and style inline), open without the
API key (it asks for one, and the API behind it stays closed), off with ``--no-ui``; and, in a real browser
(Debian's chromium driven by Playwright, slow), a conversation: the model picker filled from ``/v1/models``, an
answer streamed in, the key asked for once, the conversation kept across a reload."""

from __future__ import annotations

import asyncio
import re
import shutil
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serverproc import ServerProcess

KEY = "sk-page"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--api-key", KEY).start()
    yield proc
    proc.stop()


def test_the_page_is_served_whole_and_open(server: ServerProcess) -> None:
    r = httpx.get(server.base_url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    for element in (
        'id="model"',
        'id="temperature"',
        'id="max_tokens"',
        'id="system"',
        'id="stop"',
        'id="send"',
    ):
        assert element in page
    assert not re.search(r"<script[^>]+src=|<link[^>]+href=|https?://(?!127\.)", page.split("<script>")[0])
    assert "localStorage" in page and "/v1/chat/completions" in page and "Authorization" in page
    assert httpx.get(server.base_url + "/v1/models").status_code == 401  # the API behind it stays closed


def test_no_ui(make_engine: Any) -> None:
    """``--no-ui`` (``build_app(ui=False)``): no page; Ollama's liveness check ``HEAD /`` still answers."""
    from tokenmill.server.app import build_app
    from tokenmill.server.async_engine import AsyncEngine

    app = build_app(AsyncEngine(make_engine(max_model_len=64), max_queue=2), "m", ui=False)

    async def get() -> tuple[int, int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return (await c.get("/")).status_code, (await c.head("/")).status_code

    page, head = asyncio.run(get())
    assert page in (404, 405) and head == 200
    import argparse

    from tokenmill.server.launch import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert parser.parse_args(["--no-ui"]).ui is False and parser.parse_args([]).ui is True


@pytest.mark.slow
def test_a_conversation_in_a_browser(server: ServerProcess) -> None:
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page()
        page.on("dialog", lambda dialog: dialog.accept(KEY))  # the key, asked for once
        page.goto(server.base_url + "/")
        page.wait_for_function("document.querySelector('#model').options.length > 0")
        assert page.locator("#model option").first.inner_text() == "SmolLM2-135M-Instruct"
        # a long answer: it grows while it streams, and Stop ends it
        page.fill("#max_tokens", "2000")
        page.fill("#input", "Tell me a very long story about a cat.")
        page.click("#send")
        grown = (
            "document.querySelector('.msg.assistant') && document.querySelector('.msg.assistant').innerText"
        )
        page.wait_for_function(f"({grown} || '').length > 20", timeout=60_000)
        early = len(page.locator(".msg.assistant").first.inner_text())
        page.wait_for_function(f"({grown} || '').length > {early + 20}", timeout=60_000)  # still growing
        assert page.is_enabled("#stop") and not page.is_enabled("#send")
        page.click("#stop")
        page.wait_for_function("document.querySelector('.msg.assistant .stats') !== null", timeout=30_000)
        stopped = page.locator(".msg.assistant").first.inner_text()
        assert "stopped" in stopped and "first token" in stopped and "tokens/s" in stopped
        assert page.is_enabled("#send")
        # a short one runs to its end, with its numbers
        page.fill("#max_tokens", "12")
        page.fill("#input", "Name a colour.")
        page.click("#send")
        page.wait_for_function(
            "document.querySelectorAll('.msg.assistant .stats').length === 2", timeout=60_000
        )
        answer = page.locator(".msg.assistant").nth(1).inner_text()
        assert "first token" in answer and "stopped" not in answer and answer.split("first token")[0].strip()
        page.reload()  # kept in the browser's storage, the key too
        page.wait_for_selector(".msg.user")
        assert [page.locator(".msg.user").nth(i).inner_text() for i in range(2)] == [
            "Tell me a very long story about a cat.", "Name a colour.",
        ]  # fmt: skip
        assert page.locator(".conv").count() == 1
        browser.close()
