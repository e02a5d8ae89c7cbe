"""Many LoRA adapters served by one Engine (issue 61): outputs and logprobs equal transformers +
peft for batches mixing adapters and the base model, under every scheduling path (prefix
hits, chunked prefill, retraction, overlap, pages of 4); the prefix cache keyed by adapter;
a hundred adapters registered; bad adapters refused while the others serve on; unloading an
adapter a running request uses."""

from __future__ import annotations

import shutil
from pathlib import Path

import beam_reference
import pytest
import torch
from beam_reference import beam
from lora_adapters import (
    ALL,
    assert_matches_reference,
    peft_reference,
    random_prompts,
    reference_greedy_logprobs,
    reference_prompt_logprobs,
    write_config,
    write_peft_adapter,
    write_raw_adapter,
)
from runtime_checks import entry_limits, run_to_completion, scheduler_req

import radixlm
from radixlm.runtime.engine.request_inputs import GenerateInput, build_generate_reqs
from radixlm.runtime.scheduler.scheduler_process import build_scheduler
from radixlm.runtime.server_args import ServerArgs

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
# Four adapters unlike each other: ranks 2 to 8, rsLoRA, per-module ranks and alphas, and
# target sets from two projections to all seven.
ADAPTER_CONFIGS = {
    "qv4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all8rs": dict(r=8, lora_alpha=16, target_modules=ALL, use_rslora=True),
    "patterned": dict(r=4, lora_alpha=8,
                      target_modules=["q_proj", "k_proj", "gate_proj", "up_proj"],
                      rank_pattern={"k_proj": 2, "layers.1.mlp.up_proj": 6},
                      alpha_pattern={"gate_proj": 3}),
    "od2": dict(r=2, lora_alpha=4, target_modules=["o_proj", "down_proj"]),
}
NAMES = [*ADAPTER_CONFIGS, None]


@pytest.fixture(scope="module")
def adapters_of(tiny_model_dir, tmp_path_factory):
    """architecture -> {name: directory} of the four adapters over its tiny model."""
    made: dict[str, dict[str, Path]] = {}

    def make(architecture: str) -> dict[str, Path]:
        if architecture not in made:
            root = tmp_path_factory.mktemp(f"lora-{architecture}")
            model_dir = tiny_model_dir(architecture)
            made[architecture] = {
                name: write_peft_adapter(model_dir, root / name, seed=10 + i, **config)
                for i, (name, config) in enumerate(ADAPTER_CONFIGS.items())}
        return made[architecture]

    return make


def lora_options(adapters: dict[str, Path], **options) -> dict:
    """Engine options serving ``adapters`` from start-up (a tuple: engine_for keys on it)."""
    return {"lora_paths": tuple(f"{name}={path}" for name, path in adapters.items()),
            "max_loras_per_batch": 4, **options}


def mixed(prompts: list[list[int]]) -> list[str | None]:
    """Each prompt's adapter: the four and the base model in turn."""
    return [NAMES[i % len(NAMES)] for i in range(len(prompts))]


def check_mixed_batch(engine, model_dir, adapters, prompts, **sampling) -> list[dict]:
    names = mixed(prompts)
    outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, **sampling},
                           lora_path=names, return_logprob=True)
    assert_matches_reference(model_dir, adapters, prompts, names, outs,
                             sampling.get("max_new_tokens", GREEDY["max_new_tokens"]))
    return outs


def test_a_batch_mixing_four_adapters_and_the_base_equals_peft(engine_for, tiny_model_dir,
                                                               adapters_of):
    adapters = adapters_of("LlamaForCausalLM")
    engine = engine_for(**lora_options(adapters))
    prompts = random_prompts(10, seed=1)
    check_mixed_batch(engine, tiny_model_dir(), adapters, prompts)
    # each adapter changes the outputs: the test would see an adapter left out
    base = [reference_greedy_logprobs(tiny_model_dir(), None, p, 8)[0] for p in prompts]
    outs = engine.generate(input_ids=prompts[:4], sampling_params=GREEDY,
                           lora_path=list(ADAPTER_CONFIGS))
    assert all(out["output_ids"] != want for out, want in zip(outs, base))


