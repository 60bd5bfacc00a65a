"""Gemma, Gemma 2 and Gemma 3 (text) against transformers on tiny random checkpoints: logits (eager and sdpa, left
padding), greedy generate (dynamic and static cache), loss and backward, saving both ways, the engine, and what is
refused or left out (backends that would drop Gemma 2's attention soft-cap, kernels that compute llama's layers or
skip the logit soft-cap, the bidirectional variant).

The soft-caps are set far below Google's (50 and 30) so that they change these tiny models' numbers: a model that
skipped one would fail (test_soft_caps_change_the_logits checks that they do)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.fixtures.checkpoints import make_checkpoint, rewrite_config
from tests.models.parity import assert_loss_and_gradients_match

ATOL = 1e-4
SOFT_CAPS = dict(attn_logit_softcapping=0.01, final_logit_softcapping=0.2)

CASES = {
    # Gemma: MHA, untied head, its original releases' hidden_act "gelu" (read as the tanh GELU, as transformers does)
    "gemma-mha-untied": ("gemma", dict(head_dim=16, num_key_value_heads=4, tie_word_embeddings=False)),
    # Gemma 2: GQA, tied, sliding window on every other layer, query_pre_attn_scalar, both soft-caps
    "gemma2-capped": ("gemma2", dict(head_dim=16, num_hidden_layers=3, sliding_window=4, query_pre_attn_scalar=24,
                                     **SOFT_CAPS)),
    # Gemma 2 without soft-caps: sdpa is then allowed; untied, exact GELU
    "gemma2-uncapped": ("gemma2", dict(head_dim=16, sliding_window=6, tie_word_embeddings=False,
                                       attn_logit_softcapping=None, final_logit_softcapping=None,
                                       hidden_activation="gelu")),
    # Gemma 3: q/k norm, one rope per layer type (linear scaling on the global layers), a hidden size whose square
    # root is not exact, explicit layer_types, a final logit soft-cap
    "gemma3": ("gemma3_text", dict(hidden_size=48, head_dim=16, num_hidden_layers=3, sliding_window=4,
                                   query_pre_attn_scalar=20, final_logit_softcapping=0.2,
                                   layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                   rope_parameters={
                                       "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}})),
}


def _inputs(batch=2, seq=20, pad=5):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0  # left padding in the second row
    ids[1, :pad] = 0
    return ids, mask


def _load(folder, **kwargs):
    from gpuformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, progress=False, **kwargs)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case name -> (folder, transformers model)."""
    out = {}
    for name, (model_type, overrides) in CASES.items():
        folder = tmp_path_factory.mktemp(name)
        out[name] = (folder, make_checkpoint(folder, model_type, **overrides))
    rewrite_config(out["gemma-mha-untied"][0], hidden_act="gelu")
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_logits_match_transformers(checkpoints, case, attn):
    folder, hf = checkpoints[case]
    ours = _load(folder, attn_implementation=attn)
    ids, mask = _inputs()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # padding-aware, as generate() passes them
    valid = mask.bool()
    with torch.no_grad():
        for kwargs in ({}, {"position_ids": positions}):
            expected = hf(ids, attention_mask=mask, **kwargs).logits
            got = ours(ids, attention_mask=mask, **kwargs).logits
            assert (got - expected)[valid].abs().max().item() < ATOL


def test_soft_caps_change_the_logits(checkpoints):
    """The capped cases would fail the parity tests without their caps: each cap moves the logits by far more
    than the tolerance."""
    folder, hf = checkpoints["gemma2-capped"]
    ids, mask = _inputs()
    with torch.no_grad():
        capped = _load(folder)(ids, attention_mask=mask).logits
        for field in SOFT_CAPS:
            uncapped_folder = folder.parent / f"without-{field}"
            shutil.copytree(folder, uncapped_folder, dirs_exist_ok=True)
            data = json.loads((uncapped_folder / "config.json").read_text())
            data[field] = None  # null: no cap (a missing key would mean Google's default cap)
            (uncapped_folder / "config.json").write_text(json.dumps(data))
            uncapped = _load(uncapped_folder)(ids, attention_mask=mask).logits
            assert (capped - uncapped)[mask.bool()].abs().max().item() > 100 * ATOL, field


