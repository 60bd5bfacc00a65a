"""Each family's own settings are typed fields of its config class (the ModelConfig subclass beside its model): their
defaults are transformers' for that model type, AutoConfig.for_model takes them as keywords, and they go through
to_dict / from_dict, and through save_pretrained into transformers, unchanged; `extra` keeps only unknown keys."""

from __future__ import annotations

import dataclasses
import json

import pytest
import transformers

from gpuformers.models.auto import AutoConfig
from gpuformers.models.config import ModelConfig
from gpuformers.models.registry import MODEL_TYPES, config_class_for

SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2)
_SIZES = {"gpt2": dict(vocab_size=128, n_embd=64, n_layer=4, n_head=4),  # GPT-2's spelling
          "gpt_neox": {k: v for k, v in SIZES.items() if k != "num_key_value_heads"},
          "olmoe": {k: v for k, v in SIZES.items() if k != "num_key_value_heads"},
          # Mamba2: num_heads * head_dim = expand * hidden_size, for the defaults (128 heads, expand 2) and NON_DEFAULT's
          "mamba2": dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, head_dim=1),
          # Nemotron-H: transformers' default blocks include "moe", which gpuformers refuses: a pattern without
          "nemotron_h": dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                             num_key_value_heads=2, hybrid_override_pattern="M*-M")}

# A value other than the default for every own field, that both libraries accept
NON_DEFAULT = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      decoder_sparse_step=2, mlp_only_layers=[0], output_router_logits=True,
                      router_aux_loss_coef=0.02),
    "qwen2_moe": dict(qkv_bias=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=True, decoder_sparse_step=2,
                      mlp_only_layers=[1], output_router_logits=True, router_aux_loss_coef=0.02),
    "smollm3": dict(no_rope_layers=[1, 0, 1, 1], no_rope_layer_interval=2),
    "granite": dict(embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22,
                    attention_multiplier=0.0078125),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=1, output_router_logits=True, router_aux_loss_coef=0.02,
                    router_jitter_noise=0.01),
    "phi3": dict(original_max_position_embeddings=2048, resid_pdrop=0.1, embd_pdrop=0.1),
    "gemma": dict(use_bidirectional_attention=False),
    "gemma2": dict(use_bidirectional_attention=False, hidden_activation="gelu", query_pre_attn_scalar=128,
                   final_logit_softcapping=None, attn_logit_softcapping=20.0),
    "gemma3_text": dict(use_bidirectional_attention=None, hidden_activation="gelu", query_pre_attn_scalar=128,
                        final_logit_softcapping=30.0, attn_logit_softcapping=50.0, rope_local_base_freq=20000.0,
                        sliding_window_pattern=2),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, swiglu_alpha=1.5, swiglu_limit=5.0,
                    router_aux_loss_coef=0.02, output_router_logits=True),
    "olmoe": dict(clip_qkv=8.0, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, output_router_logits=True,
                  router_aux_loss_coef=0.02),
    "exaone4": dict(sliding_window_pattern=2),
    "seed_oss": dict(attention_out_bias=True, residual_dropout=0.0),
    "gpt_neox": dict(layer_norm_eps=1e-6, use_parallel_residual=False, hidden_dropout=0.1, classifier_dropout=0.2),
    "starcoder2": dict(residual_dropout=0.1, embedding_dropout=0.1),
    "mamba2": dict(num_heads=64, state_size=32, expand=1, conv_kernel=3, n_groups=4, chunk_size=64,
                   layer_norm_epsilon=1e-6, use_bias=True, use_conv_bias=False, residual_in_fp32=False,
                   time_step_limit=[0.001, 0.5], time_step_rank=8, time_step_min=0.002, time_step_max=0.2,
                   time_step_floor=1e-3, rescale_prenorm_residual=True),
    "nemotron_h": dict(layers_block_type=["linear_attention", "full_attention", "mlp", "mlp"], mamba_num_heads=16,
                       mamba_head_dim=32, ssm_state_size=64, n_groups=4, conv_kernel=3, expand=1, chunk_size=64,
                       time_step_min=0.002, time_step_max=0.2, time_step_limit=[0.001, 0.5], time_step_floor=1e-3,
                       use_conv_bias=False, mamba_proj_bias=True, mamba_hidden_act="silu",
                       mamba_ssm_cache_dtype="bfloat16", use_mamba_kernels=False, mlp_hidden_act="relu",
                       use_bias=True, layer_norm_epsilon=1e-6, residual_in_fp32=True, hidden_dropout=0.1,
                       rescale_prenorm_residual=False, num_logits_to_keep=2, n_routed_experts=4,
                       output_router_logits=True, n_shared_experts=2, moe_intermediate_size=32,
                       moe_shared_expert_intermediate_size=48, moe_latent_size=16, moe_shared_expert_overlap=False,
                       num_experts_per_tok=1, routed_scaling_factor=2.5, n_group=2, topk_group=2,
                       norm_topk_prob=False, num_nextn_predict_layers=1,
                       mtp_layers_block_type=["full_attention", "mlp"]),
    "gpt2": dict(n_inner=96, layer_norm_epsilon=1e-6, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                 scale_attn_weights=False),
    "granitemoehybrid": dict(embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22,
                             attention_multiplier=0.0078125, num_local_experts=4, num_experts_per_tok=1,
                             router_aux_loss_coef=0.01, shared_intermediate_size=48, position_embedding_type="rope",
                             mamba_n_heads=16, mamba_n_groups=4, mamba_d_state=32, mamba_d_head=4, mamba_d_conv=3,
                             mamba_expand=1, mamba_chunk_size=64, mamba_conv_bias=False, mamba_proj_bias=True,
                             time_step_limit=[0.001, 0.5]),
    "falcon_h1": dict(num_logits_to_keep=2, mamba_d_ssm=64, mamba_n_heads=16, mamba_d_head=4, mamba_n_groups=4,
                      mamba_d_state=32, mamba_d_conv=3, mamba_expand=1, mamba_chunk_size=64, mamba_conv_bias=False,
                      mamba_proj_bias=True, mamba_norm_before_gate=False, mamba_rms_norm=True,
                      time_step_limit=[0.001, 0.5], projectors_bias=True, lm_head_multiplier=0.5,
                      embedding_multiplier=3.0, mlp_multipliers=[0.7, 1.3], key_multiplier=0.6,
                      attention_out_multiplier=0.8, attention_in_multiplier=1.2,
                      ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.9], ssm_in_multiplier=0.3, ssm_out_multiplier=4.0),
}
# Fields whose only value we accept is the default (gpuformers refuses the option)
REFUSED = {"gpt2": {"scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"},
           "granitemoehybrid": {"output_router_logits"}}


