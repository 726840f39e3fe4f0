"""``tokenmill serve``: build the Engine from flags, run uvicorn, shut down gracefully on SIGTERM.

Shutdown, on the first SIGTERM or SIGINT:

1. the AsyncEngine stops admitting (new requests get 503) and uvicorn stops accepting connections;
2. requests in flight keep running, for up to ``--shutdown-timeout`` seconds;
3. then whatever is left is aborted, and each gets a terminal answer (an error event then ``[DONE]`` for
   a stream, a 503 otherwise);
4. the lifespan stops the engine thread and the process exits 0.

A step whose forward fails costs only its own requests. When ``--max-consecutive-step-failures`` steps fail in
a row, the engine counts as broken: ``/health`` answers 503, the server shuts down the same way and the process
exits with status 3, for a supervisor to restart it.

A second signal skips the wait and aborts at once. ``python -m tokenmill.server.launch`` takes the same
flags as ``tokenmill serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import Any

from tokenmill.engine_args import add_engine_arguments, engine_config_from_args

logger = logging.getLogger("tokenmill.server")

API_KEY_ENV = "TOKENMILL_API_KEY"


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag of ``tokenmill serve``: the engine's, then the server's."""
    add_engine_arguments(parser)
    _add_http_arguments(parser.add_argument_group("server"))
    _add_limit_arguments(parser.add_argument_group("server limits"))
    _add_store_arguments(parser.add_argument_group("the Responses store"))
    _add_api_arguments(parser.add_argument_group("APIs"))
    _add_observability_arguments(parser.add_argument_group("observability and logs"))
    _add_ray_arguments(
        parser.add_argument_group("data-parallel replicas on Ray Serve (optional extra: tokenmill[ray])")
    )


def _add_http_arguments(s: Any) -> None:
    s.add_argument("--served-model-name", default=None, help="the name clients use (default: the model's)")
    s.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="the port to listen on")
    s.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every route but /health and /metrics; "
        f"repeat for several keys (or set {API_KEY_ENV}); a stored response is readable only with the key that "
        "created it",
    )
    s.add_argument("--api-key-file", default=None, metavar="FILE", help="API keys, one a line ('#' comments)")
    s.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="engine requests that may wait (accepted, not yet admitted to the batch) before new ones get 429",
    )


def _add_api_arguments(s: Any) -> None:
    """How the APIs read and answer requests: CORS, the parsers, the chat page, adapters by name."""
    s.add_argument(
        "--allowed-origins", default=None, help="CORS: JSON list of origins, e.g. '[\"*\"]' (off by default)"
    )
    s.add_argument("--allowed-methods", default='["*"]', help="CORS: JSON list of methods")
    s.add_argument("--allowed-headers", default='["*"]', help="CORS: JSON list of request headers")
    s.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    s.add_argument(
        "--tool-call-parser",
        default="hermes",
        choices=["hermes", "llama3_json"],
        help="how the model writes tool calls (hermes: <tool_call>{...}</tool_call>; llama3_json: a JSON object)",
    )
    s.add_argument(
        "--max-tokens-past-context",
        default="cap",
        choices=["cap", "refuse"],
        help="a request whose prompt fits but whose max_tokens runs past the context's end: cap (generate to "
        "the end, finish_reason length, as llama.cpp's and Ollama's servers do; agents such as opencode ask "
        "for 32,000 tokens by default) or refuse (400 context_length_exceeded, as OpenAI's API and vLLM do)",
    )
    s.add_argument(
        "--reasoning-parser",
        default=None,
        choices=["deepseek_r1", "qwen3"],
        help="a thinking model's <think> text goes to message.reasoning (and reasoning_content), streamed as "
        "delta.reasoning, the rest to content (vLLM's parsers and rules)",
    )
    s.add_argument(
        "--default-chat-template-kwargs",
        default=None,
        metavar="JSON",
        help="variables for the chat template under each request's chat_template_kwargs, e.g. '{\"enable_thinking\": "
        "false}'",
    )
    s.add_argument("--no-ui", dest="ui", action="store_false", help="no chat page at / (the API routes only)")
    s.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) served by name, with --enable-lora: name=path, or vLLM's JSON form "
        '\'{"name": "sql", "path": "/adapters/sql", "base_model_name": "..."}\'; a request picks one by its model',
    )


