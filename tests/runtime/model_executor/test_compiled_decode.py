"""Decode compiled by torch.compile (``enable_torch_compile``) on CPUs: the same greedy tokens
as eager decode and logprobs within 1e-5 in float32, no compile after the start's warm-up at
any batch size it serves, eager decode (after one warning) where a pass would compile again,
for MoE models and where no C++ compiler is found, and the options it does not combine with
refused by name."""

from __future__ import annotations

import logging

import pytest
import torch
from workloads import PROMPTS, greedy

import radixlm
from radixlm.kernels.forward_batch import ForwardMode
from radixlm.models.model_config import ModelConfig
from radixlm.runtime.model_executor.compiled_decode import compile_decode
from radixlm.runtime.model_executor.model_runner import ModelRunner
from radixlm.runtime.server_args import ServerArgs

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory):
    """This module's compiles cached in a directory of their own (the Engine's processes
    inherit it), not in the user's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
        yield


@pytest.fixture
def dynamo_reset():
    """The test's compiled code is dropped after it (torch.compile's caches are
    process-wide)."""
    yield
    torch._dynamo.reset()


def runner_for(path, **options) -> ModelRunner:
    args = ServerArgs(str(path), dtype="float32", max_total_tokens=1024, **options)
    return ModelRunner(args, ModelConfig.from_path(str(path)))


@pytest.mark.slow
def test_compiled_decode_gives_the_tokens_and_logprobs_of_eager_decode(tiny_model_dir,
                                                                       inductor_cache):
    """Four prompts decoded together (the dynamic graph) and one alone (the one-request
    graph), against an engine decoding eagerly."""
    path = str(tiny_model_dir())
    results = {}
    for name, options in (("eager", {}),
                          ("compiled", {"enable_torch_compile": True,
                                        "torch_compile_max_bs": 8})):
        with radixlm.Engine(path, dtype="float32", max_total_tokens=2048, **options) as engine:
            together = engine.generate(PROMPTS[:4], greedy(24), return_logprob=True)
            alone = engine.generate(PROMPTS[4], greedy(24), return_logprob=True)
        results[name] = [*together, alone]
    for eager, compiled in zip(results["eager"], results["compiled"]):
        assert compiled["output_ids"] == eager["output_ids"]
        ours = torch.tensor([e[0] for e in compiled["meta_info"]["output_token_logprobs"]])
        theirs = torch.tensor([e[0] for e in eager["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(ours, theirs, rtol=0, atol=TOLERANCE)


def _prefill(runner: ModelRunner, rows: int, prompt: int) -> None:
    """Request rows 0..rows-1 hold ``prompt`` tokens each (slots of 64 per row, from 1)."""
    slots = torch.arange(1, 1 + rows * 64).view(rows, 64)
    runner.req_to_token_pool.req_to_token[:rows, :64] = slots
    ids = [(row * 13 + j) % 90 + 3 for row in range(rows) for j in range(prompt)]
    positions = [j for _ in range(rows) for j in range(prompt)]
    batch = runner.make_forward_batch(
        ForwardMode.EXTEND, ids, positions, slots[:, :prompt].reshape(-1).clone(),
        list(range(rows)), [0] * rows, [prompt] * rows)
    runner.forward(batch)


def _decode_batch(runner: ModelRunner, rows: int, kv_lens: list[int]):
    ids = [(7 * row + kv) % 100 + 3 for row, kv in enumerate(kv_lens)]
    inputs = runner.decode_inputs(ids, kv_lens, list(range(rows)))
    slots = runner.req_to_token_pool.req_to_token[torch.arange(rows), torch.tensor(kv_lens)]
    return runner.make_decode_batch(inputs, slots.clone(), kv_lens)


@pytest.mark.slow
@pytest.mark.parametrize("quantization", [None, "int8wo"])
def test_after_the_warm_up_no_batch_size_compiles_again(tiny_model_dir, inductor_cache,
                                                        dynamo_reset, quantization):
    """Batches of 1, 3 and 8 requests (the largest compiled) run the warm-up's graphs with
    the eager forward's result, with plain weights and with packed ones; one of 9 runs
    eagerly."""
    from torch._dynamo.utils import counters

    runner = runner_for(tiny_model_dir(), enable_torch_compile=True, torch_compile_max_bs=8,
                        quantization=quantization)
    try:
        compiled = runner.compiled_decode
        assert compiled is not None and compiled.max_batch_size == 8
        _prefill(runner, 9, 6)
        graphs = counters["stats"]["unique_graphs"]
        for rows in (1, 3, 8):
            kv_lens = [6 + row % 3 for row in range(rows)]  # ragged
            batch = _decode_batch(runner, rows, kv_lens)
            hidden = runner.forward(batch)
            with torch.inference_mode():  # eager, the same K/V written again
                runner.attn_backend.init_forward_metadata(batch)
                expected = runner.model(batch.input_ids, batch.positions, batch)
            assert torch.allclose(hidden, expected, rtol=0, atol=TOLERANCE)
        assert counters["stats"]["unique_graphs"] == graphs
        assert not compiled.can_run(_decode_batch(runner, 9, [6] * 9))
    finally:
        runner.close()


@pytest.mark.slow
def test_a_pass_that_would_compile_again_decodes_eagerly_from_then_on(
        tiny_model_dir, inductor_cache, dynamo_reset, caplog):
    """A guard the warm-up did not foresee (here the thread count the graphs were compiled
    for) fails the compiled pass before it runs; the step, and every later one, decodes
    eagerly, with the eager result, after one warning."""
    runner = runner_for(tiny_model_dir(), enable_torch_compile=True, torch_compile_max_bs=4)
    try:
        _prefill(runner, 2, 5)
        runner.compiled_decode.threads = 1 if runner.compiled_decode.threads > 1 else 2
        batch = _decode_batch(runner, 2, [5, 5])
        with caplog.at_level(logging.WARNING):
            hidden = runner.forward(batch)
        assert runner.compiled_decode is None
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "decode runs eagerly from now on" in warnings[0]
        with torch.inference_mode():
            runner.attn_backend.init_forward_metadata(batch)
            expected = runner.model(batch.input_ids, batch.positions, batch)
        assert torch.equal(hidden, expected)
    finally:
        runner.close()


def test_an_moe_model_decodes_eagerly_after_one_warning(tiny_model_dir, caplog):
    with caplog.at_level(logging.WARNING):
        runner = runner_for(tiny_model_dir("MixtralForCausalLM"), enable_torch_compile=True)
    try:
        assert runner.compiled_decode is None
        assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
            "enable_torch_compile: decode runs eagerly: MoE experts group tokens on the host "
            "(a compile per routing pattern)"]
    finally:
        runner.close()


def test_without_a_cpp_compiler_decode_runs_eagerly_after_one_warning(
        tiny_model_dir, caplog, dynamo_reset):
    from torch._inductor import config as inductor_config

    with (inductor_config.patch({"cpp.cxx": ("/nonexistent/c++",)}),
          caplog.at_level(logging.WARNING)):
        runner = runner_for(tiny_model_dir(), enable_torch_compile=True)
    try:
        assert runner.compiled_decode is None
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert "decode runs eagerly" in warnings[0] and "C++ compiler" in warnings[0]
        _prefill(runner, 2, 4)
        assert runner.forward(_decode_batch(runner, 2, [4, 4])).shape[0] == 2
    finally:
        runner.close()


def test_off_a_cpu_nothing_compiles_and_one_warning_says_why(caplog):
    with caplog.at_level(logging.WARNING):
        assert compile_decode(torch.nn.Identity(), torch.device("meta")) is None
    assert [r.getMessage() for r in caplog.records] == [
        "enable_torch_compile: decode runs eagerly: it compiles CPU decode, not meta"]


@pytest.mark.parametrize("options, named", [
    ({"tp_size": 2}, "tp_size"),
    ({"torch_compile_max_bs": 0}, "torch_compile_max_bs"),
])
def test_options_that_do_not_combine_with_compiling_are_refused_by_name(options, named):
    with pytest.raises(ValueError, match=named):
        ServerArgs(enable_torch_compile=True, device="cpu", **options)