def _own_fields(model_type: str) -> list[str]:
    common = {f.name for f in dataclasses.fields(ModelConfig)}
    return [f.name for f in dataclasses.fields(config_class_for(model_type)) if f.name not in common]


FAMILIES = sorted(model_type for model_type in MODEL_TYPES if _own_fields(model_type))


def _theirs(config, model_type: str, name: str):
    """transformers' value of one of our fields: Gemma 3 keeps two of them under other names in transformers 5."""
    if model_type == "gemma3_text" and name == "rope_local_base_freq":
        return config.rope_parameters["sliding_attention"]["rope_theta"]
    if model_type == "gemma3_text" and name == "sliding_window_pattern":
        return config._sliding_window_pattern
    if model_type in ("granitemoehybrid", "falcon_h1") and name == "time_step_limit":
        return list(config.time_step_limit)  # transformers' Granite 4 and Falcon-H1 configs make the list a tuple
    return getattr(config, name)


def test_every_family_with_own_fields_has_test_values():
    assert "qwen3_moe" in FAMILIES and "gemma2" in FAMILIES and "llama" not in FAMILIES
    for model_type in FAMILIES:
        assert set(NON_DEFAULT[model_type]) | REFUSED.get(model_type, set()) == set(_own_fields(model_type))


@pytest.mark.parametrize("model_type", FAMILIES)
def test_defaults_are_transformers(model_type):
    sizes = _SIZES.get(model_type, SIZES)
    ours = AutoConfig.for_model(model_type, **sizes)
    theirs = transformers.AutoConfig.for_model(model_type, **sizes)
    for name in _own_fields(model_type):
        assert getattr(ours, name) == _theirs(theirs, model_type, name), name
    assert ours.extra == {}  # no family setting is left untyped
    written = ours.to_dict()
    assert {name: written[name] for name in _own_fields(model_type)} == {
        name: getattr(ours, name) for name in _own_fields(model_type)}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_fields_round_trip_and_transformers_reads_what_we_write(model_type, tmp_path):
    values = NON_DEFAULT[model_type]
    unknown = {"my_library_setting": {"keep": [1, 2]}}  # another library's key: kept in extra, written back
    ours = AutoConfig.for_model(model_type, **_SIZES.get(model_type, SIZES), **values, **unknown)
    assert {name: getattr(ours, name) for name in values} == values
    assert ours.extra == unknown
    written = json.loads(json.dumps(ours.to_dict()))  # as config.json holds it
    assert {name: written[name] for name in values} == values and written["my_library_setting"] == {"keep": [1, 2]}
    again = ModelConfig.from_dict(written)
    assert type(again) is type(ours) and again.extra == unknown
    assert {name: getattr(again, name) for name in _own_fields(model_type)} == {
        name: getattr(ours, name) for name in _own_fields(model_type)}
    # the whole file after one round, as test_config_dispatch compares it (Phi-3 writes partial_rotary_factor 1.0,
    # which then sits in rope_parameters)
    assert type(again).from_dict(again.to_dict()).to_dict() == again.to_dict()

    ours.save_pretrained(tmp_path)
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    assert theirs.model_type == model_type
    for name, value in values.items():
        assert _theirs(theirs, model_type, name) == value, name
