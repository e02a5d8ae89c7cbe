"""The ``radixlm`` command.

    radixlm generate "What is the capital of France?"    # streams the default model's answer
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixlm", description="A structured-generation runtime.")
    commands = parser.add_subparsers(dest="command", required=True)
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
    from radixlm.runtime.engine import Engine

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


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "generate":
            return _generate(args)
    except ValueError as err:
        print(f"radixlm: error: {err}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
