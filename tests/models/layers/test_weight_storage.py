"""16-bit weight storage for float32 serving (dtype=auto on CPUs without native bfloat16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import reference_model

from radixlm.models.layers.linear import Linear
from radixlm.models.layers.tensor_parallel import SINGLE
from radixlm.models.layers.weight_formats import (
    HALF_FUSED_MAX_ROWS_FLOAT32,
    ConversionBuffer,
    HalfWeight,
)
from radixlm.models.layers.weight_storage import (
    SIXTEEN_BIT_STORAGE,
    BlockedWeight,
    WidenedWeight,
    storage_dtype,
    store_in_16_bits,
)
from radixlm.models.loader import load_model
from radixlm.models.model_config import ModelConfig
from radixlm.runtime.device_choice import cpu_has_native_bf16

PROMPT = ("The quick brown fox jumps over the lazy dog; Paris is the capital of France, "
          "Berlin the capital of Germany, and Rome the capital of Italy. Numbers: 1 2 3 4. "
          "Rivers: the Seine, the Rhine, the Danube and the Tiber, which flows through Rome; "
          "colours: red, green, blue, yellow, violet and a grey that is nearly black.")


def test_a_weight_is_stored_in_the_16_bit_type_that_holds_it_best():
    torch.manual_seed(0)
    bfloat16_numbers = torch.randn(8, 16).bfloat16().float()
    assert storage_dtype(bfloat16_numbers) == torch.bfloat16  # exact
    rounded = torch.randn(8, 16)  # float32 values: float16 keeps 11 significant bits
    assert storage_dtype(rounded) == torch.float16
    beyond = rounded.clone()
    beyond[3, 4] = 1e5  # past float16's range (and not a bfloat16 number)
    assert storage_dtype(beyond) is None
    with_nan = bfloat16_numbers.clone()
    with_nan[0, 0] = float("nan")
    assert storage_dtype(with_nan) is None
    assert storage_dtype(bfloat16_numbers.bfloat16()) is None  # only float32 weights
    assert storage_dtype(bfloat16_numbers, half_only=True) == torch.float16  # fp16wo's
    assert storage_dtype(beyond, half_only=True) is None


def stored_type(packed) -> torch.dtype:
    """The 16-bit type a packed weight keeps its values in."""
    return (packed.blocks if isinstance(packed, BlockedWeight) else packed.weight).dtype


@pytest.mark.parametrize("stored_as", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 33, HALF_FUSED_MAX_ROWS_FLOAT32,
                                  HALF_FUSED_MAX_ROWS_FLOAT32 + 1])
@pytest.mark.parametrize("out_features, layout", [(96, BlockedWeight), (88, WidenedWeight)])
def test_each_path_multiplies_by_the_weight_it_stores(stored_as, rows, out_features, layout,
                                                      cpu_kernels):
    """A few rows on the kernels (widened in registers) or, like larger passes, widened into
    the buffer: the float32 product with the stored values, to float32 rounding. Weights of
    a multiple of 16 rows are kept in column blocks, others in rows."""
    torch.manual_seed(rows)
    layer = Linear(64, out_features, bias=True)
    with torch.no_grad():
        layer.weight.copy_((torch.randn(out_features, 64) * 0.05).to(stored_as).float())
    expected_weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    counts = store_in_16_bits(torch.nn.Sequential(layer))
    assert counts[str(stored_as).removeprefix("torch.")] == 1
    assert counts["bytes"] == out_features * 64 * 2
    assert isinstance(layer.packed, layout) and stored_type(layer.packed) == stored_as
    assert torch.equal(layer.packed.dequantized(), expected_weight)
    x = torch.randn(rows, 64)
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    torch.testing.assert_close(got, F.linear(x, expected_weight, bias), atol=1e-5, rtol=1e-5)
    # Widened (the layer's own steps, to the bit): rows above the rows kernel's limit or
    # without the kernels; blocks only without them (the kernel takes every pass), widened
    # to the weight's transpose.
    if layout is WidenedWeight and (rows > HALF_FUSED_MAX_ROWS_FLOAT32 or cpu_kernels == "torch"):
        assert torch.equal(got, F.linear(x, expected_weight) + bias)
    if layout is BlockedWeight and cpu_kernels == "torch":
        assert torch.equal(got, torch.matmul(x, expected_weight.T.contiguous()) + bias)


def test_packing_one_weight_picks_its_storage_type():
    """WidenedWeight.pack (which it inherited from HalfWeight, always float16, before it had
    its own) stores in the type store_in_16_bits picks; nothing in the loader calls it."""
    buffer = ConversionBuffer()
    exact = (torch.randn(8, 16) * 0.1).bfloat16().float()
    assert WidenedWeight.pack(exact, buffer).weight.dtype == torch.bfloat16
    rounded = torch.randn(8, 16) * 0.1
    packed = WidenedWeight.pack(rounded, buffer)
    assert packed.weight.dtype == torch.float16
    assert torch.equal(packed.dequantized(), rounded.half().float())
    with pytest.raises(ValueError, match="within float16's range"):
        WidenedWeight.pack(torch.full((8, 16), 1e6), buffer)


def test_weights_16_bits_cannot_hold_stay_float32():
    layers = torch.nn.Sequential(Linear(16, 8, bias=False), Linear(8, 16, bias=False))
    with torch.no_grad():
        layers[0].weight.fill_(1e6)  # beyond float16, not a bfloat16 number
        layers[1].weight.fill_(0.5)
    counts = store_in_16_bits(layers)
    assert counts == {"bfloat16": 1, "float16": 0, "float32": 1, "bytes": 8 * 16 * 2}
    assert layers[0].packed is None and layers[0].weight.dtype == torch.float32
    assert layers[1].weight is None and stored_type(layers[1].packed) == torch.bfloat16


def _rounded_reference(path) -> torch.nn.Module:
    """transformers' float32 model of ``path`` with every projection and the output head
    holding the values their 16-bit storage keeps (the embedding stays float32)."""
    reference = type(reference_model(path)).from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        head = reference.get_output_embeddings().weight
        stored_head = head.to(storage_dtype(head)).float()
        for module in reference.model.layers.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(module.weight.to(storage_dtype(module.weight)).float())
        reference.lm_head.weight = torch.nn.Parameter(stored_head)  # untied from the lookup
    return reference


def test_loading_in_16_bit_storage_packs_the_projections_and_the_head(tiny_model_dir):
    path = tiny_model_dir("LlamaForCausalLM", "gqa", True)
    config = ModelConfig.from_path(str(path))
    model = load_model(config, torch.float32, torch.device("cpu"), 256, SINGLE,
                       SIXTEEN_BIT_STORAGE)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    for module in [*linears, model.embed_tokens]:  # (the head is tied to the lookup)
        layout = BlockedWeight if module.packed.dequantized().shape[0] % 16 == 0 else WidenedWeight
        assert isinstance(module.packed, layout)
    head = model.embed_tokens  # tied: the lookup keeps its float32 rows
    assert head.weight.dtype == torch.float32
    assert stored_type(head.packed) == torch.float16  # random float32 weights: rounded
    stored = store_in_16_bits(model)  # (nothing left to pack)
    assert stored["bytes"] == 0


def test_fp16wo_served_in_float32_is_the_16_bit_storage_all_in_float16(tiny_model_dir,
                                                                       cpu_kernels):
    """With the fused kernels on, the loader stores fp16wo's weights as dtype=auto stores
    them (column blocks where they fit), float16 even where bfloat16 would hold them
    exactly; with them off, in HalfWeight's rows (torch's half kernels for a few rows)."""
    path = tiny_model_dir("LlamaForCausalLM", "gqa", True)
    config = ModelConfig.from_path(str(path))
    model = load_model(config, torch.float32, torch.device("cpu"), 256, SINGLE, "fp16wo")
    packed = [m.packed for m in model.modules() if isinstance(m, Linear)]
    packed.append(model.embed_tokens.packed)
    if cpu_kernels == "torch":
        assert all(type(p) is HalfWeight for p in packed)
        return
    assert any(isinstance(p, BlockedWeight) for p in packed)
    assert all(isinstance(p, (BlockedWeight, WidenedWeight)) for p in packed)
    assert {stored_type(p) for p in packed} == {torch.float16}
    layer = torch.nn.Sequential(Linear(16, 32, bias=False))
    with torch.no_grad():
        layer[0].weight.copy_(torch.randn(32, 16).bfloat16().float())
    assert store_in_16_bits(layer, half_only=True)["float16"] == 1
    assert stored_type(layer[0].packed) == torch.float16


@pytest.mark.skipif(cpu_has_native_bf16(), reason="dtype=auto computes in bfloat16 here")
def test_auto_dtype_serves_what_transformers_computes_with_the_stored_weights(tiny_model_dir):
    """The engine with dtype=auto on a CPU without native bfloat16: float32 activations over
    16-bit weights, prompt and decode alike (the tiny model's weights with rows not a
    multiple of 16 in rows, widened for the prompt; the others in blocks)."""
    import radixlm

    path = tiny_model_dir("LlamaForCausalLM", "gqa", True)
    engine = radixlm.Engine(str(path), dtype="auto", max_total_tokens=4096)
    try:
        ids = engine.tokenizer.encode(PROMPT)
        assert len(ids) > HALF_FUSED_MAX_ROWS_FLOAT32  # rows: widened; blocks: the kernel
        out = engine.generate(input_ids=ids, return_logprob=True, logprob_start_len=0,
                              sampling_params={"max_new_tokens": 12, "temperature": 0.0,
                                               "ignore_eos": True})
    finally:
        engine.shutdown()
    reference = _rounded_reference(path)
    full = ids + out["output_ids"]
    with torch.inference_mode():
        logprobs = torch.log_softmax(reference(torch.tensor([full])).logits[0].float(), -1)
    expected = logprobs[:-1].gather(1, torch.tensor(full[1:])[:, None])[:, 0]
    prompt = torch.tensor([entry[0] for entry in out["meta_info"]["input_token_logprobs"][1:]])
    torch.testing.assert_close(prompt, expected[: len(ids) - 1], atol=1e-4, rtol=0)
    decoded = torch.tensor([entry[0] for entry in out["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(decoded, expected[len(ids) - 1:], atol=1e-4, rtol=0)
    best = logprobs[len(ids) - 1:].max(-1).values[: len(out["output_ids"])]
    torch.testing.assert_close(decoded, best, atol=1e-4, rtol=0)  # greedy: the top token
