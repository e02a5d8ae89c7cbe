"""The ``radixlm`` command.

    radixlm generate "What is the capital of Japan?"    # streams the default model's answer
    radixlm serve --port 30000                           # SGLang's native HTTP API
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import logging
import signal
import sys
from pathlib import Path


def server_option_help() -> dict[str, str]:
    """Each ServerArgs field's help: the first paragraph of the docstring under the field in
    ``server_args.py``, on one line, ````x```` shown as ``x``. Read with ``ast``: a docstring
    under a field is no attribute Python keeps."""
    from radixlm.runtime import server_args

    module = ast.parse(Path(server_args.__file__).read_text())
    body = next(node.body for node in module.body
                if isinstance(node, ast.ClassDef) and node.name == "ServerArgs")
    helps = {}
    for field, after in zip(body, body[1:]):
        if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            paragraph = inspect.cleandoc(after.value.value).split("\n\n")[0]
            helps[field.target.id] = " ".join(paragraph.replace("``", "").split())
    return helps


def add_server_options(parser: argparse.ArgumentParser) -> None:
    """One flag per ServerArgs field (``--max-total-tokens`` for ``max_total_tokens``)."""
    from radixlm.runtime.server_args import ServerArgs

    helps = server_option_help()
    for option in dataclasses.fields(ServerArgs):
        flag = "--" + option.name.replace("_", "-")
        default = option.default
        help_text = f"{helps[option.name]} (default: {default})".replace("%", "%%")
        if isinstance(default, bool) or option.type == "bool | None":
            # A bare switch; an unset tri-state option stays None (resolved by ServerArgs).
            parser.add_argument(flag, action="store_true", default=default, help=help_text)
        elif option.type.startswith("list["):  # space-separated values
            parser.add_argument(flag, nargs="+", default=default, help=help_text)
        else:
            kind = _option_type(option.type)
            parser.add_argument(flag, type=kind, default=default, help=help_text)


def _option_type(annotation: str):
    if "int" in annotation and "float" not in annotation:
        return int
    if "float" in annotation:
        return float
    return str


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixlm", description="A structured-generation runtime.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve", help="serve a model over HTTP (SGLang's native API)",
        description="Serve a model over HTTP with SGLang's native API.",
    )
    add_server_options(serve)
    serve.add_argument("--log-level", default="info", help="logging level")
    gen = commands.add_parser(
        "generate", help="stream a model's answer to a prompt",
        description="Generate text for one prompt and print it as it is produced.",
    )
    gen.add_argument("prompt", help="the user message (or raw text with --raw)")
    gen.add_argument("--model-path", default=None,
                     help="a Hugging Face directory, a .gguf file or a hub id "
                          "(default: SmolLM2-135M-Instruct, fetched on first use)")
    gen.add_argument("--max-new-tokens", type=int, default=256, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="sampling temperature (0: greedy)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed for reproducible output")
    gen.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    gen.add_argument("--raw", action="store_true",
                     help="send the prompt as is, without the model's chat template")
    gen.add_argument("--log-level", default="warning", help="logging level")
    return parser


def _generate(args: argparse.Namespace) -> int:
    from radixlm.runtime.engine.engine import Engine

    with Engine(args.model_path, dtype=args.dtype) as engine:
        prompt, input_ids = args.prompt, None
        if not args.raw and engine.tokenizer.chat_template:
            # The template writes the special tokens it wants (Gemma's starts with <bos>):
            # encoded as the chat route does, without the tokenizer adding its own.
            text = engine.apply_chat_template([{"role": "user", "content": prompt}])
            prompt, input_ids = None, engine.tokenizer.encode(text, add_special_tokens=False)
        params = {
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "sampling_seed": args.seed,
        }
        shown = 0
        for chunk in engine.generate(prompt, params, input_ids=input_ids, stream=True):
            text = chunk["text"]
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
        sys.stdout.write("\n")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from radixlm.runtime.engine.engine import Engine
    from radixlm.runtime.server.api_key import resolve_api_key
    from radixlm.runtime.server.graceful_shutdown import DrainingServer
    from radixlm.runtime.server.http_server import create_app
    from radixlm.runtime.server_args import ServerArgs

    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerArgs)}
    if options["node_rank"] > 0:  # another machine's share of the model's ranks only
        return _serve_ranks(ServerArgs(**options))
    api_key = resolve_api_key(options["api_key"], options["api_key_file"])
    with Engine(**options) as engine:
        server_args = engine.server_args
        app = create_app(engine, api_key, server_args.served_model_name)
        # The server drains on SIGTERM/SIGINT (graceful_shutdown.py), stops, then re-raises
        # the signal; with this handler in place the re-raise returns here, so the Engine's
        # children are stopped and the process exits 0.
        for stop_signal in (signal.SIGTERM, signal.SIGINT):
            signal.signal(stop_signal, lambda *_: None)
        print(f"radixlm: serving {engine.model_config.path} at "
              f"http://{server_args.host}:{server_args.port}", flush=True)
        config = uvicorn.Config(app, host=server_args.host, port=server_args.port,
                                log_level=args.log_level.lower(), timeout_graceful_shutdown=5)
        DrainingServer(config, engine, server_args.shutdown_timeout).run()
    return 0


def _serve_ranks(server_args) -> int:
    from radixlm.models.default_model import resolve_model_path
    from radixlm.runtime.model_executor.rank_processes import serve_node

    path = resolve_model_path(server_args.model_path)
    print(f"radixlm: node {server_args.node_rank} of {server_args.nnodes} hosts its share of "
          f"{server_args.tp_size} ranks of {path}, meeting at {server_args.dist_init_addr}",
          flush=True)
    return serve_node(server_args, str(path))


def main(argv: list[str] | None = None) -> int:
    """The ``radixlm`` command; the OpenMP policy is ``radixlm.openmp_policy``'s, set by
    importing the package."""
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            return _serve(args)
    except ValueError as err:
        print(f"radixlm: error: {err}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