def test_prompt_logprobs_and_parallel_samples_use_the_adapter(engine_for, tiny_model_dir,
                                                              adapters_of):
    adapters = adapters_of("LlamaForCausalLM")
    engine = engine_for(**lora_options(adapters))
    prompts = random_prompts(5, seed=12)
    names = mixed(prompts)
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names,
                           return_logprob=True, logprob_start_len=0)
    for prompt, name, out in zip(prompts, names, outs):
        entries = out["meta_info"]["input_token_logprobs"][1:]
        want = reference_prompt_logprobs(tiny_model_dir(), name and adapters[name], prompt)
        assert [entry[1] for entry in entries] == prompt[1:]
        torch.testing.assert_close(torch.tensor([entry[0] for entry in entries]),
                                   torch.tensor(want), atol=1e-4, rtol=0)
    outs = engine.generate(input_ids=prompts[:2], sampling_params={**GREEDY, "n": 2},
                           lora_path=["all8rs", "patterned"])
    assert_matches_reference(tiny_model_dir(), adapters, [prompts[0]] * 2 + [prompts[1]] * 2,
                             ["all8rs"] * 2 + ["patterned"] * 2, outs, 8)


def test_a_beam_search_under_an_adapter_equals_peft_s(engine_for, tiny_model_dir, adapters_of,
                                                      monkeypatch):
    adapters = adapters_of("LlamaForCausalLM")
    engine = engine_for(**lora_options(adapters))
    path = tiny_model_dir()
    monkeypatch.setattr(beam_reference, "reference_model",
                        lambda directory: peft_reference(directory, adapters["all8rs"]))
    prompt = random_prompts(1, seed=16)[0]
    eos = sorted(engine.model_config.eos_token_ids)
    outs = engine.generate(input_ids=prompt, sampling_params=beam(3, 6), lora_path="all8rs")
    expected = beam_reference.reference_beams(path, prompt, 3, 6, 1.0, False, eos)
    beam_reference.check_beams(outs, expected, 1.0, eos, 6, path, prompt)


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                          "MistralForCausalLM"])
def test_mixed_batches_equal_peft_on_other_architectures(engine_for, tiny_model_dir,
                                                         adapters_of, architecture):
    adapters = adapters_of(architecture)
    engine = engine_for(architecture, **lora_options(adapters))
    check_mixed_batch(engine, tiny_model_dir(architecture), adapters,
                      random_prompts(10, seed=2))


SCHEDULING = {
    "chunked": dict(chunked_prefill_size=8),
    "overlap": dict(disable_overlap_schedule=False),
    "page4": dict(page_size=4),
    "retraction": dict(max_total_tokens=320, max_running_requests=32,
                       init_new_token_ratio=0.01, min_new_token_ratio=0.01,
                       new_token_ratio_decay=0.5),
}


def run_scheduling_case(engine_for, tiny_model_dir, adapters_of, options) -> list[dict]:
    adapters = adapters_of("LlamaForCausalLM")
    engine = engine_for(**lora_options(adapters, **options))
    prompts = random_prompts(20, seed=3, high=60)
    first = check_mixed_batch(engine, tiny_model_dir(), adapters, prompts, max_new_tokens=16)
    # the same prompts again: prefix hits under each adapter, the same outputs
    again = check_mixed_batch(engine, tiny_model_dir(), adapters, prompts, max_new_tokens=16)
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in first]
    if "max_total_tokens" not in options:  # (a small pool may have evicted them)
        assert all(o["meta_info"]["cached_tokens"] > 0 for o in again)
    return first + again


