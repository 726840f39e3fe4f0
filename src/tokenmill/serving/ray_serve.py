"""Data-parallel replicas of the engine behind Ray Serve's HTTP proxy, with the same OpenAI routes.

Each replica is one Ray actor holding a whole engine (its own model copy, KV pool, scheduler and engine
thread) and tokenmill's FastAPI app (``server/app.py``) as its ASGI ingress; Ray Serve's proxy spreads requests
over the replicas and scales their number between ``min_replicas`` and ``max_replicas`` on the requests each
has in flight (``target_ongoing_requests``: a replica's queue). Every response carries an
``x-tokenmill-replica`` header naming the replica (its Ray replica id and process id), so a client can see the
spread. A replica that dies fails only the requests it was serving; Ray Serve starts another.

One machine works as a cluster would: ``ray start --head`` (or nothing: :func:`run` starts a local Ray), then
``tokenmill serve --ray --num-replicas 2``; across machines, ``ray start --address HEAD:6379`` on each and the
same command on the head. Ray is an optional extra: ``pip install 'tokenmill[ray]'``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

RAY_EXTRA_HINT = "Ray Serve is an optional extra: pip install 'tokenmill[ray]' (or 'ray[serve]')"


def _require_serve() -> Any:
    try:
        from ray import serve
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ValueError(RAY_EXTRA_HINT) from exc
    return serve


class _ReplicaHeader:
    """ASGI middleware: ``x-tokenmill-replica: <replica id>/<pid>`` on every HTTP response."""

    def __init__(self, app: Any, tag: str) -> None:
        self.app, self.tag = app, tag.encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def tagged(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (b"x-tokenmill-replica", self.tag)],
                }
            await send(message)

        await self.app(scope, receive, tagged)


def build_deployment(
    engine_kwargs: dict[str, Any],
    *,
    num_replicas: int = 1,
    max_replicas: int | None = None,
    target_ongoing_requests: int = 16,
    num_cpus_per_replica: float = 1.0,
    served_model_name: str | None = None,
    max_queue: int = 256,
    enable_per_request_metrics: bool = False,
    api_keys: Sequence[str] = (),
    response_store: str = "sqlite",
    response_store_caps: tuple[int, int] | None = None,
    app_options: dict[str, Any] | None = None,
) -> Any:
    """A bound Ray Serve application of ``num_replicas`` engines (autoscaling up to ``max_replicas`` when that
    is larger). ``engine_kwargs`` are ``EngineConfig`` fields, applied in every replica. Every replica opens
    the same ``response_store`` (``--response-store``: the default SQLite file on this machine, or Redis
    across machines), so a ``previous_response_id`` works whichever replica serves the next turn.
    ``app_options``: more keyword arguments of ``build_app`` (the tool-call and reasoning parsers...)."""
    serve = _require_serve()
    options = _deployment_options(
        num_replicas, max_replicas, target_ongoing_requests, num_cpus_per_replica, max_queue
    )

    @serve.deployment(name="tokenmill", **options)
    @serve.ingress()
    class TokenmillReplica:
        def __init__(self) -> None:
            from tokenmill.config import EngineConfig
            from tokenmill.engine import Engine
            from tokenmill.server.async_engine import AsyncEngine
            from tokenmill.server.metrics import ServerMetrics

            engine = Engine(EngineConfig(**engine_kwargs))
            self.engine_source, self.engine_model_name = engine.loaded.source, engine.model_name
            self.served_name = served_model_name or engine.model_name
            self.async_engine = AsyncEngine(
                engine, max_queue=max_queue, metrics=ServerMetrics(self.served_name)
            )
            self.async_engine.start()
            try:
                replica = serve.get_replica_context().replica_id.unique_id
            except Exception:  # outside a replica (a test calling the class directly)
                replica = "local"
            self.tag = f"{replica}/{os.getpid()}"

        def __serve_build_asgi_app__(self) -> Any:
            app = _replica_app(
                self.async_engine, self.served_name, list(api_keys), response_store, response_store_caps,
                enable_per_request_metrics=enable_per_request_metrics,
                aliases=(self.engine_source, self.engine_model_name, engine_kwargs.get("model")),
                app_options=app_options or {},
            )  # fmt: skip
            return _ReplicaHeader(app, self.tag)

    return TokenmillReplica.bind()


def _replica_app(
    async_engine: Any,
    served_name: str,
    api_keys: list[str],
    response_store: str,
    response_store_caps: tuple[int, int] | None,
    *,
    enable_per_request_metrics: bool,
    aliases: tuple[str, str, str | None],
    app_options: dict[str, Any],
) -> Any:
    """A replica's app (``server/app.build_app``) over its engine and the response store every replica shares."""
    from tokenmill.model.gguf_loader import default_cache_dir
    from tokenmill.server.app import build_app
    from tokenmill.server.launch import model_aliases
    from tokenmill.server.response_store import open_response_store

    store = open_response_store(response_store, *(response_store_caps or ()), cache_dir=default_cache_dir())
    return build_app(
        async_engine, served_name, api_keys, response_store=store,
        enable_per_request_metrics=enable_per_request_metrics, model_aliases=model_aliases(*aliases),
        **app_options,
    )  # fmt: skip


