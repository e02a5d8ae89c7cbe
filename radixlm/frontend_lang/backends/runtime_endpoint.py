"""``RuntimeEndpoint``: a radixlm (or SGLang) server's native API over HTTP.

Requests are JSON over ``urllib`` (one connection per call, so any number of executor threads
may call at once). The role markup comes from the server's own chat template when
``/get_model_info`` carries it (radixlm's does), else from a built-in chosen by model name.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import jinja2.sandbox

from radixlm.frontend_lang.backends.base import BackendError
from radixlm.frontend_lang.backends.native import NativeBackend
from radixlm.frontend_lang.chat_template import (
    ChatTemplate,
    from_renderer,
    template_for_model_name,
)


class RuntimeEndpoint(NativeBackend):
    """The server at ``base_url`` (e.g. ``http://127.0.0.1:30000``).

    The constructor asks the server for its model, so a server that is down fails here with a
    :class:`BackendError` naming the address.
    """

    def __init__(self, base_url: str, api_key: str | None = None,
                 timeout: float | None = 600.0) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.model_info = self._request("GET", "/get_model_info")
        self._template = _template_from_model_info(self.model_info)

    @property
    def chat_template(self) -> ChatTemplate:
        return self._template

    def _post(self, payload: dict[str, Any]) -> Any:
        return self._request("POST", "/generate", payload)

    def _post_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        with self._open("POST", "/generate", payload) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise BackendError(f"{self.base_url}/generate: {chunk['error']}")
                yield chunk

    def flush_cache(self) -> None:
        self._open("POST", "/flush_cache", None).close()

    def get_server_info(self) -> dict[str, Any]:
        return self._request("GET", "/get_server_info")

    def _request(self, method: str, path: str, payload: Any = None) -> Any:
        with self._open(method, path, payload) as response:
            return json.loads(response.read())

    def _open(self, method: str, path: str, payload: Any):
        url = self.base_url + path
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(url, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as err:
            raise BackendError(f"{method} {url} failed with HTTP {err.code}: "
                               f"{_error_message(err)}") from None
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise BackendError(f"cannot reach the server at {self.base_url}: {reason}") from None


def _error_message(err: urllib.error.HTTPError) -> str:
    body = err.read().decode(errors="replace")
    try:
        parsed = json.loads(body)
    except ValueError:
        return body[:500]
    if isinstance(parsed, dict):
        detail = parsed.get("error", parsed.get("detail", parsed))
        if isinstance(detail, dict):
            detail = detail.get("message", detail)
        return str(detail)
    return body[:500]


def _template_from_model_info(info: dict[str, Any]) -> ChatTemplate:
    name = str(info.get("model_path", ""))
    source = info.get("chat_template")
    if not source:
        return template_for_model_name(name)
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True,
                                                               lstrip_blocks=True)
    environment.globals["raise_exception"] = _raise_template_error
    compiled = environment.from_string(source)
    specials = {"bos_token": info.get("bos_token") or "", "eos_token": info.get("eos_token")
                or ""}
    return from_renderer(lambda messages: compiled.render(messages=messages, **specials), name)


def _raise_template_error(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)
