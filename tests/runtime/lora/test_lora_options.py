"""Tests of radixlm/runtime/lora_options.py and the LoRA fields of ServerArgs: SGLang's
command line parses, every bad value is a ValueError naming its option, and LoRA refuses the
features it does not combine with yet."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from radixlm.cli import add_server_options
from radixlm.runtime.lora_options import parse_lora_paths
from radixlm.runtime.server_args import ServerArgs


def from_command_line(*argv: str) -> ServerArgs:
    parser = argparse.ArgumentParser()
    add_server_options(parser)
    args = parser.parse_args(list(argv))
    return ServerArgs(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerArgs)})


def test_sglang_s_command_line_parses():
    args = from_command_line("--lora-paths", "a=/x", "b=/y", "--max-loras-per-batch", "4",
                             "--lora-target-modules", "q_proj", "v_proj",
                             "--max-lora-rank", "32")
    assert args.lora_paths == ["a=/x", "b=/y"] and args.enable_lora
    assert args.max_loras_per_batch == 4 and args.max_lora_rank == 32
    assert args.lora_target_modules == ["q_proj", "v_proj"]
    assert from_command_line("--enable-lora").enable_lora
    assert from_command_line("--lora-target-modules", "all").lora_target_modules is None
    plain = from_command_line()
    assert not plain.enable_lora and plain.lora_paths is None
    assert plain.max_loras_per_batch == 8 and plain.max_lora_rank is None


def test_lora_paths_name_adapters_or_are_named_by_their_path():
    assert parse_lora_paths(["a=/x", "models/b", "c=/y=z"]) == {
        "a": "/x", "models/b": "models/b", "c": "/y=z"}
    args = ServerArgs(lora_paths="solo=/x")
    assert args.lora_paths == ["solo=/x"] and args.enable_lora


def test_a_bare_absolute_path_is_named_by_itself():
    assert parse_lora_paths(["/models/b"]) == {"/models/b": "/models/b"}


@pytest.mark.parametrize("options, words", [
    ({"max_loras_per_batch": 0}, "max_loras_per_batch must be an integer in 1..256"),
    ({"max_loras_per_batch": 257}, "max_loras_per_batch"),
    ({"max_loras_per_batch": True}, "max_loras_per_batch"),
    ({"max_loras_per_batch": "4"}, "max_loras_per_batch"),
    ({"max_lora_rank": 0}, "max_lora_rank must be an integer in 1..512"),
    ({"max_lora_rank": 513}, "max_lora_rank"),
    ({"max_lora_rank": 8.0}, "max_lora_rank"),
    ({"lora_target_modules": ["q_proj", "qkv_proj"]}, "lora_target_modules must name"),
    ({"lora_target_modules": []}, "lora_target_modules"),
    ({"lora_target_modules": ["lm_head"]}, "lora_target_modules"),
    ({"lora_paths": ["a=/x", "a=/y"]}, "names adapter 'a' twice"),
    ({"lora_paths": ["bad name=/x"]}, "adapter name"),
    ({"lora_paths": ["=/x"]}, "adapter name"),
    ({"lora_paths": [""]}, "lora_paths entries must be"),
    ({"lora_paths": [3]}, "lora_paths entries must be"),
])
def test_bad_options_are_value_errors_naming_them(options, words):
    with pytest.raises(ValueError, match=words):
        ServerArgs(**options)


def test_bad_command_lines_name_the_option():
    with pytest.raises(ValueError, match="max_loras_per_batch"):
        from_command_line("--lora-paths", "a=/x", "--max-loras-per-batch", "0")
    with pytest.raises(ValueError, match="lora_target_modules"):
        from_command_line("--lora-target-modules", "q_proj", "o")
