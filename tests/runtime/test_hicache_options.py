"""The hierarchical cache's options (radixlm/runtime/hicache_options.py): every value out of
range, and every combination that cannot work, is a ``ValueError`` naming the option where
``ServerArgs`` is built; the CLI parses the SGLang-named flags into the same fields; a
model whose sliding-window layers keep a hybrid pool refuses the cache when it is built."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from tiny_models import write_tiny_model

from radixlm.cli import add_server_options
from radixlm.runtime.scheduler.scheduler_process import build_scheduler
from radixlm.runtime.server_args import ServerArgs

ON = {"enable_hierarchical_cache": True}


@pytest.mark.parametrize("options, named", [
    ({**ON, "hicache_write_policy": "write_around"}, "hicache_write_policy"),
    ({**ON, "hicache_write_policy": ""}, "hicache_write_policy"),
    ({**ON, "hicache_storage_backend": "mooncake"}, "hicache_storage_backend"),
    ({**ON, "hicache_storage_backend": ""}, "hicache_storage_backend"),
    ({**ON, "hicache_ratio": 0}, "hicache_ratio"),
    ({**ON, "hicache_ratio": -1.5}, "hicache_ratio"),
    ({**ON, "hicache_ratio": float("nan")}, "hicache_ratio"),
    ({**ON, "hicache_ratio": True}, "hicache_ratio"),
    ({**ON, "hicache_size": -1}, "hicache_size"),
    ({**ON, "hicache_size": "4"}, "hicache_size"),
    ({**ON, "hicache_storage_size": 0}, "hicache_storage_size"),
    ({**ON, "hicache_block_tokens": 0}, "hicache_block_tokens"),
    ({**ON, "hicache_block_tokens": 6, "page_size": 4}, "hicache_block_tokens"),
    ({**ON, "hicache_block_tokens": 2, "page_size": 4}, "hicache_block_tokens"),
    ({**ON, "hicache_block_tokens": 8.0}, "hicache_block_tokens"),
    ({"hicache_write_policy": "bogus"}, "hicache_write_policy"),  # checked with it off too
    ({"hicache_storage_backend": "file"}, "hicache_storage_backend.*enable_hierarchical_cache"),
    ({**ON, "disable_radix_cache": True}, "enable_hierarchical_cache.*disable_radix_cache"),
])
def test_a_bad_hicache_option_is_a_value_error_naming_it(options, named):
    with pytest.raises(ValueError, match=named):
        ServerArgs(**options)


@pytest.mark.parametrize("options", [
    {},
    ON,
    {**ON, "hicache_write_policy": "write_through", "hicache_ratio": 0.5},
    {**ON, "hicache_size": 0.25, "hicache_block_tokens": 8, "page_size": 4},
    {**ON, "hicache_storage_backend": "file", "hicache_storage_dir": "/nonexistent/x"},
])
def test_good_hicache_options_are_accepted(options):
    args = ServerArgs(**options)
    for name, value in options.items():
        assert getattr(args, name) == value


def test_the_cli_parses_the_hicache_flags_into_server_args():
    parser = argparse.ArgumentParser()
    add_server_options(parser)
    parsed = parser.parse_args([
        "--enable-hierarchical-cache", "--hicache-ratio", "4", "--hicache-storage-backend",
        "file", "--hicache-storage-dir", "X", "--hicache-write-policy", "write_through",
        "--hicache-block-tokens", "16"])
    args = ServerArgs(**{f.name: getattr(parsed, f.name) for f in dataclasses.fields(ServerArgs)})
    assert args.enable_hierarchical_cache is True
    assert args.hicache_ratio == 4.0
    assert args.hicache_storage_backend == "file"
    assert args.hicache_storage_dir == "X"
    assert args.hicache_write_policy == "write_through"
    assert args.hicache_block_tokens == 16
    defaults = ServerArgs(**{f.name: getattr(parser.parse_args([]), f.name)
                             for f in dataclasses.fields(ServerArgs)})
    assert defaults.enable_hierarchical_cache is False
    assert defaults.hicache_storage_backend is None


def test_a_bad_hicache_flag_on_the_cli_is_an_error_naming_it():
    parser = argparse.ArgumentParser()
    add_server_options(parser)
    parsed = parser.parse_args(["--enable-hierarchical-cache", "--hicache-ratio", "0"])
    with pytest.raises(ValueError, match="hicache_ratio"):
        ServerArgs(**{f.name: getattr(parsed, f.name) for f in dataclasses.fields(ServerArgs)})


def test_a_sliding_window_model_with_a_hybrid_pool_refuses_the_hierarchical_cache(
        tmp_path):
    path = str(write_tiny_model(tmp_path / "mistral", "MistralForCausalLM", sliding_window=8))
    args = ServerArgs(path, dtype="float32", max_total_tokens=512, page_size=4,
                      disable_adaptive_timing=True, num_threads=1, **ON)
    with pytest.raises(ValueError, match="enable_hierarchical_cache.*sliding-window"):
        build_scheduler(args, path)
