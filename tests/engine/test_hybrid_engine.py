"""The engine on models with mamba layers (Mamba2, Nemotron-H, Granite 4, Falcon-H1): greedy tokens identical to
single-prompt generate() for 32 requests of mixed lengths arriving at different times, with preemption forced, chunked
prefill forced small, and prefix caching on (prefix hits asserted, state snapshots taken and restored) and off; the
state slots given back; a shared-prefix workload whose later requests skip the prefix's prefill with identical
outputs; sampling per request; and what the engine refuses for these models."""

from __future__ import annotations

import pytest
import torch

from gpuformers.engine.config import ContinuousBatchingConfig
from gpuformers.engine.sequence import RequestStatus
from gpuformers.models.config import ModelConfig
from gpuformers.models.registry import model_class_for
from tests.engine.test_engine import NEW_TOKENS, make_prompts, run_staggered

MAMBA = dict(n_groups=2, chunk_size=5)
FAMILIES = {
    "mamba2": dict(num_hidden_layers=2, num_heads=8, head_dim=16, state_size=16, expand=2, **MAMBA),
    "nemotron_h": dict(layers_block_type=["mamba", "attention", "mlp", "mamba", "moe"], num_hidden_layers=5,
                       mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, head_dim=16, n_routed_experts=4,
                       num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32,
                       moe_shared_expert_intermediate_size=48, **MAMBA),
    "granitemoehybrid": dict(layer_types=["mamba", "attention", "mamba"], num_hidden_layers=3, mamba_n_heads=8,
                             mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=5,
                             position_embedding_type="rope", num_local_experts=4, num_experts_per_tok=2,
                             shared_intermediate_size=48, embedding_multiplier=4.0, residual_multiplier=0.5,
                             attention_multiplier=0.1, logits_scaling=2.0),
    "falcon_h1": dict(num_hidden_layers=2, head_dim=16, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
                      mamba_d_ssm=128, mamba_n_groups=2, mamba_chunk_size=5, ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.9],
                      ssm_in_multiplier=0.3, ssm_out_multiplier=4.0, key_multiplier=0.6),
}


def tiny_hybrid(model_type: str):
    values = dict(model_type=model_type, vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    values.update(FAMILIES[model_type])
    config = ModelConfig.from_dict(values)
    torch.manual_seed(0)
    return model_class_for(config)(config).eval()


def greedy_alone(model, prompts, new_tokens=NEW_TOKENS):
    """One prompt at a time through generate() (RecurrentCache). The mask is explicit: a prompt may hold the pad
    id, which generate() would otherwise read as padding, as transformers does."""
    return [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)[0, len(p):].tolist()
            for p in prompts]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    model = tiny_hybrid(request.param)
    prompts = make_prompts(32, seed=1)
    return model, prompts, greedy_alone(model, prompts)


@pytest.mark.parametrize("sharing", [True, False], ids=["prefix_cache", "no_prefix_cache"])
def test_greedy_matches_generate_under_preemption_and_small_chunks(family, sharing):
    model, prompts, reference = family
    # 12 blocks of 8 = 96 slots for 32 requests of up to 77 tokens: preemption is certain; chunks of at most 24
    config = ContinuousBatchingConfig(block_size=8, num_blocks=12, max_batch_tokens=24, max_requests_per_batch=16,
                                      allow_block_sharing=sharing)
    manager = model.init_continuous_batching(continuous_batching_config=config, eos_token_id=None)
    outputs = run_staggered(manager, prompts)
    for i, (output, expected) in enumerate(zip(outputs, reference)):
        assert output.status is RequestStatus.FINISHED, output.error
        assert output.generated_tokens == expected, f"request {i} (prompt length {len(prompts[i])})"
    assert manager.num_preemptions > 0
    states = manager.states
    if sharing:  # blocks matched, state snapshots taken at shared prefixes and restored by later requests
        assert manager.prefix_hits > 0 and states.snapshots_taken > 0 and states.snapshot_hits > 0
    else:
        assert manager.prefix_hits == 0 and states.snapshots_taken == 0
    assert manager.block_manager.num_free_blocks == config.num_blocks
    assert sorted(states.free_live) == list(range(config.max_requests_per_batch))  # every state slot given back