def test_attention_backend_and_configuration(checkpoints):
    from gpuformers.models.config import ModelConfig

    ours = _load(checkpoints["gemma2-capped"][0])  # asks for sdpa by default
    assert ours.attn_implementation == "eager"  # transformers' choice for a soft-capped Gemma 2
    assert ours.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    uncapped = _load(checkpoints["gemma2-uncapped"][0])
    assert uncapped.attn_implementation == "sdpa"
    # The GELUs (too close to tell apart in these tiny models' logits): Gemma's "gelu" is the tanh approximation,
    # Gemma 2's hidden_activation "gelu" the exact one.
    assert _load(checkpoints["gemma-mha-untied"][0]).model.layers[0].mlp.approximate == "tanh"
    assert uncapped.model.layers[0].mlp.approximate == "none"
    # transformers 4.x Gemma 2 configs have no layer_types: every other layer slides, from the first
    data = json.loads((checkpoints["gemma2-capped"][0] / "config.json").read_text())
    del data["layer_types"]
    assert ModelConfig.from_dict(data).layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    gemma3 = _load(checkpoints["gemma3"][0])
    rotary = gemma3.model.rotary_emb
    assert rotary.full_attention.inv_freq[1].item() == pytest.approx(5000.0 ** (-2 / 16) / 2.0)
    assert rotary.sliding_attention.inv_freq[1].item() == pytest.approx(50.0 ** (-2 / 16))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generate_matches_transformers(checkpoints, case, cache):
    folder, hf = checkpoints[case]
    ours = _load(folder)
    ids, mask = _inputs(seq=8, pad=3)
    greedy = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    if cache == "static":
        greedy["cache_implementation"] = "static"
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **greedy), hf.generate(ids, **greedy))


@pytest.mark.parametrize("case, attn", [(case, attn) for case in CASES for attn in ("eager", "sdpa")
                                         if not (case.startswith("gemma2") and attn == "sdpa")])  # transformers: eager