def test_chunked_prefill_on_pages_of_four_with_overlap_equals_peft(engine_for, tiny_model_dir,
                                                                   adapters_of):
    run_scheduling_case(engine_for, tiny_model_dir, adapters_of,
                        {**SCHEDULING["chunked"], **SCHEDULING["overlap"],
                         **SCHEDULING["page4"]})


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(SCHEDULING))
def test_each_scheduling_path_equals_peft(engine_for, tiny_model_dir, adapters_of, case):
    outs = run_scheduling_case(engine_for, tiny_model_dir, adapters_of, SCHEDULING[case])
    if case == "retraction":
        assert sum(o["meta_info"]["total_retractions"] for o in outs) > 0, "never retracted"


def test_cached_prefixes_never_cross_adapters(engine_for, tiny_model_dir, adapters_of):
    adapters = adapters_of("LlamaForCausalLM")
    engine = engine_for(**lora_options(adapters))
    prompt = random_prompts(1, seed=4, low=40, high=40)[0]
    order = ["qv4", "od2", None, "qv4", None, "od2"]
    cached = []
    for name in order:
        out = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path=name,
                              return_logprob=True)
        assert_matches_reference(tiny_model_dir(), adapters, [prompt], [name], [out], 8)
        cached.append(out["meta_info"]["cached_tokens"])
    assert cached[:3] == [0, 0, 0]
    assert all(count >= len(prompt) - 1 for count in cached[3:]), cached


def test_no_extra_key_reaches_an_adapter_s_cached_prefixes(engine_for, tiny_model_dir,
                                                           adapters_of):
    adapters = adapters_of("LlamaForCausalLM")
    engine = engine_for(**lora_options(adapters))
    prompt = random_prompts(1, seed=14, low=40, high=40)[0]
    engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="qv4")
    with pytest.raises(ValueError, match="extra_key must not hold a NUL"):  # (the separator)
        engine.generate(input_ids=prompt, sampling_params=GREEDY, extra_key="\x00lora:qv4")
    out = engine.generate(input_ids=prompt, sampling_params=GREEDY, extra_key="lora:qv4",
                          return_logprob=True)
    assert out["meta_info"]["cached_tokens"] == 0
    assert_matches_reference(tiny_model_dir(), adapters, [prompt], [None], [out], 8)


# Scale -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hundred(tmp_path_factory) -> dict[str, Path]:
    """100 small adapters (ranks 1 and 2, on q and v or o and down), written by hand."""
    root = tmp_path_factory.mktemp("hundred")
    return {f"h{i:03d}": write_raw_adapter(root / f"h{i:03d}", seed=i, rank=1 + i % 2,
                                           targets=("q_proj", "v_proj") if i % 3
                                           else ("o_proj", "down_proj"))
            for i in range(100)}


@pytest.mark.slow
def test_a_hundred_adapters_sixteen_in_one_batch(engine_for, tiny_model_dir, hundred):
    engine = engine_for(**lora_options(hundred, max_loras_per_batch=16, max_lora_rank=2))
    assert engine.lora_adapters() == sorted(hundred)
    names = [f"h{i:03d}" for i in range(0, 96, 6)]  # 16 distinct
    prompts = random_prompts(32, seed=5)
    chosen = [names[i % 16] for i in range(32)]
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=chosen,
                           return_logprob=True)
    sample = list(range(0, 32, 5))
    assert_matches_reference(tiny_model_dir(), hundred, [prompts[i] for i in sample],
                             [chosen[i] for i in sample], [outs[i] for i in sample], 8)
    slots = engine.get_server_info()["lora"]["slots"]
    assert len(slots) == 16 and sorted(slots) == sorted(names)
    # all hundred, four slots: every request finishes right, however long it waits
    small = engine_for(**lora_options(hundred, max_loras_per_batch=4, max_lora_rank=2))
    every = sorted(hundred)
    outs = small.generate(input_ids=random_prompts(100, seed=6), sampling_params=GREEDY,
                          lora_path=every)
    sample = list(range(0, 100, 9))
    assert_matches_reference(tiny_model_dir(), hundred,
                             [random_prompts(100, seed=6)[i] for i in sample],
                             [every[i] for i in sample], [outs[i] for i in sample], 8)
    assert len(small.get_server_info()["lora"]["slots"]) == 4


