"""RotaryEmbedding against transformers' RoPE initialisation, and scaled tiny Llamas end to end."""

from __future__ import annotations

import pytest
import torch
import transformers
from runtime_checks import assert_engine_idle
from tiny_models import reference_greedy, reference_prompt_logprobs, write_tiny_model
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import radixlm
from radixlm.models.layers.rope_scaling import yarn_inv_freq, yarn_softmax_scale
from radixlm.models.layers.rotary_embedding import RotaryEmbedding, apply_rotary
from radixlm.models.model_config import rope_parameters

HEAD_DIM = 16
TRAINED_CONTEXT = 512
POSITIONS = torch.tensor([0, 1, 2, 7, 31, 64, 100, 255, 300, 511])

# rope_parameters of the config, as transformers 5 spells them.
ROPE_SETTINGS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "default_theta_500k": {"rope_type": "default", "rope_theta": 500000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "llama3": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 10000.0,
    },
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "yarn": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
        "rope_theta": 10000.0,
    },
    "yarn_beta_untruncated": {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
        "beta_fast": 16, "beta_slow": 2, "truncate": False, "rope_theta": 50000.0,
    },
    # DeepSeek-V2's own settings (scaled down): cos/sin carry mscale / mscale_all_dim.
    "yarn_deepseek": {
        "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 128,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707,
        "rope_theta": 10000.0,
    },
    "yarn_explicit_attention_factor": {
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256,
        "attention_factor": 1.3, "rope_theta": 10000.0,
    },
}


def llama_config(rope: dict) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=HEAD_DIM * 4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=TRAINED_CONTEXT, rope_parameters=dict(rope),
    )


def transformers_rope(config: transformers.LlamaConfig, seq_len: int | None = None
                      ) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_factor) from transformers' own initialisation."""
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        init = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding
        return init.compute_default_rope_parameters(config)
    if seq_len is None:
        return ROPE_INIT_FUNCTIONS[rope_type](config, None)
    return ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len)


def transformers_angles(config: transformers.LlamaConfig, positions: torch.Tensor,
                        seq_len: int | None = None) -> torch.Tensor:
    """position * inv_freq from transformers' own initialisation: (P, HEAD_DIM / 2)."""
    inv_freq, _ = transformers_rope(config, seq_len)
    return torch.outer(positions.float(), inv_freq.float())


def ours(config: transformers.LlamaConfig, max_position: int = TRAINED_CONTEXT) -> RotaryEmbedding:
    return RotaryEmbedding(HEAD_DIM, max_position, rope_parameters(config), TRAINED_CONTEXT)


@pytest.mark.parametrize("setting", list(ROPE_SETTINGS))
def test_cos_sin_match_transformers_rope_init(setting):
    """Frequencies and the cos/sin factor (YaRN's attention_factor) as transformers has them."""
    config = llama_config(ROPE_SETTINGS[setting])
    rope = ours(config)
    _, attention_factor = transformers_rope(config)
    assert rope.attention_factor == pytest.approx(attention_factor, rel=1e-6)
    angles = transformers_angles(config, POSITIONS)
    expected_cos, expected_sin = angles.cos() * attention_factor, angles.sin() * attention_factor
    cos, sin = rope.cos_sin(POSITIONS)
    torch.testing.assert_close(cos, expected_cos, atol=2e-5, rtol=0)
    torch.testing.assert_close(sin, expected_sin, atol=2e-5, rtol=0)


@pytest.mark.parametrize("setting", [s for s in ROPE_SETTINGS if s.startswith("yarn")])
def test_yarn_inv_freq_matches_transformers(setting):
    config = llama_config(ROPE_SETTINGS[setting])
    inv_freq, attention_factor = yarn_inv_freq(
        HEAD_DIM, ROPE_SETTINGS[setting]["rope_theta"], rope_parameters(config), TRAINED_CONTEXT
    )
    expected_inv_freq, expected_factor = transformers_rope(config)
    torch.testing.assert_close(inv_freq, expected_inv_freq.float(), atol=0, rtol=1e-6)
    assert attention_factor == pytest.approx(expected_factor, rel=1e-9)