def test_loss_and_gradients_match_transformers(checkpoints, case, attn):
    folder, hf = checkpoints[case]
    assert_loss_and_gradients_match(_load(folder, attn_implementation=attn).train(), hf, attn, *_inputs())


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_loads_what_we_save(checkpoints, tmp_path, case):
    import transformers

    folder, hf = checkpoints[case]
    ours = _load(folder)
    ours.save_pretrained(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    for field in ("layer_types", "rope_parameters", "hidden_act", "hidden_activation", "query_pre_attn_scalar",
                  "attn_logit_softcapping", "final_logit_softcapping", "sliding_window", "tie_word_embeddings"):
        if hasattr(hf.config, field):
            assert getattr(back.config, field) == getattr(hf.config, field), field
    ids, mask = _inputs()
    with torch.no_grad():
        diff = back(ids, attention_mask=mask).logits - hf(ids, attention_mask=mask).logits
    assert diff[mask.bool()].abs().max().item() < 1e-5


def test_gemma3_reads_the_older_config_spelling(checkpoints, tmp_path):
    """transformers 4.x config.json: rope_theta + rope_scaling for the global layers, rope_local_base_freq for the
    sliding ones, sliding_window_pattern instead of layer_types."""
    folder, hf = checkpoints["gemma3"]
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    data = json.loads((tmp_path / "config.json").read_text())
    for key in ("rope_parameters", "layer_types"):
        data.pop(key)
    data.update(rope_theta=5000.0, rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_local_base_freq=50.0,
                sliding_window_pattern=3)  # layers 0, 1 slide, layer 2 is global: the case's layer_types
    (tmp_path / "config.json").write_text(json.dumps(data))
    ours = _load(tmp_path)
    assert ours.config.layer_types == hf.config.layer_types
    ids, mask = _inputs()
    with torch.no_grad():
        diff = ours(ids, attention_mask=mask).logits - hf(ids, attention_mask=mask).logits
    assert diff[mask.bool()].abs().max().item() < ATOL


def test_embedding_scale_is_rounded_to_the_model_dtype(checkpoints):
    """sqrt(48) = 6.928 is 6.9375 in bfloat16; transformers multiplies by the rounded value."""
    import transformers

    folder, _ = checkpoints["gemma3"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    ours = _load(folder, dtype=torch.bfloat16)
    ids, _ = _inputs()
    assert torch.equal(ours.model.embed(ids), hf.model.embed_tokens(ids))


@pytest.mark.parametrize("case", ["gemma2-capped", "gemma3"])
def test_engine_matches_generate(checkpoints, case):
    """generate_batch through the paged attention (soft-capped with eager for Gemma 2; windows of 4 and prompts
    longer than that) gives generate()'s greedy tokens."""
    model = _load(checkpoints[case][0])
    prompts = [[5, 9, 23, 42, 17, 6], [7, 64, 100, 3, 8, 2, 77, 12, 90], [11]]
    expected = [model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None)[0, len(p):]
                .tolist() for p in prompts]
    outputs = model.generate_batch(prompts, max_new_tokens=8, eos_token_id=None, progress_bar=False, block_size=4,
                                   num_blocks=32)
    assert [r.generated_tokens for r in outputs.values()] == expected
    if case == "gemma2-capped":
        assert model.attn_implementation == "paged|eager"


@pytest.mark.parametrize("backend", ["flex_attention", "triton"])
def test_backends_that_drop_the_attention_soft_cap_are_refused(checkpoints, backend):
    model = _load(checkpoints["gemma2-capped"][0])
    with pytest.raises(NotImplementedError, match="attn_logit_softcapping"):
        model.set_attn_implementation(backend)
    _load(checkpoints["gemma2-uncapped"][0]).set_attn_implementation("triton")  # nothing to drop there


def test_kernels_leave_gemma_layers_and_the_fused_loss_alone(checkpoints, monkeypatch):
    """use_kernels' RMSNorm and SwiGLU kernels compute llama's layers, not Gemma's: they are not swapped in (rotary,
    which is the same, is); a final soft-cap keeps training off the fused LM-head loss, which would skip it."""
    from gpuformers.kernels.mapping import Mode, kernelize, unkernelize

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # kernels "available" on the CPU; none runs in this test
    for case in ("gemma-mha-untied", "gemma2-capped", "gemma3"):
        model = _load(checkpoints[case][0])
        kernelize(model, mode=Mode.TRAINING)
        try:
            assert not [name for name, m in model.named_modules() if "forward" in m.__dict__], case
            functions = model._kernel_state.functions
            assert "rotary_pos_emb" in functions
            assert model.logits_are_head_output == (case == "gemma-mha-untied"), case
        finally:
            unkernelize(model)


@pytest.mark.parametrize("case", ["gemma2-capped", "gemma3"])
def test_training_loss_keeps_the_final_soft_cap(checkpoints, case):
    # The Trainer's step reads no logits (logits_not_needed): a model whose logits are the head's output then fuses
    # head and loss; a soft-capped one must not, or its loss would skip the cap.
    from gpuformers.layers.loss import logits_not_needed

    folder, hf = checkpoints[case]
    ours = _load(folder).train()
    ids, mask = _inputs()
    labels = ids.masked_fill(mask == 0, -100)
    with logits_not_needed():
        loss = ours(ids, attention_mask=mask, labels=labels).loss
    with torch.no_grad():
        expected = hf.eval()(ids, attention_mask=mask, labels=labels).loss
    assert abs(loss.item() - expected.item()) < 1e-5


def test_hybrid_cache_from_the_checkpoint_means_the_default_cache(checkpoints, tmp_path):
    # Google's Gemma 2 / 3 generation_config.json says cache_implementation "hybrid"; transformers reads it, from the
    # model's own defaults, as the dynamic cache, and so do we: generate() works and gives its tokens.
    import transformers

    folder = tmp_path / "gemma2"
    shutil.copytree(checkpoints["gemma2-capped"][0], folder)
    (folder / "generation_config.json").write_text(json.dumps({"cache_implementation": "hybrid", "eos_token_id": 1}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ours = _load(folder)
    ids, mask = _inputs(seq=8, pad=2)
    greedy = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **greedy), hf.generate(ids, **greedy))


def test_unsupported_configurations_are_refused(checkpoints):
    from gpuformers.models.config import ModelConfig

    data = json.loads((checkpoints["gemma3"][0] / "config.json").read_text())
    with pytest.raises(NotImplementedError, match="use_bidirectional_attention"):
        ModelConfig.from_dict({**data, "use_bidirectional_attention": True})
    with pytest.raises(NotImplementedError, match="hidden_activation 'relu'"):
        ModelConfig.from_dict({**data, "hidden_activation": "relu"})
    sliding_yarn = {**data["rope_parameters"], "sliding_attention": {"rope_type": "yarn", "factor": 2.0}}
    with pytest.raises(NotImplementedError, match="sliding-attention layers with rope_type 'yarn'"):
        ModelConfig.from_dict({**data, "rope_parameters": sliding_yarn})


@pytest.mark.distributed
def test_tensor_parallel_matches_the_whole_model(checkpoints, tmp_path):
    """tp_plan="auto" (the llama plan: the same projection names; norms whole, Gemma 3's q_norm / k_norm as Qwen3's)
    over 2 CPU processes: the same logits, greedy tokens and engine tokens as the model loaded whole, and
    save_pretrained of the gathered slices. (Gemma 2 differs only inside each head: its soft-cap.)"""
    from tests.test_tensor_parallel import _torchrun_worker

    result = _torchrun_worker(checkpoints["gemma3"][0], tmp_path / "result.json", processes=2)
    assert result["logits_diff"] < 1e-5 * max(1.0, result["logits_scale"])
    assert result["tokens_equal"] and result["batch_tokens_equal"] and result["engine_equal"]
    assert result["saved_logits_diff"] == 0.0


@pytest.mark.parametrize("max_decode_context", [None, 12], ids=["per-sequence", "batched-decodes"])
def test_paged_attention_applies_the_soft_cap(max_decode_context):
    """The engine's paged attention with softcap= equals eager attention with it over each sequence's own keys,
    on the CPU path (each sequence alone) and on the batched decode path the GPU and CUDA graphs take (decodes
    gathered up to max_decode_context and masked), for both paged backends."""
    from gpuformers.engine.paged_attention import PAGED_BACKENDS, PagedContext, paged_context
    from gpuformers.layers.attention import eager_attention

    block, kv_heads, heads, dim, softcap = 4, 2, 4, 8, 0.5
    torch.manual_seed(0)
    lens, queries, tables = [5, 9, 7], [1, 1, 3], [[0, 1], [2, 3, 4], [5, 6]]  # two decodes, then a chunk of 3
    keys = [torch.randn(n, kv_heads, dim) * 2 for n in lens]
    values = [torch.randn(n, kv_heads, dim) for n in lens]
    query = torch.randn(1, heads, sum(queries), dim) * 2
    k_cache, v_cache = torch.zeros(7 * block, kv_heads, dim), torch.zeros(7 * block, kv_heads, dim)
    new_slots = []
    for table, n, q, k, v in zip(tables, lens, queries, keys, values):
        slots = torch.tensor([table[p // block] * block + p % block for p in range(n)])
        k_cache[slots], v_cache[slots] = k, v
        new_slots.append(slots[n - q:])
    block_tables = torch.tensor([t + [0] * (3 - len(t)) for t in tables])
    module = torch.nn.Module().eval()
    for name, backend in PAGED_BACKENDS.items():
        ctx = PagedContext(torch.cat(new_slots), block_tables, torch.tensor(lens), [0, 1, 2, 5], list(lens),
                           num_decodes=2, block_size=block, key_caches=[k_cache], value_caches=[v_cache],
                           max_decode_context=max_decode_context)
        with paged_context(ctx):
            out, _ = backend(module, query, k_cache, v_cache, None, scaling=dim**-0.5, softcap=softcap)
        start = 0
        for n, q, k, v in zip(lens, queries, keys, values):
            causal = (torch.arange(n)[None, :] <= torch.arange(n - q, n)[:, None])[None, None]
            kv = (k.transpose(0, 1)[None], v.transpose(0, 1)[None])  # (1, kv_heads, n, dim)
            expected, _ = eager_attention(module, query[:, :, start:start + q], *kv, causal, scaling=dim**-0.5,
                                          softcap=softcap)
            uncapped, _ = eager_attention(module, query[:, :, start:start + q], *kv, causal, scaling=dim**-0.5)
            torch.testing.assert_close(out[:, start:start + q], expected, atol=1e-5, rtol=1e-5, msg=name)
            assert (expected - uncapped).abs().max() > 0.01
            start += q
