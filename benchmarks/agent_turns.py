"""Coding agents' CLIs against a real ``tokenmill serve``: does a turn complete, is a tool call made and answered,
and what did each client send.

    python -m benchmarks.agent_turns --agents-dir ~/peers/agents [--model qwen2.5-coder-1.5b-instruct]
        [--agents claude,codex,opencode] [--capture-dir DIR] [--timeout-s 1800]

The CLIs come from npm, outside the repository (``npm install @anthropic-ai/claude-code@2.1.332
@openai/codex@0.171.0 opencode-ai@1.18.33`` in ``--agents-dir``). Each runs headless in a fresh folder holding a small buggy Python file, asked to fix it, with
only the base URL, a key and the model name set (Claude Code: ``ANTHROPIC_BASE_URL``, ``ANTHROPIC_API_KEY``,
``--model``; its ``--allowedTools`` lets a headless run edit files; Codex: ``-c openai_base_url=...``,
``OPENAI_API_KEY``, ``--model``, ``exec`` with approvals off in its throwaway folder; opencode: a provider entry in its config with the base URL,
a key and the model, ``run --auto``). Between client and server a capturing proxy writes every
request (method, path, JSON body) and its status to ``--capture-dir/<agent>.jsonl``; those bodies are what the
default test run replays (``tests/integration/test_agent_requests.py``, with long texts shortened). A tool call
is "made and answered" when a later request carries its result back (``tool_result`` for Messages,
``function_call_output`` for Responses, a ``tool`` message for chat completions). The model's own mistakes (a wrong fix) are reported, not failures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import cpu_name

TASK = "The function add in calc.py returns the wrong result. Fix the bug in calc.py."
BUGGY = "def add(a, b):\n    return a - b\n"


def start_proxy(upstream: str, port: int, log_path: Path) -> None:
    """A reverse proxy on ``port`` forwarding to ``upstream`` (streams passed through as they come), logging each
    request's JSON body and the answer's status, one line each."""
    import httpx
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route, WebSocketRoute
    from starlette.websockets import WebSocket

    client = httpx.AsyncClient(base_url=upstream, timeout=None)
    lock = threading.Lock()

    async def forward(request: Request) -> StreamingResponse:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        upstream_req = client.build_request(
            request.method, request.url.path, params=request.query_params, headers=headers, content=body
        )
        response = await client.send(upstream_req, stream=True)
        try:
            parsed: Any = json.loads(body) if body else None
        except ValueError:
            parsed = body.decode(errors="replace")
        entry = {"t": time.time(), "method": request.method, "path": request.url.path, "status": response.status_code,
                 "body": parsed}  # fmt: skip
        if response.status_code >= 400:
            entry["error"] = (await response.aread()).decode(errors="replace")[:2000]
        with lock, log_path.open("a") as f:
            f.write(json.dumps(entry) + "\n")

        async def chunks() -> Any:
            if response.is_stream_consumed:
                yield response.content
            else:
                async for chunk in response.aiter_raw():
                    yield chunk
            await response.aclose()

        kept = {
            k: v
            for k, v in response.headers.items()
            if k.lower() not in ("content-length", "content-encoding")
        }
        return StreamingResponse(chunks(), status_code=response.status_code, headers=kept)

    async def forward_socket(socket: WebSocket) -> None:
        """A WebSocket (the Responses API's WebSocket mode) relayed both ways; each client message logged as a
        request on ``ws:<path>`` (the server's answers are events, not statuses: logged as 101)."""
        import websockets.asyncio.client

        headers = {k: v for k, v in socket.headers.items() if k.lower() in ("authorization", "openai-beta")}
        url = upstream.replace("http://", "ws://") + socket.url.path
        try:
            upstream_socket = await websockets.asyncio.client.connect(url, additional_headers=headers)
        except websockets.exceptions.InvalidStatus as exc:
            await socket.close(code=1008, reason=f"upstream answered {exc.response.status_code}")
            return
        await socket.accept()

        async def client_to_server() -> None:
            while True:
                text = await socket.receive_text()
                with lock, log_path.open("a") as f:
                    entry = {"t": time.time(), "method": "WS", "path": socket.url.path, "status": 101,
                             "body": json.loads(text)}  # fmt: skip
                    f.write(json.dumps(entry) + "\n")
                await upstream_socket.send(text)

        async def server_to_client() -> None:
            async for message in upstream_socket:
                await socket.send_text(message if isinstance(message, str) else message.decode())

        tasks = [asyncio.ensure_future(client_to_server()), asyncio.ensure_future(server_to_client())]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        await upstream_socket.close()

    methods = ["GET", "POST", "DELETE", "PUT", "HEAD", "OPTIONS"]
    app = Starlette(routes=[Route("/{path:path}", forward, methods=methods),
                            WebSocketRoute("/{path:path}", forward_socket)])  # fmt: skip
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    threading.Thread(target=lambda: asyncio.run(uvicorn.Server(config).serve()), daemon=True).start()


def wait_healthy(url: str, timeout_s: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} never became healthy")


def agent_command(agent: str, agents_dir: Path, proxy: str, model: str) -> tuple[list[str], dict[str, str]]:
    bin_dir = agents_dir / "node_modules" / ".bin"
    env = dict(os.environ)
    if agent == "claude":
        env |= {"ANTHROPIC_BASE_URL": proxy, "ANTHROPIC_API_KEY": "sk-local"}
        return [
            str(bin_dir / "claude"),
            "-p",
            TASK,
            "--model",
            model,
            "--allowedTools",
            "Read,Edit,Write,Bash",
        ], env
    if agent == "codex":
        env |= {
            "OPENAI_BASE_URL": proxy + "/v1",
            "OPENAI_API_KEY": "sk-local",
            "CODEX_HOME": tempfile.mkdtemp(),
        }
        return [
            str(bin_dir / "codex"),
            "exec",
            "-c",
            f"openai_base_url={json.dumps(proxy + '/v1')}",  # the base URL (OPENAI_BASE_URL is read no more)
            "--dangerously-bypass-approvals-and-sandbox",  # a throwaway folder: its edits need no sandbox
            "--skip-git-repo-check",
            "--model",
            model,
            TASK,
        ], env
    if agent == "opencode":
        # opencode reaches a local server through a provider entry of its config (the OpenAI-compatible SDK,
        # chat completions): the base URL, a key and the model name, nothing else
        home = Path(tempfile.mkdtemp(prefix="opencode-home-"))
        provider = {
            "npm": "@ai-sdk/openai-compatible",
            "name": "tokenmill",
            "options": {"baseURL": proxy + "/v1", "apiKey": "sk-local"},
            "models": {model: {"name": model}},
        }
        config = {"$schema": "https://opencode.ai/config.json", "provider": {"tokenmill": provider}}
        (home / "opencode.json").write_text(json.dumps(config))
        env |= {"OPENCODE_CONFIG": str(home / "opencode.json"), "XDG_DATA_HOME": str(home / "data")}
        return [str(bin_dir / "opencode"), "run", "--auto", "-m", f"tokenmill/{model}", TASK], env
    raise ValueError(f"unknown agent {agent!r}")


FIXTURE_TEXT_CHARS = 40  # longer strings (prompts, descriptions, ids with personal data) become a placeholder


def shortened(value: Any) -> Any:
    """A captured body with its shape kept and its texts replaced: every string longer than
    ``FIXTURE_TEXT_CHARS`` becomes ``<text: N characters>`` (no client's prompt or identifiers are kept)."""
    if isinstance(value, dict):
        return {k: shortened(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shortened(v) for v in value]
    if isinstance(value, str) and len(value) > FIXTURE_TEXT_CHARS:
        return f"<text: {len(value)} characters>"
    return value


def write_fixture(entries: list[dict[str, Any]], client: str, path: Path) -> None:
    """The POST requests a client sent, shortened, one JSON line each: what the default test run replays."""
    with path.open("w") as f:
        for e in entries:
            if e["method"] in ("POST", "WS") and isinstance(e.get("body"), dict):
                path = e["path"] if e["method"] == "POST" else f"ws:{e['path']}"
                line = {"client": client, "path": path, "body": shortened(e["body"])}
                f.write(json.dumps(line, sort_keys=True) + "\n")


def tool_round_trips(entries: list[dict[str, Any]]) -> int:
    """Requests that carry a tool's result back to the model (Messages' ``tool_result`` block, Responses'
    ``function_call_output`` item, chat's ``tool`` role)."""
    count = 0
    for e in entries:
        text = json.dumps(e.get("body"))
        count += any(key in text for key in ('"tool_result"', '"function_call_output"', '"role": "tool"'))
    return count


def run_agent(agent: str, args: argparse.Namespace, proxy: str) -> dict[str, Any]:
    log = Path(args.capture_dir) / f"{agent}.jsonl"
    log.unlink(missing_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"agent-{agent}-"))
    (work / "calc.py").write_text(BUGGY)
    subprocess.run(["git", "init", "-q"], cwd=work, check=True)
    command, env = agent_command(
        agent, Path(args.agents_dir).expanduser(), proxy, args.served_name or args.model
    )
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command, cwd=work, env=env, capture_output=True, text=True, timeout=args.timeout_s
        )
        rc, out = done.returncode, (done.stdout + done.stderr)[-1500:]
    except subprocess.TimeoutExpired as e:
        rc, out = "timeout", str(e.stdout or "")[-1500:]
    entries = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    if args.write_fixtures:
        version = subprocess.run([command[0], "--version"], capture_output=True, text=True, env=env).stdout
        client = {"claude": "claude-code", "codex": "codex-cli"}.get(agent, agent)
        number = next((w for w in version.split() if w[:1].isdigit()), "?")  # "2.1.332 (Claude Code)" ...
        write_fixture(entries, f"{client} {number}", Path(args.write_fixtures) / f"{agent}.jsonl")
    statuses: dict[str, int] = {}
    for e in entries:
        statuses[str(e["status"])] = statuses.get(str(e["status"]), 0) + 1
    return {
        "agent": agent, "rc": rc, "seconds": round(time.perf_counter() - started), "requests": len(entries),
        "statuses": statuses, "tool results sent back": tool_round_trips(entries),
        "fixed": "a + b" in (work / "calc.py").read_text(), "errors": [e["error"][:300] for e in entries if "error" in e],
        "output tail": out,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents-dir", required=True)
    parser.add_argument("--agents", default="claude,codex,opencode")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--served-name", default=None, help="the name the agents ask for (default: --model)")
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--capture-dir", default="agent-captures")
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument(
        "--write-fixtures", default=None, metavar="DIR", help="also write each client's requests, shortened, "
        "as DIR/<agent>.jsonl (tests/integration/agent_requests holds the ones the test run replays)",
    )  # fmt: skip
    parser.add_argument("--port", type=int, default=18100)
    args = parser.parse_args(argv)
    Path(args.capture_dir).mkdir(parents=True, exist_ok=True)
    server_log = Path(args.capture_dir) / "server.log"
    command = [str(Path(sys.executable).with_name("tokenmill")), "serve", "--model", args.model,
               "--port", str(args.port), "--max-model-len", str(args.max_model_len)]  # fmt: skip
    server = subprocess.Popen(command, stdout=server_log.open("w"), stderr=subprocess.STDOUT)
    upstream = f"http://127.0.0.1:{args.port}"
    try:
        wait_healthy(upstream)
        print(
            f"# {time.strftime('%Y-%m-%d')}, {cpu_name()}, {args.model}, tokenmill serve defaults", flush=True
        )
        for agent in args.agents.split(","):
            proxy_port = args.port + 1 + args.agents.split(",").index(agent)  # a proxy and a log per agent
            start_proxy(upstream, proxy_port, Path(args.capture_dir) / f"{agent}.jsonl")
            time.sleep(1)
            print(json.dumps(run_agent(agent, args, f"http://127.0.0.1:{proxy_port}"), indent=1), flush=True)
    finally:
        server.terminate()
        server.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