def test_deepseek_yarn_is_an_alias_of_yarn():
    params = dict(ROPE_SETTINGS["yarn_deepseek"])
    yarn = RotaryEmbedding(HEAD_DIM, TRAINED_CONTEXT, params, TRAINED_CONTEXT)
    alias = RotaryEmbedding(
        HEAD_DIM, TRAINED_CONTEXT, {**params, "rope_type": "deepseek_yarn"}, TRAINED_CONTEXT
    )
    positions = torch.arange(TRAINED_CONTEXT)
    assert all(torch.equal(a, b) for a, b in zip(yarn.cos_sin(positions), alias.cos_sin(positions),
                                                  strict=True))


@pytest.mark.parametrize("setting", ["default", "yarn", "yarn_deepseek", "linear"])
def test_deepseek_softmax_scale_correction_matches_transformers(setting):
    """DeepSeek multiplies its softmax scale by mscale(factor, mscale_all_dim)^2."""
    rope = ROPE_SETTINGS[setting]
    expected = transformers.models.deepseek_v3.modeling_deepseek_v3.yarn_apply_mscale(rope, 1.0)
    assert yarn_softmax_scale(rope, TRAINED_CONTEXT) == pytest.approx(expected, rel=1e-12)
    if setting == "yarn_deepseek":
        assert expected > 1.5  # the correction is really exercised


@pytest.mark.parametrize("setting", ["linear", "llama3", "yarn", "yarn_deepseek"])
def test_scaled_rope_really_differs_from_default(setting):
    """Guards the comparison above against a scaling that is silently ignored."""
    scaled = ours(llama_config(ROPE_SETTINGS[setting]))
    default = ours(llama_config(ROPE_SETTINGS["default"]))
    difference = scaled.cos_sin(POSITIONS[1:])[0] - default.cos_sin(POSITIONS[1:])[0]
    assert difference.abs().max() > 0.1


def test_dynamic_below_trained_context_equals_default():
    dynamic = ours(llama_config(ROPE_SETTINGS["dynamic"]), max_position=2 * TRAINED_CONTEXT)
    default = ours(llama_config(ROPE_SETTINGS["default"]), max_position=2 * TRAINED_CONTEXT)
    positions = torch.arange(TRAINED_CONTEXT)
    torch.testing.assert_close(dynamic.cos_sin(positions), default.cos_sin(positions))


def test_dynamic_beyond_trained_context_uses_ntk_base_for_the_serving_context():
    config = llama_config(ROPE_SETTINGS["dynamic"])
    serving = 2 * TRAINED_CONTEXT
    rope = ours(config, max_position=serving)
    positions = torch.tensor([TRAINED_CONTEXT, TRAINED_CONTEXT + 100, serving - 1])
    angles = transformers_angles(config, positions, seq_len=serving)
    cos, sin = rope.cos_sin(positions)
    torch.testing.assert_close(cos, angles.cos(), atol=2e-5, rtol=0)
    torch.testing.assert_close(sin, angles.sin(), atol=2e-5, rtol=0)