# Bad input ---------------------------------------------------------------------------------


def test_an_unknown_adapter_is_a_value_error_naming_it(engine_for, adapters_of):
    engine = engine_for(**lora_options(adapters_of("LlamaForCausalLM")))
    with pytest.raises(ValueError, match="'nope'"):
        engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY, lora_path="nope")
    with pytest.raises(ValueError, match="'nope'"):
        engine.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params=GREEDY,
                        lora_path=["qv4", "nope"])
    with pytest.raises(ValueError, match="lora_path has 1 entries for 2 prompts"):
        engine.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params=GREEDY,
                        lora_path=["qv4"])
    with pytest.raises(ValueError, match="must name an adapter"):
        engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY, lora_path=3)


def test_lora_path_on_a_server_without_adapters_is_a_value_error():
    request = GenerateInput(input_ids=[5, 6, 7], lora_path="qv4")
    with pytest.raises(ValueError, match="needs a server started with LoRA adapters"):
        build_generate_reqs(request, None, entry_limits())
    request = GenerateInput(input_ids=[5, 6, 7], lora_path=[None])
    messages, _ = build_generate_reqs(request, None, entry_limits())
    assert [message.lora_path for message in messages] == [None]


def bad_adapters(good: Path, root: Path) -> dict[str, tuple[Path, str]]:
    """name -> (a broken copy of ``good``, words its error must hold)."""
    made = {}

    def broken(name: str, words: str, change) -> None:
        target = root / name
        shutil.copytree(good, target)
        change(target)
        made[name] = (target, words)

    weights = "adapter_model.safetensors"
    broken("truncated", "unreadable", lambda d: (d / weights).write_bytes(
        (d / weights).read_bytes()[:100]))
    broken("no-config", "no adapter_config.json", lambda d: (d / "adapter_config.json").unlink())
    broken("pickled", "adapter_model.bin is a pickle",
           lambda d: (d / weights).rename(d / "adapter_model.bin"))
    broken("dora", "DoRA", lambda d: write_config(d, r=8, use_dora=True, target_modules=ALL))
    broken("saved-modules", "modules_to_save", lambda d: write_config(
        d, r=8, modules_to_save=["lm_head"], target_modules=ALL))
    broken("bias", "bias", lambda d: write_config(d, r=8, bias="all", target_modules=ALL))
    broken("foreign-modules", "not served", lambda d: write_config(
        d, r=8, target_modules=["embed_tokens"]))
    return made


def test_bad_adapters_are_refused_and_the_others_serve_on(engine_for, tiny_model_dir,
                                                          adapters_of, tmp_path):
    adapters = adapters_of("LlamaForCausalLM")
    engine = engine_for(**lora_options(adapters))
    rank = engine.get_server_info()["lora"]["max_lora_rank"]
    assert rank == 16  # (the default floor: the start-up adapters' highest rank is 8)
    high = write_raw_adapter(tmp_path / "high", seed=1, rank=rank + 1)
    cases = {**bad_adapters(adapters["all8rs"], tmp_path),
             "too-high": (high, f"above --max-lora-rank {rank}"),
             "nowhere": (tmp_path / "nowhere", "no adapter_config.json"),
             "qv4": (adapters["od2"], "'qv4' is loaded already")}
    for name, (path, words) in cases.items():
        with pytest.raises(ValueError, match=words):
            engine.load_lora_adapter(name, str(path))
    with pytest.raises(ValueError, match="adapter name"):
        engine.load_lora_adapter("bad name!", str(adapters["qv4"]))
    with pytest.raises(ValueError, match="no adapter named 'ghost'"):
        engine.unload_lora_adapter("ghost")
    assert engine.lora_adapters() == sorted(ADAPTER_CONFIGS)
    check_mixed_batch(engine, tiny_model_dir(), adapters, random_prompts(5, seed=7))


