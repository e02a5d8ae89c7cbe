"""The HTTP server: SGLang's native API over an Engine (docs/compatibility.md, section 1).

A thin FastAPI layer: every route validates its body (pydantic), calls the Engine's async
API, and maps errors to status codes: bad input 400 (``{"error": {"message"}}``), a bad or
missing API key 401, a body over ``MAX_BODY_BYTES`` 413, a full queue, a dead or draining
runtime 503. ``/metrics`` serves Prometheus metrics. With ``api_key`` set, every route but
``/health`` requires ``Authorization: Bearer <key>``. A request whose client leaves before
its answer is cancelled, and with it the generation (``disconnect.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict

from radixlm.runtime.engine.engine import Engine
from radixlm.runtime.engine.errors import QueueFull, RuntimeUnavailable
from radixlm.runtime.server.anthropic_api import add_anthropic_routes
from radixlm.runtime.server.api_key import ApiKeyCheck
from radixlm.runtime.server.body_limit import BodySizeLimit, BodyTooLarge, too_large_response
from radixlm.runtime.server.disconnect import CancelOnDisconnect
from radixlm.runtime.server.lora_routes import add_lora_routes
from radixlm.runtime.server.metrics import ServerMetrics
from radixlm.runtime.server.native_body import GenerateBody, generate_input
from radixlm.runtime.server.openai_api import add_openai_routes
from radixlm.runtime.server.responses_api import add_responses_routes
from radixlm.runtime.server.server_sent_events import server_sent_events

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 2**20
SCALE_OUT_INFO = {"dp_size": 1, "load_balance_method": "round_robin"}


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rid: str | None = None
    abort_all: bool = False


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def create_app(
    engine: Engine, api_key: str | None = None, served_model_name: str | None = None
) -> FastAPI:
    """The FastAPI app serving ``engine``: the native API, and the OpenAI API under /v1 with
    the model named ``served_model_name`` (default: the model directory's name)."""
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        try:
            yield
        finally:
            await engine.async_resume()  # a drain (graceful_shutdown.py) ends with its server

    app = FastAPI(title="radixlm", description="SGLang's native API and the OpenAI API",
                  lifespan=lifespan)
    name = served_model_name or engine.model_config.path.name
    add_openai_routes(app, engine, name)
    add_anthropic_routes(app, engine, name)
    add_responses_routes(app, engine, name)

    # Middleware, outermost last: the disconnect watch, the key check, the body limit.
    app.add_middleware(BodySizeLimit, limit=MAX_BODY_BYTES)
    if api_key is not None:
        app.add_middleware(ApiKeyCheck, api_key=api_key)
    app.add_middleware(CancelOnDisconnect)

    @app.exception_handler(BodyTooLarge)
    async def body_too_large(_: Request, err: BodyTooLarge) -> JSONResponse:
        return too_large_response(err)

    @app.exception_handler(RequestValidationError)
    async def bad_body(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0]
        field = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        return error_response(400, f"{field}: {first.get('msg', 'invalid value')}")

    @app.exception_handler(ValueError)
    async def bad_value(_: Request, err: ValueError) -> JSONResponse:
        return error_response(400, str(err))

    @app.exception_handler(RuntimeUnavailable)
    async def unavailable(_: Request, err: RuntimeUnavailable) -> JSONResponse:
        return error_response(503, str(err))

    @app.exception_handler(QueueFull)
    async def queue_full(_: Request, err: QueueFull) -> JSONResponse:
        return error_response(503, str(err))

    metrics = ServerMetrics()
    engine.attach_metrics(metrics)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        info = await engine.async_get_server_info()
        return Response(metrics.render(info), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_healthy() else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        await engine.async_generate(input_ids=[0], sampling_params={"max_new_tokens": 1})
        return Response(status_code=200)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        config = engine.model_config
        return {
            "model_path": str(config.path),
            "tokenizer_path": str(engine.server_args.tokenizer_path or config.path),
            "is_generation": True,
            "architectures": list(config.hf_config.architectures or []),
            # The frontend's RuntimeEndpoint renders roles with the model's own template.
            "chat_template": getattr(engine.tokenizer, "chat_template", None),
            "bos_token": engine.tokenizer.bos_token,
            "eos_token": engine.tokenizer.eos_token,
            "model_type": getattr(config.hf_config, "model_type", None),
        }

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        # What SGLang's router reads of a worker: one replica (the scheduler's info
        # carries the disaggregation mode).
        return {**await engine.async_get_server_info(), **SCALE_OUT_INFO}

    @app.get("/get_load")
    async def get_load() -> list[dict[str, Any]]:
        """The load of each data-parallel rank (one here), as SGLang reports it."""
        info = await engine.async_get_server_info()
        evictable = info["cache_tokens"] - info["cache_protected_tokens"]
        used = info["max_total_tokens"] - info["free_kv_tokens"] - evictable  # held by requests
        return [{"dp_rank": 0, "num_reqs": info["num_running"] + info["num_waiting"],
                 "num_waiting_reqs": info["num_waiting"], "num_tokens": used}]

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        if await engine.async_flush_cache():
            return Response("cache flushed", status_code=200)
        return error_response(400, "the cache can only be flushed while no request runs")

    add_lora_routes(app, engine)

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest) -> Response:
        if not body.abort_all and body.rid is None:
            return error_response(400, "give a rid, or abort_all: true")
        await engine.async_abort(None if body.abort_all else body.rid)
        return Response(status_code=200)

    @app.post("/generate")
    async def generate(body: GenerateBody):
        request = generate_input(body)
        result = await engine.generate_request(request)
        if not request.stream:
            return result
        sse = server_sent_events(
            result, result, lambda chunk: json.dumps(chunk, ensure_ascii=False),
            lambda err: {"error": {"message": str(err)}},
        )
        return StreamingResponse(sse, media_type="text/event-stream")

    return app