@pytest.mark.parametrize("setting", ["default", "dynamic", "longrope", "yarn"])
@pytest.mark.parametrize("head_dim", [12, 64])
def test_a_position_s_rotation_does_not_depend_on_its_batch(setting, head_dim):
    """The angles are computed per batch, not read from a table: a position's cos and sin
    must be bitwise the same in any batch (a key cached by one prefill is reused beside keys
    of later batches), and equal the table of every position the module once kept."""
    params = (dict(ROPE_SETTINGS[setting]) if setting != "longrope" else  # Phi-3's kind
              {"rope_type": "longrope", "rope_theta": 10000.0,
               "original_max_position_embeddings": TRAINED_CONTEXT // 2,
               "short_factor": [1.0 + i / 10 for i in range(head_dim // 2)],
               "long_factor": [2.0 + i for i in range(head_dim // 2)]})
    rope = RotaryEmbedding(head_dim, 2 * TRAINED_CONTEXT, params, TRAINED_CONTEXT)
    every = torch.arange(2 * TRAINED_CONTEXT)
    table_cos, table_sin = rope.cos_sin(every)
    generator = torch.Generator().manual_seed(3)
    for size in (1, 3, 17, 40):
        positions = torch.randint(0, 2 * TRAINED_CONTEXT, (size,), generator=generator)
        cos, sin = rope.cos_sin(positions)
        assert torch.equal(cos, table_cos[positions]) and torch.equal(sin, table_sin[positions])
    if rope.long_inv_freq is None:  # one frequency set: the table the module used to keep
        angles = torch.outer(every.float() / (rope.position_divisor or 1.0), rope.inv_freq)
        assert torch.equal(table_cos, angles.cos() * rope.attention_factor)


def test_rotation_uses_the_rotate_half_layout_of_transformers():
    config = llama_config(ROPE_SETTINGS["llama3"])
    rope = ours(config)
    torch.manual_seed(0)
    q, k = torch.randn(len(POSITIONS), 4, HEAD_DIM), torch.randn(len(POSITIONS), 2, HEAD_DIM)
    cos, sin = rope.lookup(POSITIONS, torch.float32)
    got_q, got_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    angles = transformers_angles(config, POSITIONS)
    # transformers' layout: q (1, H, P, D), cos/sin (1, P, D) duplicated over both halves.
    cos_hf = torch.cat([angles.cos()] * 2, dim=-1)[None]
    sin_hf = torch.cat([angles.sin()] * 2, dim=-1)[None]
    expected_q, expected_k = transformers.models.llama.modeling_llama.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_hf, sin_hf
    )
    torch.testing.assert_close(got_q, expected_q[0].transpose(0, 1), atol=1e-5, rtol=0)
    torch.testing.assert_close(got_k, expected_k[0].transpose(0, 1), atol=1e-5, rtol=0)


def test_unknown_rope_type_is_refused_by_name():
    with pytest.raises(ValueError, match="made_up"):
        RotaryEmbedding(HEAD_DIM, 64, {"rope_type": "made_up", "factor": 2.0}, 64)


def test_longrope_without_its_factors_is_refused_naming_them():
    with pytest.raises(ValueError, match="short_factor"):
        RotaryEmbedding(HEAD_DIM, 64, {"rope_type": "longrope", "factor": 2.0}, 64)


@pytest.mark.parametrize(
    ("legacy", "expected"),
    [
        ({"type": "linear", "factor": 2.0}, "linear"),
        ({k: v for k, v in ROPE_SETTINGS["llama3"].items() if k != "rope_theta"}, "llama3"),
        (None, "default"),
    ],
)
def test_rope_parameters_reads_legacy_and_current_config_fields(legacy, expected):
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, rope_scaling=legacy)
    params = rope_parameters(config)
    assert params["rope_type"] == expected
    assert params["rope_theta"] == 10000.0


END_TO_END_ROPE = {
    "linear_factor_2": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "llama3_factor_8": ROPE_SETTINGS["llama3"],
    "yarn_factor_4": ROPE_SETTINGS["yarn"],
}
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France; Berlin is",
    "def add(a, b):\n    return a + b\n",
    "Héllo",
]
GREEDY = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def scaled_model_dirs(tmp_path_factory):
    """Tiny Llamas with RoPE scaling (tiny_model_dir cannot take dict-valued overrides)."""
    return {
        name: write_tiny_model(
            tmp_path_factory.mktemp(f"llama-rope-{name}"), "LlamaForCausalLM", "gqa",
            rope_parameters=dict(rope),
        )
        for name, rope in END_TO_END_ROPE.items()
    }


# The end-to-end run is the same code for every scaling (cos/sin against transformers' for
# each: test_cos_sin_match_transformers_rope_init); two of the three run in the slow stage.
@pytest.mark.parametrize("name", [pytest.param(name, marks=[] if name == "llama3_factor_8"
                                               else [pytest.mark.slow])
                                  for name in END_TO_END_ROPE])
def test_scaled_rope_llama_matches_transformers_tokens_and_prompt_logprobs(
    scaled_model_dirs, name
):
    path = scaled_model_dirs[name]
    assert transformers.AutoConfig.from_pretrained(path).rope_parameters["rope_type"] == (
        END_TO_END_ROPE[name]["rope_type"]
    )
    engine = radixlm.Engine(str(path), dtype="float32", max_total_tokens=2048)
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    outs = engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True,
                           logprob_start_len=0)
    for prompt_ids, out in zip(ids, outs, strict=True):
        assert out["output_ids"] == reference_greedy(path, prompt_ids, 24)
        got = torch.tensor([entry[0] for entry in out["meta_info"]["input_token_logprobs"][1:]])
        torch.testing.assert_close(
            got, reference_prompt_logprobs(path, prompt_ids), atol=1e-4, rtol=0
        )
    assert_engine_idle(engine)