def _deployment_options(
    num_replicas: int,
    max_replicas: int | None,
    target_ongoing_requests: int,
    num_cpus_per_replica: float,
    max_queue: int,
) -> dict[str, Any]:
    """Serve's deployment options: a fixed count of replicas, or autoscaling between the two counts; a replica
    takes no more than its engine's queue (more would wait in Serve's queue instead)."""
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": num_cpus_per_replica},
        "max_ongoing_requests": max_queue,
    }
    if max_replicas is not None and max_replicas > num_replicas:
        options["autoscaling_config"] = {
            "min_replicas": num_replicas,
            "max_replicas": max_replicas,
            "target_ongoing_requests": target_ongoing_requests,
        }
    else:
        options["num_replicas"] = num_replicas
    return options


def run(
    app: Any, host: str = "127.0.0.1", port: int = 8000, address: str | None = None, blocking: bool = True
) -> Any:
    """Start (or join, ``address`` / ``RAY_ADDRESS``) Ray, put Serve's proxy on ``host:port``, deploy ``app``."""
    import ray

    serve = _require_serve()
    if not ray.is_initialized():
        ray.init(address=address or os.environ.get("RAY_ADDRESS") or None, include_dashboard=False)
    serve.start(http_options={"host": host, "port": port})
    return serve.run(app, name="tokenmill", route_prefix="/", blocking=blocking)


def run_from_args(args: argparse.Namespace) -> int:
    """``tokenmill serve --ray``: the same routes from ``--num-replicas`` engines behind Ray Serve's proxy."""
    import dataclasses
    import logging

    from tokenmill.engine_args import engine_config_from_args
    from tokenmill.server.launch import api_keys_from_args, json_object_arg

    for flag, value in (
        ("--record", args.record),
        ("--otlp-traces-endpoint", args.otlp_traces_endpoint),
        ("--lora-modules", args.lora_modules),
        ("--enable-lora", args.enable_lora),
    ):
        if value:  # one file or exporter per replica is not built: refused, not ignored
            raise ValueError(f"{flag} is not supported with --ray (run `tokenmill serve` without --ray)")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    engine_kwargs = dataclasses.asdict(engine_config_from_args(args))
    app = build_deployment(
        engine_kwargs,
        num_replicas=args.num_replicas,
        max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests,
        num_cpus_per_replica=args.num_cpus_per_replica,
        served_model_name=args.served_model_name,
        max_queue=args.max_queue,
        enable_per_request_metrics=args.enable_per_request_metrics,
        api_keys=api_keys_from_args(args),
        response_store=args.response_store,
        response_store_caps=(args.responses_store_max_count, args.responses_store_max_bytes),
        app_options={
            "tool_call_parser": args.tool_call_parser,
            "max_tokens_past_context": args.max_tokens_past_context,
            "reasoning_parser": args.reasoning_parser,
            "ui": args.ui,
            "default_chat_template_kwargs": json_object_arg(
                args.default_chat_template_kwargs, "--default-chat-template-kwargs"
            ),
        },  # fmt: skip
    )
    logging.getLogger("tokenmill.server").info(
        "serving %d replica(s) on Ray Serve at http://%s:%d", args.num_replicas, args.host, args.port
    )
    run(app, host=args.host, port=args.port, blocking=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tokenmill.serving.ray_serve`` takes ``tokenmill serve``'s arguments (``--ray`` implied)."""
    from tokenmill.server.launch import add_serve_arguments

    parser = argparse.ArgumentParser(prog="tokenmill serve --ray", description=__doc__)
    add_serve_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