def _add_observability_arguments(s: Any) -> None:
    """What the server tells its operator about each request besides /metrics."""
    s.add_argument(
        "--enable-per-request-metrics",
        action="store_true",
        help="each response carries a `metrics` object: queue, prefill, decode and end-to-end times, tokens/s, "
        "cached prompt tokens, preemptions, recomputed tokens (streamed: in the final chunk)",
    )
    s.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="export one OpenTelemetry span per request to this OTLP endpoint (extra tokenmill[otel]; HTTP/"
        "protobuf, or gRPC with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc), parented by the request's traceparent",
    )
    s.add_argument(
        "--record",
        default=None,
        metavar="FILE",
        help="write each request (arrival, prompt length, prefix-sharing keys, limits, output length) to FILE as "
        "JSON lines, for `tokenmill bench replay`; never the text unless --record-text",
    )
    s.add_argument("--record-text", action="store_true", help="--record also writes each prompt's text")
    s.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="the server's and the engine's log level",
    )
    s.add_argument(
        "--no-access-log", dest="access_log", action="store_false", help="do not log each request line"
    )


def _add_limit_arguments(s: Any) -> None:
    """What the server bounds: sizes, times, connections, failures."""
    s.add_argument("--max-body-bytes", type=int, default=8 << 20, help="larger request bodies get 413")
    s.add_argument("--max-header-bytes", type=int, default=64 << 10, help="larger request headers get 431")
    s.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a connection has to send a request's headers before it is closed",
    )
    s.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a request has to send its whole body before it gets 408",
    )
    s.add_argument(
        "--max-connections",
        type=int,
        default=1024,
        help="open connections beyond this are answered 503 and closed",
    )
    s.add_argument(
        "--max-connections-per-client",
        type=int,
        default=256,
        help="open connections from one client address beyond this are answered 503 and closed, counted before "
        "the API key is checked (0: no per-client limit, e.g. behind a proxy that is the only client)",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish on SIGTERM",
    )
    s.add_argument(
        "--max-consecutive-step-failures",
        type=int,
        default=3,
        help="failed steps in a row after which /health turns 503 and the process exits with status 3",
    )


def _add_store_arguments(s: Any) -> None:
    """Where the Responses API keeps what ``store: true`` asks to keep, and how much."""
    s.add_argument(
        "--response-store",
        default="sqlite",
        metavar="STORE",
        help="where the Responses API keeps stored responses: sqlite (a file in the cache directory, the "
        "default: survives restarts, shared by the replicas on this machine), sqlite:PATH, redis://HOST:PORT/DB "
        "(shared by replicas on several machines; extra tokenmill[redis]) or memory",
    )
    s.add_argument(
        "--responses-store-max-count",
        type=int,
        default=1024,
        help="the Responses API keeps at most this many stored responses (oldest evicted first)",
    )
    s.add_argument(
        "--responses-store-max-bytes",
        type=int,
        default=64 << 20,
        help="... and at most this many bytes of them",
    )


def _add_ray_arguments(r: Any) -> None:
    r.add_argument("--ray", action="store_true", help="serve --num-replicas engines behind Ray Serve's proxy")
    r.add_argument(
        "--num-replicas", type=int, default=2, help="with --ray: replicas (the minimum when autoscaling)"
    )
    r.add_argument("--max-replicas", type=int, default=None, help="with --ray: autoscale up to this many")
    r.add_argument(
        "--target-ongoing-requests", type=int, default=16, help="with --ray: a replica's queue to scale on"
    )
    r.add_argument("--num-cpus-per-replica", type=float, default=1.0, help="with --ray: Ray CPUs per replica")


def model_aliases(source: str, file_name: str, asked: str | None) -> list[str]:
    """Names a request may use besides the served one: the model's own (its file's or directory's), the name
    ``tokenmill pull`` knows it by (``all-minilm-l6-v2`` for the directory ``all-MiniLM-L6-v2``) and the names
    Ollama's library gives it (``qwen2.5-coder:1.5b``, ``smollm2:135m``)."""
    from pathlib import Path

    from tokenmill.model import registry as models
    from tokenmill.model.embedded import embedded_model_path

    names = [file_name]
    if asked is not None and models.catalogue_name(asked) in models.CATALOGUE:
        names.append(asked)
    for name, e in models.CATALOGUE.items():
        path = models.pulled_path(name)
        if path is not None and Path(source).resolve() == path.resolve():
            names.extend((name, *e.ollama_names))
    try:
        if Path(source).resolve() == embedded_model_path().resolve():
            names.extend(models.EMBEDDED_OLLAMA_NAMES)
    except (OSError, ValueError):  # no embedded model installed
        pass
    return list(dict.fromkeys(names))


