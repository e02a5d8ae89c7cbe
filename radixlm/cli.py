"""The ``radixlm`` command.

    radixlm generate "What is the capital of Japan?"    # streams the default model's answer
    radixlm serve --port 30000                           # SGLang's native HTTP API
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys

SERVER_OPTION_HELP = {
    "model_path": "a Hugging Face directory, a .gguf file or a hub id (default: the default model)",
    "tokenizer_path": "the tokenizer's directory (default: the model's)",
    "dtype": "auto (bf16 where the hardware has it, else float32 over 16-bit weights), "
             "float32, bfloat16, float16",
    "quantization": "weight-only format on CPUs: fp16wo (half), int8wo (int8) or gguf (the .gguf "
                    "model's own: F16 -> fp16wo, Q8_0 -> int8wo); compute stays in dtype",
    "device": "auto, cpu or cuda[:N]",
    "attention_backend": "auto, torch_native, triton or flashinfer",
    "disable_cuda_graph": "run GPU decode eagerly (no CUDA graphs)",
    "cuda_graph_max_bs": "largest decode batch captured as a CUDA graph",
    "enable_torch_compile": "CPUs: decode compiled by torch.compile (inductor), compiled at "
                            "start and cached on disk",
    "torch_compile_max_bs": "largest decode batch run compiled",
    "disable_cpu_kernels": "run CPU passes on torch's operations only (no fused C++ kernels)",
    "disable_cpu_weight_rows": "bfloat16 on CPUs: oneDNN's weight layout alone, no copy in the "
                               "fused kernels' layouts (slower decode)",
    "max_total_tokens": "KV pool size in tokens (default: from kv_cache_memory_fraction)",
    "kv_cache_memory_fraction": "share of free memory for the KV pool",
    "page_size": "tokens per KV page",
    "disable_radix_cache": "compute every prompt in full (no prefix cache)",
    "max_running_requests": "most requests decoded together",
    "context_length": "longest prompt + output (default: the model's)",
    "max_prefill_tokens": "most new prompt tokens per step",
    "chunked_prefill_size": "prefill longer prompts in chunks of this many tokens",
    "schedule_policy": "lpm, dfs-weight, fcfs, lof or random",
    "batching": "continuous or static",
    "init_new_token_ratio": "initial share of output budgets reserved in KV",
    "min_new_token_ratio": "lowest share of output budgets reserved in KV",
    "new_token_ratio_decay": "decay of that share per decode step",
    "random_seed": "seed for requests without sampling_seed",
    "num_threads": "CPU threads (default: adaptive)",
    "trust_remote_code": "allow model code from the checkpoint",
    "disaggregation_bootstrap_host": "where a prefill server's bootstrap service listens "
                                     "(default: --host)",
    "trust_request_chat_template": "let a chat request bring its own Jinja chat template "
                                   "(chat_template_kwargs.chat_template)",
    "host": "address to listen on",
    "port": "port to listen on",
    "api_key": "require 'Authorization: Bearer <key>' on every route but /health (visible in "
               "ps: prefer --api-key-file or RADIXLM_API_KEY)",
    "api_key_file": "a file whose first line is the API key",
    "shutdown_timeout": "seconds in-flight requests get to finish on SIGTERM",
    "chunked_prefill_step_ms": "cut prompt chunks to take about this long (by measured speed)",
    "health_timeout": "/health fails after this many seconds without a scheduler heartbeat "
                      "while requests wait",
    "served_model_name": "the model's name in the OpenAI API (default: its directory's name)",
    "max_queued_requests": "requests accepted beyond max_running_requests (more get 503)",
    "grammar_backend": "what compiles regex / json_schema / ebnf constraints (xgrammar)",
    "disable_jump_forward": "decode a grammar's forced text token by token",
    "disable_overlap_schedule": "process each decode step before computing the next",
    "max_logprobs": "most top logprobs per position a request may ask for",
    "max_n": "most samples per prompt (n)",
    "max_samples_per_request": "most prompts x n in one request",
    "max_prompt_logprob_entries": "most prompt positions with logprobs x (1 + top logprobs)",
    "max_stop_strings": "most stop strings plus stop regexes per prompt",
    "max_stop_chars": "most characters of a prompt's stop strings and regexes together",
    "max_stop_token_ids": "most stop_token_ids per prompt",
    "max_request_parameter_entries": "most stop token ids, logit_bias entries and stop "
                                     "characters of one call's samples (prompts x n) together",
    "max_logit_bias": "most logit_bias entries",
    "max_constraint_chars": "longest regex / JSON schema / EBNF constraint, in characters",
}


def add_server_options(parser: argparse.ArgumentParser) -> None:
    """One flag per ServerArgs field (``--max-total-tokens`` for ``max_total_tokens``)."""
    from radixlm.runtime.server_args import ServerArgs

    for option in dataclasses.fields(ServerArgs):
        flag = "--" + option.name.replace("_", "-")
        default = option.default
        help_text = f"{SERVER_OPTION_HELP.get(option.name, option.name)} (default: {default})"
        if isinstance(default, bool) or option.type == "bool | None":
            # A bare switch; an unset tri-state option stays None (resolved by ServerArgs).
            parser.add_argument(flag, action="store_true", default=default, help=help_text)
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
        prompt = args.prompt
        if not args.raw and engine.tokenizer.chat_template:
            prompt = engine.apply_chat_template([{"role": "user", "content": prompt}])
        params = {
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "sampling_seed": args.seed,
        }
        shown = 0
        for chunk in engine.generate(prompt, params, stream=True):
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
