"""SGLang's routes for loading and unloading LoRA adapters at runtime.

``POST /load_lora_adapter`` ``{"lora_name", "lora_path"}`` reads a PEFT adapter directory on
the server's machine and serves it under the name; ``POST /unload_lora_adapter``
``{"lora_name"}`` takes the name away from new requests (those running on it keep it until
they end). Both answer as SGLang does (``success``, ``error_message``, ``loaded_adapters``);
anything wrong (a taken or unknown name, a missing or corrupt file, a rank above the
server's maximum, modules the model lacks) is a 400 naming it, and the server serves on.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from radixlm.runtime.engine.engine import Engine


class LoadLoraBody(BaseModel):
    model_config = ConfigDict(extra="ignore")  # (SGLang's ``pinned``: every adapter may move)

    lora_name: str
    lora_path: str


class UnloadLoraBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str


def add_lora_routes(app: FastAPI, engine: Engine) -> None:
    @app.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraBody) -> JSONResponse:
        return await _answer(engine, engine.async_load_lora_adapter(body.lora_name,
                                                                    body.lora_path))

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraBody) -> JSONResponse:
        return await _answer(engine, engine.async_unload_lora_adapter(body.lora_name))


async def _answer(engine: Engine, call) -> JSONResponse:
    try:
        info: dict[str, Any] = await call
    except ValueError as err:
        return JSONResponse({"success": False, "error_message": str(err),
                             "error": {"message": str(err)}}, status_code=400)
    return JSONResponse({"success": True, "error_message": "", **info,
                         "loaded_adapters": engine.lora_adapters()})