@pytest.mark.slow
def test_a_bad_start_up_adapter_is_a_value_error_naming_it(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="no adapter_config.json in .*nowhere"):
        radixlm.Engine(str(tiny_model_dir()), dtype="float32",
                       lora_paths=[f"bad={tmp_path / 'nowhere'}"])


@pytest.mark.slow
def test_target_modules_outside_the_served_ones_are_refused(engine_for, tiny_model_dir,
                                                            adapters_of, tmp_path):
    adapters = adapters_of("LlamaForCausalLM")
    engine = engine_for(enable_lora=True, lora_target_modules=("q_proj", "v_proj"),
                        max_lora_rank=4)
    with pytest.raises(ValueError, match="are not in --lora-target-modules"):
        engine.load_lora_adapter("all8rs", str(adapters["all8rs"]))
    with pytest.raises(ValueError, match="above --max-lora-rank 4"):
        engine.load_lora_adapter("qv8", str(write_raw_adapter(tmp_path / "qv8", seed=2,
                                                             rank=8)))
    assert engine.load_lora_adapter("qv4", str(adapters["qv4"]))["rank"] == 4
    prompts = random_prompts(3, seed=8)
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY,
                           lora_path=["qv4", None, "qv4"])
    assert_matches_reference(tiny_model_dir(), adapters, prompts, ["qv4", None, "qv4"], outs, 8)


@pytest.mark.slow
def test_a_restart_with_other_weights_under_a_name_loads_no_stale_kv(tiny_model_dir,
                                                                     adapters_of, tmp_path):
    adapters = adapters_of("LlamaForCausalLM")
    path = tiny_model_dir()
    prompt = random_prompts(1, seed=13, low=70, high=70)[0]
    options = {"dtype": "float32", "num_threads": 1, "max_total_tokens": 256,
               "enable_hierarchical_cache": True, "hicache_block_tokens": 8,
               "hicache_storage_backend": "file", "hicache_storage_dir": str(tmp_path / "kv"),
               "hicache_write_policy": "write_through"}
    outs, cached = [], []
    for adapter in ("od2", "qv4"):
        args = ServerArgs(str(path), lora_paths=[f"same={adapters[adapter]}"], **options)
        scheduler = build_scheduler(args, str(path))
        try:
            req = scheduler_req(scheduler, prompt, GREEDY, lora_path="same")
            run_to_completion(scheduler, [req])
            outs.append({"output_ids": req.output_ids, "meta_info": {}})
            cached.append(req.cached_tokens)
        finally:
            scheduler.shutdown()
    assert cached == [0, 0]
    assert_matches_reference(path, {"a": adapters["od2"], "b": adapters["qv4"]},
                             [prompt, prompt], ["a", "b"], outs, 8)


@pytest.mark.slow
def test_a_mixture_of_experts_model_serves_attention_adapters_only(engine_for, tiny_model_dir,
                                                                   tmp_path):
    """Mixtral's experts are no dense projections: adapters of its attention serve, one of
    an MLP projection is refused naming it."""
    architecture = "MixtralForCausalLM"
    engine = engine_for(architecture, enable_lora=True, max_lora_rank=4)
    attention = write_raw_adapter(tmp_path / "attention", seed=3, rank=2,
                                  targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    mlp = write_raw_adapter(tmp_path / "mlp", seed=4, rank=2, targets=("q_proj", "down_proj"))
    with pytest.raises(ValueError, match=r"\['down_proj'\] are not projections of this model"):
        engine.load_lora_adapter("mlp", str(mlp))
    engine.load_lora_adapter("attention", str(attention))
    prompts = random_prompts(4, seed=15)
    names = ["attention", None, "attention", None]
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names,
                           return_logprob=True)
    assert_matches_reference(tiny_model_dir(architecture), {"attention": attention}, prompts,
                             names, outs, 8)
    engine.unload_lora_adapter("attention")


