"""Weight-only formats: every path of each format multiplies by the weight it stands for;
packing a model packs its projections and output head; a packed model serves what
transformers computes with the same (dequantized) weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fused_kernels import enable_or_skip
from tiny_models import reference_model

from radixlm.kernels.cpu_ops import fused_ops
from radixlm.kernels.cpu_ops.execution_plan import (
    FLOAT32_FUSED_ROWS,
    FLOAT32_FUSED_ROWS_FROM_ONE,
)
from radixlm.kernels.cpu_ops.fused_ops import ProjectionKernel
from radixlm.models.layers.linear import Linear
from radixlm.models.layers.tensor_parallel import SINGLE
from radixlm.models.layers.weight_formats import (
    HALF_FUSED_MAX_ROWS,
    HALF_FUSED_MAX_ROWS_FLOAT32,
    HALF_GEMV_MAX_ROWS,
    INT8_FUSED_MAX_ROWS_FLOAT32,
    INT8_KERNEL_MAX_ROWS,
    INT8_KERNEL_MAX_ROWS_BF16,
    ConversionBuffer,
    HalfWeight,
    Int8Weight,
    pack_weights,
    plain_matmul,
)
from radixlm.models.loader import load_model
from radixlm.models.model_config import ModelConfig

FORMATS = {"fp16wo": HalfWeight, "int8wo": Int8Weight}


# Rows each format runs on torch's low-precision kernel where the fused kernels are off
# (activations rounded to half / bfloat16 inside it); larger passes, and the fused kernels,
# multiply in float32, exactly.
KERNEL_ROWS = {"fp16wo": HALF_GEMV_MAX_ROWS, "int8wo": INT8_KERNEL_MAX_ROWS}
KERNEL_ATOL = {"fp16wo": 2e-3, "int8wo": 2e-2}
# On logprobs: the engine's decode runs on the fused kernels, which take float32 activations
# as they are: exact for the weights the format stands for.
DECODE_ATOL = 1e-4
LONG_PROMPT = ("The quick brown fox jumps over the lazy dog; Paris is the capital of France, "
               "Berlin the capital of Germany, and Rome the capital of Italy. Numbers: 1 2 3 4")


@pytest.mark.parametrize("weight_format", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 5, 32, 33, 80, INT8_FUSED_MAX_ROWS_FLOAT32,
                                  INT8_FUSED_MAX_ROWS_FLOAT32 + 1])  # each side of each limit
def test_each_path_multiplies_by_the_weight_it_stands_for(weight_format, rows, cpu_kernels):
    torch.manual_seed(rows)
    weight = torch.randn(96, 64) * 0.05
    packed = FORMATS[weight_format].pack(weight, ConversionBuffer())
    x = torch.randn(rows, 64)
    got = packed.matmul(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    expected = x @ packed.dequantized().T
    # The fused kernels take float32 activations as they are: exact like the widened path.
    on_kernel = rows <= KERNEL_ROWS[weight_format] and cpu_kernels == "torch"
    atol = KERNEL_ATOL[weight_format] if on_kernel else 1e-5
    torch.testing.assert_close(got, expected, atol=atol, rtol=0)


@pytest.mark.parametrize("weight_format", FORMATS)
@pytest.mark.parametrize("rows", [1, INT8_KERNEL_MAX_ROWS_BF16, INT8_KERNEL_MAX_ROWS_BF16 + 1,
                                  HALF_FUSED_MAX_ROWS + 1, 80])
def test_passes_in_bfloat16_multiply_by_the_weight_they_stand_for(weight_format, rows,
                                                                  cpu_kernels):
    """Every path in bfloat16 (a kernel for a few rows, the widened product beyond, an int8
    product's columns scaled) agrees with the float32 product to bfloat16's precision."""
    torch.manual_seed(rows)
    packed = FORMATS[weight_format].pack(torch.randn(96, 64) * 0.05, ConversionBuffer())
    x = torch.randn(rows, 64)
    got = packed.matmul(x.bfloat16())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    expected = x @ packed.dequantized().T  # magnitudes about 0.1-1
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.fixture(params=[FLOAT32_FUSED_ROWS, FLOAT32_FUSED_ROWS_FROM_ONE],
                ids=["torch-matrix-vector", "kernel-matrix-vector"])
def fused_rows(request):
    """The float32 rows a plan runs on the kernels (one and two rows or not, as the runner's
    measurement would choose)."""
    return request.param


@pytest.mark.parametrize("rows", [1, 2, 3, 16, 17])
@pytest.mark.parametrize("biased", [False, True])
def test_plain_float32_passes_compute_what_f_linear_computes(rows, biased, cpu_kernels,
                                                             fused_rows):
    """Unpacked float32 weights: 3-16 rows (1-16 where the kernel is set to serve one row) on
    the fused kernels where they are on, others (and a weight that is not contiguous) on
    F.linear; the same to float32 rounding."""
    assert 3 in fused_rows and 17 not in fused_rows
    torch.manual_seed(rows)
    weight, x = torch.randn(96, 64) * 0.05, torch.randn(rows, 64)
    bias = torch.randn(96) if biased else None
    expected = F.linear(x, weight, bias)
    got = plain_matmul(x, weight, bias, fused_rows)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    kernels = fused_ops.active()
    taken = (kernels.dense_matmul(x, weight) + (0 if bias is None else bias)
             if kernels is not None and rows in fused_rows else expected)
    assert torch.equal(got, taken)  # the path the rows call for, bit for bit
    strided = torch.randn(64, 96).T * 0.05  # (96, 64), not contiguous
    torch.testing.assert_close(plain_matmul(x, strided, bias, fused_rows),
                               F.linear(x, strided, bias),
                               atol=1e-5, rtol=1e-5)


def test_the_packed_weights_are_within_half_a_step_of_the_original():
    torch.manual_seed(0)
    weight = torch.randn(48, 40)
    int8 = Int8Weight.pack(weight, ConversionBuffer())
    assert int8.weight.dtype == torch.int8 and int8.nbytes() == 48 * 40 + 48 * 4
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((int8.dequantized() - weight).abs() <= step / 2 + 1e-7).all()
    half = HalfWeight.pack(weight, ConversionBuffer())
    assert half.weight.dtype == torch.float16 and half.nbytes() == 48 * 40 * 2
    torch.testing.assert_close(half.dequantized(), weight, atol=0, rtol=2**-11)
    paired = Int8Weight.pack(weight, ConversionBuffer(), by_pairs=True)
    assert paired.weight is None and paired.pairs.shape == (3, 20, 16, 2)
    assert torch.equal(paired.dequantized(), int8.dequantized())
    assert paired.nbytes() == int8.nbytes()
    unfit = Int8Weight.pack(weight[:40], ConversionBuffer(), by_pairs=True)  # 40 rows
    assert unfit.pairs is None and unfit.weight.shape == (40, 40)
    blocked = Int8Weight.pack(weight, ConversionBuffer(), by_blocks=True)
    assert blocked.weight is None and blocked.blocks.shape == (3, 40, 16)
    assert torch.equal(blocked.dequantized(), int8.dequantized())
    assert blocked.nbytes() == int8.nbytes()
    unfit = Int8Weight.pack(weight[:40], ConversionBuffer(), by_blocks=True)
    assert unfit.blocks is None and unfit.weight.shape == (40, 40)


@pytest.mark.parametrize("rows", [1, 16, INT8_FUSED_MAX_ROWS_FLOAT32 + 1])
def test_int8_blocks_multiply_as_the_rows_do_with_the_kernels_on_or_off(rows):
    """In column blocks, float32 rows of any count run the kernels' blocked_int8_matmul:
    float64's product to one float32 step. With the kernels off (or bfloat16 rows) the
    integers are taken back to rows and multiplied as rows are, to the bit."""
    enable_or_skip()
    torch.manual_seed(rows)
    weight = torch.randn(64, 96) * 0.05
    by_rows, blocked = (Int8Weight.pack(weight, ConversionBuffer(), by_blocks=by_blocks)
                        for by_blocks in (False, True))
    assert blocked.fused_projection(rows, torch.float32).kernel == ProjectionKernel.INT8_BLOCKED
    assert blocked.fused_projection(rows, torch.bfloat16) is None
    x = torch.randn(rows, 96)
    expected = x.double() @ by_rows.dequantized().double().T
    magnitude = x.double().abs() @ by_rows.dequantized().double().abs().T
    got = blocked.matmul(x)
    assert got.dtype == torch.float32
    assert ((got.double() - expected).abs() <= 1e-6 * magnitude + 1e-30).all()
    assert torch.equal(blocked.matmul(x.bfloat16()), by_rows.matmul(x.bfloat16()))
    fused_ops.disable()
    try:
        assert torch.equal(blocked.matmul(x), by_rows.matmul(x))
    finally:
        fused_ops.enable()


def test_int8_pairs_multiply_as_the_rows_do_with_the_kernels_on_or_off():
    """By pairs, bfloat16 rows run the kernels' int8_pair_matmul; with the kernels off, or
    float32 rows, the integers are unpaired and multiplied as rows are."""
    if not enable_or_skip().pair_matmul_available():
        pytest.skip("no AVX-512 BF16 pair kernels here")
    torch.manual_seed(1)
    weight = torch.randn(64, 96) * 0.05
    rows, paired = (Int8Weight.pack(weight, ConversionBuffer(), by_pairs=by_pairs)
                    for by_pairs in (False, True))
    for x in (torch.randn(3, 96).bfloat16(), torch.randn(40, 96).bfloat16(), torch.randn(3, 96)):
        expected = x.double() @ rows.dequantized().double().T
        magnitude = x.double().abs() @ rows.dequantized().double().abs().T
        got = [paired.matmul(x)]
        fused_ops.disable()
        try:
            got.append(paired.matmul(x))
            assert torch.equal(got[-1], rows.matmul(x))
        finally:
            fused_ops.enable()
        for product in got:
            assert product.dtype == x.dtype
            assert ((product.double() - expected).abs() <= 2**-7 * magnitude + 1e-30).all()


def test_large_passes_reuse_one_buffer():
    buffer = ConversionBuffer()
    big = buffer.take(torch.Size([64, 64]), torch.float32, torch.device("cpu"))
    small = buffer.take(torch.Size([8, 16]), torch.float32, torch.device("cpu"))
    assert small.data_ptr() == big.data_ptr() and small.shape == (8, 16)
    wider = buffer.take(torch.Size([128, 64]), torch.float32, torch.device("cpu"))
    assert wider.shape == (128, 64)  # grown when a weight needs more


@pytest.mark.parametrize("weight_format", FORMATS)
def test_packing_a_model_packs_its_projections_and_its_head(tiny_model_dir, weight_format):
    config = ModelConfig.from_path(str(tiny_model_dir("LlamaForCausalLM", "gqa", True)))
    model = load_model(config, torch.float32, torch.device("cpu"), 256, SINGLE, weight_format)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight is None and m.packed is not None for m in linears)
    head = model.embed_tokens  # tied: the lookup keeps its float rows
    assert head.packed is not None and head.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="int4"):
        pack_weights(model, "int4")


def _dequantized_reference(path, weight_format: str) -> torch.nn.Module:
    """transformers' model of ``path`` with every projection and the output head replaced
    by the weights their packed form stands for (the embedding stays float). Rows are
    packed one by one, so packing q, k and v apart equals packing them stacked."""
    reference = type(reference_model(path)).from_pretrained(path, dtype=torch.float32).eval()
    buffer, pack = ConversionBuffer(), FORMATS[weight_format].pack
    with torch.no_grad():
        head = pack(reference.get_output_embeddings().weight, buffer).dequantized()
        for module in reference.model.layers.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(pack(module.weight, buffer).dequantized())
        reference.lm_head.weight = torch.nn.Parameter(head)  # untied from the embedding
    return reference


@torch.inference_mode()
def _logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1: (len - 1,)."""
    logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.mark.parametrize("weight_format", FORMATS)
def test_a_packed_model_serves_what_transformers_computes_with_its_weights(
        engine_for, tiny_model_dir, weight_format):
    path = tiny_model_dir("LlamaForCausalLM", "gqa", True)
    engine = engine_for("LlamaForCausalLM", "gqa", True, quantization=weight_format)
    assert engine.get_server_info()["quantization"] == weight_format
    ids = engine.tokenizer.encode(" ".join([LONG_PROMPT] * 6))
    assert len(ids) > max(INT8_FUSED_MAX_ROWS_FLOAT32, HALF_FUSED_MAX_ROWS_FLOAT32)  # widened
    out = engine.generate(input_ids=ids, return_logprob=True, logprob_start_len=0,
                          sampling_params={"max_new_tokens": 12, "temperature": 0.0,
                                           "ignore_eos": True})
    reference = _dequantized_reference(path, weight_format)
    expected = _logprobs(reference, ids + out["output_ids"])
    prompt = torch.tensor([entry[0] for entry in out["meta_info"]["input_token_logprobs"][1:]])
    torch.testing.assert_close(prompt, expected[: len(ids) - 1], atol=1e-4, rtol=0)
    # Decode steps run on the format's few-row kernel.
    decoded = torch.tensor([entry[0] for entry in out["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(decoded, expected[len(ids) - 1:],
                               atol=DECODE_ATOL, rtol=0)