def run_serve(args: argparse.Namespace) -> int:
    """Build everything from ``args`` and serve until a signal; 0 after a clean shutdown."""
    if (
        args.ray
    ):  # serving/ sits above server/: the replicas are started from there (tokenmill.cli dispatches)
        raise ValueError(
            "--ray: start the replicas with `tokenmill serve --ray` (tokenmill.serving.ray_serve)"
        )
    if args.record_text and not args.record:
        raise ValueError("--record-text needs --record FILE")
    import uvicorn

    from tokenmill.server.http_protocol import protocol_class

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    async_engine, app = _build(args, _checked_cors(args))
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.access_log,
        lifespan="on",
        timeout_graceful_shutdown=max(1, int(args.shutdown_timeout) + 5),
        http=protocol_class(args.header_timeout, args.max_connections, args.max_connections_per_client),
        h11_max_incomplete_event_size=args.max_header_bytes,
    )
    server = _make_server(config)
    try:
        asyncio.run(_serve(server, async_engine, args.shutdown_timeout))
    finally:
        async_engine.stop()
    if async_engine.error is not None:
        logger.error("exiting with status 3: the engine is broken (%s)", async_engine.dead_message())
        return 3
    return 0 if server.started else 1


def _checked_cors(args: argparse.Namespace) -> dict[str, Any] | None:
    """ValueError for a server flag out of range; the CORS settings (None: no CORS)."""
    if args.max_queue < 1:
        raise ValueError(f"--max-queue must be a positive integer, got {args.max_queue}")
    if args.max_connections_per_client < 0:
        raise ValueError(f"--max-connections-per-client must be >= 0, got {args.max_connections_per_client}")
    for flag in ("max_body_bytes", "max_header_bytes", "max_connections", "max_consecutive_step_failures"):
        if getattr(args, flag) < 1:
            raise ValueError(
                f"--{flag.replace('_', '-')} must be a positive integer, got {getattr(args, flag)}"
            )
    for flag in ("header_timeout", "body_timeout"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    cors = None
    if args.allowed_origins is not None:
        cors = {
            "allow_origins": _json_list("--allowed-origins", args.allowed_origins),
            "allow_methods": _json_list("--allowed-methods", args.allowed_methods),
            "allow_headers": _json_list("--allowed-headers", args.allowed_headers),
            "allow_credentials": args.allow_credentials,
        }
    return cors


def _build(args: argparse.Namespace, cors: dict[str, Any] | None) -> tuple[Any, Any]:
    """The engine, its thread's bridge and the app, with the start-up log lines."""
    from tokenmill import system_info
    from tokenmill.engine import Engine
    from tokenmill.server.app import build_app
    from tokenmill.server.async_engine import AsyncEngine
    from tokenmill.server.metrics import ServerMetrics

    api_keys = api_keys_from_args(args)

    engine = Engine(engine_config_from_args(args))
    loras = load_lora_modules(engine, args.lora_modules)
    served_name = args.served_model_name or engine.model_name
    metrics = ServerMetrics(served_name)
    info = system_info.collect()
    metrics.set_build_info(info)
    logger.info("%s", system_info.one_line(info))
    logger.info(
        "%s; KV cache %.1f MB, %d tokens in %s%s",
        engine.loaded.describe_weights(), engine.kv_cache_bytes / 1e6,
        engine.num_total_blocks * engine.config.block_size, str(engine.kv_dtype).removeprefix("torch."),
        "" if engine.kv_disk is None else f", disk tier {engine.kv_disk.store.folder}",
    )  # fmt: skip
    logger.info("%s", engine.loaded.describe_arithmetic())
    logger.info("%s", engine.generation_defaults.describe())
    async_engine = AsyncEngine(
        engine,
        max_queue=args.max_queue,
        metrics=metrics,
        max_consecutive_failures=args.max_consecutive_step_failures,
        observers=_observers(args, engine, served_name),
    )
    app = build_app(
        async_engine,
        served_name,
        api_keys,
        args.max_body_bytes,
        body_timeout_s=args.body_timeout,
        cors=cors,
        max_header_bytes=args.max_header_bytes,
        tool_call_parser=args.tool_call_parser,
        response_store=response_store_from_args(args),
        enable_per_request_metrics=args.enable_per_request_metrics,
        model_aliases=model_aliases(engine.loaded.source, engine.model_name, args.model),
        max_tokens_past_context=args.max_tokens_past_context,
        reasoning_parser=args.reasoning_parser,
        ui=args.ui,
        lora_modules=loras,
        default_chat_template_kwargs=json_object_arg(
            args.default_chat_template_kwargs, "--default-chat-template-kwargs"
        ),
    )
    logger.info(
        "serving %s on http://%s:%d (max_model_len=%d, kv blocks=%d, api key %s)",
        served_name, args.host, args.port, engine.max_model_len, engine.num_total_blocks,
        f"{len(api_keys)} required" if api_keys else "off",
    )  # fmt: skip
    return async_engine, app


def parse_lora_modules(values: Sequence[str]) -> list[Any]:
    """``--lora-modules`` values (``name=path`` or vLLM's JSON object) as LoRARequests, ids from 1; ValueError
    naming a bad one."""
    from tokenmill.lora_request import LoRARequest

    out: list[Any] = []
    for i, value in enumerate(values, start=1):
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--lora-modules {value!r}: not JSON: {exc}") from None
            if not isinstance(spec, dict) or not {"name", "path"} <= spec.keys() or set(spec) - {
                "name", "path", "base_model_name"
            }:  # fmt: skip
                raise ValueError(
                    f"--lora-modules {value!r}: a JSON object of name, path (and base_model_name)"
                )
            name, path, base = spec["name"], spec["path"], spec.get("base_model_name")
        else:
            name, sep, path = value.partition("=")
            base = None
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {value!r}: name=path, or a JSON object")
        if any(lora.lora_name == name for lora in out):
            raise ValueError(f"--lora-modules: {name!r} is given twice")
        out.append(LoRARequest(str(name), i, str(path), base))
    return out


def load_lora_modules(engine: Any, values: Sequence[str]) -> dict[str, Any]:
    """Every ``--lora-modules`` adapter loaded into ``engine`` (ValueError naming one that does not load)."""
    loras = parse_lora_modules(values)
    if loras and not engine.config.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    for lora in loras:
        try:
            engine.add_lora(lora)
        except ValueError as exc:
            raise ValueError(f"--lora-modules {lora.lora_name}: {exc}") from None
        logger.info("LoRA adapter %s (id %d) from %s", lora.lora_name, lora.lora_int_id, lora.lora_path)
    return {lora.lora_name: lora for lora in loras}


def api_keys_from_args(args: argparse.Namespace) -> list[str]:
    """Every key of --api-key, --api-key-file and the environment (ValueError for an unreadable file)."""
    keys = list(args.api_key or [])
    if os.environ.get(API_KEY_ENV):
        keys.append(os.environ[API_KEY_ENV])
    if args.api_key_file:
        try:
            lines = Path(args.api_key_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--api-key-file: {exc}") from None
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not keys:
            raise ValueError(f"--api-key-file {args.api_key_file} holds no key")
    return [key for key in keys if key]


def response_store_from_args(args: argparse.Namespace) -> Any:
    from tokenmill.model.gguf_loader import default_cache_dir
    from tokenmill.server.response_store import open_response_store

    store = open_response_store(
        args.response_store,
        args.responses_store_max_count,
        args.responses_store_max_bytes,
        default_cache_dir(),
    )
    logger.info("responses store: %s%s", store.kind, f" {store.path}" if hasattr(store, "path") else "")
    return store


def _observers(args: argparse.Namespace, engine: Any, served_name: str) -> list[Any]:
    """The traffic recorder (--record) and the tracer (--otlp-traces-endpoint), as asked."""
    observers: list[Any] = []
    if args.otlp_traces_endpoint:
        from tokenmill.server.tracing import RequestTracer

        observers.append(RequestTracer(args.otlp_traces_endpoint, served_name))
        logger.info("tracing: one span per request to %s", args.otlp_traces_endpoint)
    if args.record:
        from tokenmill.server.recorder import TrafficRecorder

        observers.append(TrafficRecorder(args.record, engine, served_name, record_text=args.record_text))
        logger.info(
            "recording traffic to %s%s", args.record, " (with prompt text)" if args.record_text else ""
        )
    return observers


def _json_list(flag: str, value: str) -> list[str]:
    try:
        items = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} must be a JSON list of strings: {exc}") from None
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise ValueError(f"{flag} must be a JSON list of strings, got {value!r}")
    return items


def _make_server(config: Any) -> Any:
    """A uvicorn.Server without its own signal handling: ours (in ``_serve``) drains first."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Generator[None, None, None]:
            yield

    return Server(config)


async def _serve(server: Any, async_engine: Any, shutdown_timeout_s: float) -> None:
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if not async_engine.draining:
            logger.info(
                "%s: admitting nothing new; in-flight requests get %.0f s",
                signal.Signals(signum).name,
                shutdown_timeout_s,
            )
            async_engine.begin_drain()
            server.should_exit = True
            loop.call_later(shutdown_timeout_s, async_engine.abort_all, "shutdown timeout")
        else:
            logger.warning("%s again: aborting everything in flight", signal.Signals(signum).name)
            async_engine.abort_all("second signal")

    def on_dead(error: BaseException) -> None:  # the engine thread: hand over to the loop
        def shut_down() -> None:
            logger.error("the engine is broken; shutting the server down so that a supervisor restarts it")
            server.should_exit = True

        with contextlib.suppress(RuntimeError):  # the loop is closed already
            loop.call_soon_threadsafe(shut_down)

    async_engine.on_dead = on_dead
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    await server.serve()


def json_object_arg(text: str | None, flag: str) -> dict[str, Any]:
    """A flag's JSON object ({} when unset); ValueError naming the flag otherwise."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{flag}: not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag}: must be a JSON object, got {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill serve", description="OpenAI-compatible HTTP server")
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_serve(args)
    except ValueError as exc:
        print(f"tokenmill serve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