# Loading and unloading while serving -----------------------------------------------------


def test_loading_unloading_and_loading_again(engine_for, tiny_model_dir, adapters_of):
    adapters = adapters_of("LlamaForCausalLM")
    engine = engine_for(**lora_options(adapters))
    prompt = random_prompts(1, seed=9)[0]
    served = {**adapters, "again": adapters["od2"]}
    for _ in range(2):
        reply = engine.load_lora_adapter("again", str(adapters["od2"]))
        assert reply["rank"] == 2 and reply["target_modules"] == ["down_proj", "o_proj"]
        assert "again" in engine.lora_adapters()
        out = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="again",
                              return_logprob=True)
        assert_matches_reference(tiny_model_dir(), served, [prompt], ["again"], [out], 8)
        assert engine.unload_lora_adapter("again")["in_use"] is False
        assert "again" not in engine.lora_adapters()
        lora = engine.get_server_info()["lora"]
        assert "again" not in lora["adapters"] + lora["slots"] + lora["retiring"]
        with pytest.raises(ValueError, match="'again'"):
            engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="again")


def test_a_name_loaded_again_with_other_weights_reuses_no_cached_kv(engine_for, tiny_model_dir,
                                                                    adapters_of):
    adapters = adapters_of("LlamaForCausalLM")
    engine = engine_for(**lora_options(adapters))
    prompt = random_prompts(1, seed=11)[0]
    try:
        engine.load_lora_adapter("renamed", str(adapters["od2"]))
        engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="renamed")
        engine.unload_lora_adapter("renamed")
        engine.load_lora_adapter("renamed", str(adapters["qv4"]))
        out = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="renamed",
                              return_logprob=True)
        assert out["meta_info"]["cached_tokens"] == 0
        assert_matches_reference(tiny_model_dir(), {"renamed": adapters["qv4"]}, [prompt],
                                 ["renamed"], [out], 8)
    finally:
        if "renamed" in engine.lora_adapters():
            engine.unload_lora_adapter("renamed")


def test_unloading_an_adapter_a_running_request_uses(engine_for, tiny_model_dir, adapters_of):
    adapters = adapters_of("LlamaForCausalLM")
    engine = engine_for(**lora_options(adapters))
    engine.load_lora_adapter("busy", str(adapters["all8rs"]))
    prompt = random_prompts(1, seed=10)[0]
    long = {**GREEDY, "max_new_tokens": 256}  # (still running when the unload comes)
    chunks = engine.generate(input_ids=prompt, sampling_params=long, lora_path="busy",
                             stream=True)
    first = next(chunks)
    assert engine.unload_lora_adapter("busy")["in_use"] is True
    assert "busy" not in engine.lora_adapters()
    assert engine.get_server_info()["lora"]["retiring"] == ["busy"]
    with pytest.raises(ValueError, match="'busy'"):
        engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="busy")
    last = [first, *chunks][-1]
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert_matches_reference(tiny_model_dir(), {"busy": adapters["all8rs"]}, [prompt],
                             ["busy"], [last], 256)
    engine.generate(input_ids=[5, 6], sampling_params=GREEDY)  # a step after it ended
    lora = engine.get_server_info()["lora"]
    assert lora["retiring"] == [] and "busy" not in lora["slots"]
    engine.load_lora_adapter("busy", str(adapters["all8rs"]))
    out = engine.generate(input_ids=prompt, sampling_params=long, lora_path="busy")
    assert out["output_ids"] == last["output_ids"]
    engine.unload_lora_adapter("busy")