def test_shared_prefix_skips_its_prefill_with_identical_outputs():
    """Requests sharing a 48-token prefix, one after another: the second computes the prefix and leaves a snapshot at
    its last full block, every later one restores it and prefills only its own tail; the tokens equal a run with
    the prefix cache off."""
    model = tiny_hybrid("nemotron_h")
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(1, 128, (48,), generator=g).tolist()
    prompts = [prefix + torch.randint(1, 128, (int(n),), generator=g).tolist() for n in torch.randint(3, 12, (6,))]
    outputs = {}
    for sharing in (True, False):
        config = ContinuousBatchingConfig(block_size=16, num_blocks=64, max_batch_tokens=256,
                                          max_requests_per_batch=4, allow_block_sharing=sharing)
        manager = model.init_continuous_batching(continuous_batching_config=config, eos_token_id=None)
        for prompt in prompts:  # one at a time: each finds the cache as the ones before left it
            request = manager.add_request(prompt, max_new_tokens=6)
            while manager.step():
                pass
            output = manager.get_result(request, timeout=0)
            outputs.setdefault(sharing, []).append(output.generated_tokens)
        if sharing:
            assert manager.states.snapshots_taken == 1  # at the end of the 3 shared blocks, by the second request
            assert manager.states.snapshot_hits == len(prompts) - 2
            assert manager.prefix_hits == 3 * (len(prompts) - 2)
    assert outputs[True] == outputs[False] == greedy_alone(model, prompts, 6)


def test_sampling_is_per_request_and_seeded():
    """A seeded sampled request gives the same tokens alone and in a crowd (its rows' states are its own)."""
    model = tiny_hybrid("granitemoehybrid")
    prompts = make_prompts(8, seed=2)
    manager = model.init_continuous_batching(eos_token_id=None, block_size=8, num_blocks=64)
    settings = dict(max_new_tokens=8, do_sample=True, temperature=0.8, top_k=20)
    alone = manager.add_request(prompts[5], seed=7, **settings)
    manager.run_until_done()
    crowd = [manager.add_request(p, seed=7 if i == 5 else i, **settings) for i, p in enumerate(prompts)]
    manager.run_until_done()
    others = [manager.get_result(r, timeout=0).generated_tokens for r in crowd]
    assert others[5] == manager.get_result(alone, timeout=0).generated_tokens
    assert len({tuple(t) for t in others}) > 1


def test_a_model_without_attention_layers_keeps_no_kv_cache():
    model = tiny_hybrid("mamba2")
    manager = model.init_continuous_batching(continuous_batching_config=ContinuousBatchingConfig(max_requests_per_batch=4))
    assert manager.runner.kv_tensors() == []
    summary = manager.memory_summary()
    assert "state slots" in summary and "4 sequences" in summary


def test_what_the_engine_refuses_for_these_models_names_it():
    with pytest.raises(ValueError, match="num_state_snapshots=-1"):
        ContinuousBatchingConfig(num_state_snapshots=-1)


def test_the_triton_kernels_serve_the_engine_with_generates_tokens(monkeypatch):
    """use_kernels=True: the engine's prefill chunks (strided slices of the flattened step, states from the slots)
    go through the Triton conv and scan kernels, its decode batches through the conv-update and state-step kernels
    that step their slots' rows of the pool in place (the interpreter here, no torch gather or scatter), and give the
    kernelized generate()'s greedy tokens."""
    pytest.importorskip("triton")
    import gpuformers.kernels.causal_conv1d as conv
    import gpuformers.kernels.ssd as ssd
    from gpuformers.kernels import kernelize
    from tests.kernels.test_ssd_kernels import _count_kernel_calls

    model = kernelize(tiny_hybrid("nemotron_h"))
    prompts = make_prompts(3, seed=4)
    reference = greedy_alone(model, prompts, 3)
    calls = _count_kernel_calls(monkeypatch, (
        (conv, "causal_conv1d_forward", "conv"), (ssd, "ssd_chunk_scan_forward", "scan"),
        (ssd, "ssm_state_step_forward", "step"), (conv, "causal_conv1d_indexed_forward", "conv_indexed"),
        (ssd, "ssm_state_step_indexed_forward", "step_indexed")))
    config = ContinuousBatchingConfig(block_size=8, num_blocks=64, max_batch_tokens=16, max_requests_per_batch=4)
    outputs = model.generate_batch(prompts, max_new_tokens=3, do_sample=False, eos_token_id=None,
                                   progress_bar=False, continuous_batching_config=config)
    assert [o.generated_tokens for o in outputs.values()] == reference
    assert calls["conv"] and calls["scan"] and calls["conv_indexed"] and calls["step_indexed"], calls
    assert not calls["step"], calls  # every decode stepped its slot in place
