"""The CUDA-only paths of generate() and the attention backends, checked on the CPU where their logic can be
separated from the device (a stand-in for a CUDA graph's reused output memory, meta tensors for "not the CPU"), and
on a GPU where there is one (marked gpu).

transformers is imported inside fixtures (it costs seconds).
"""

from __future__ import annotations

import pytest
import torch

from gpuformers.generation.config import CompileConfig
from gpuformers.generation.generate import GenerationMixin
from tests.test_generate import _pair, _prompt


@pytest.fixture(scope="module")
def llama():
    return _pair("llama")[1]


@pytest.fixture
def compiled_decode(monkeypatch):
    """generate() takes the CUDA path on the CPU: a fixed-shape StaticCache and a compiled decode step."""
    monkeypatch.setattr(GenerationMixin, "_compiles_decode", lambda self, config: not config.disable_compile)
    return dict(cache_implementation="static", compile_config=CompileConfig(backend="eager"))


def _forget_compiled(model):
    for name in ("_compiled_decode", "_static_cache"):
        model.__dict__.pop(name, None)


def test_scores_of_a_graphed_step_are_copied_out_of_its_output_memory(llama, compiled_decode, monkeypatch):
    """A CUDA graph (mode="reduce-overhead") returns its logits in the same memory at every replay. A float32 model's
    scores kept for the caller must be copies, or every step's would read the last step's."""
    ids, mask = _prompt()
    settings = dict(attention_mask=mask, max_new_tokens=5, eos_token_id=None, return_dict_in_generate=True,
                    output_scores=True, output_logits=True)
    expected = llama.generate(ids, **settings)

    def graphed_decode(self, config, cache):
        replay_memory = {}

        def step(**inputs):
            out = self(**inputs)
            logits = replay_memory.setdefault("logits", torch.empty_like(out.logits))
            out.logits = logits.copy_(out.logits)  # the graph's static output, overwritten by the next replay
            return out

        return step

    monkeypatch.setattr(GenerationMixin, "_decode_forward", graphed_decode)
    try:
        got = llama.generate(ids, **settings, **compiled_decode)
    finally:
        _forget_compiled(llama)
    assert torch.equal(got.sequences, expected.sequences)
    for want, have in zip(expected.scores + expected.logits, got.scores + got.logits):
        torch.testing.assert_close(have, want, atol=1e-5, rtol=0)


def test_the_compiled_steps_static_cache_is_kept_and_emptied_for_the_next_call(llama, compiled_decode):
    """transformers keeps its static cache between generate() calls: a new one per call would get new addresses
    (CUDA graphs re-record; torch keeps static-address tensors alive: a leak per call)."""
    ids, mask = _prompt()
    expected = llama.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=None)
    settings = dict(attention_mask=mask, max_new_tokens=4, eos_token_id=None, return_dict_in_generate=True,
                    **compiled_decode)
    try:
        first = llama.generate(ids, **settings)
        second = llama.generate(ids, **settings)
        assert second.past_key_values is first.past_key_values and first.past_key_values.fixed_shape
        assert torch.equal(first.sequences, expected) and torch.equal(second.sequences, expected)
        assert llama.generate(ids, **{**settings, "max_new_tokens": 2}).past_key_values is first.past_key_values
        # another batch size, more room, or a loop in inference mode (inference tensors): a new cache
        one_row = llama.generate(ids[:1], **{**settings, "attention_mask": mask[:1]})
        assert one_row.past_key_values is not first.past_key_values
        assert llama.generate(ids, **{**settings, "max_new_tokens": 8}).past_key_values is not first.past_key_values
        private = {k: v for k, v in settings.items() if k != "return_dict_in_generate"}
        assert torch.equal(llama.generate(ids, **private), expected)
        kept = llama._static_cache
        assert kept.key_cache[0].is_inference()
        again = llama.generate(ids, **settings)  # outside inference mode: the inference cache cannot be written
        assert again.past_key_values is not kept and torch.equal(again.sequences, expected)
    finally:
        _forget_compiled(llama)


def test_an_offloaded_model_decodes_eagerly(llama):
    from gpuformers.generation.config import GenerationConfig

    config = GenerationConfig(compile_config=CompileConfig(backend="eager"))
    try:
        assert llama._compiles_decode(config)
        llama.hf_device_map = {"model": 0, "lm_head": "cpu"}
        assert not llama._compiles_decode(config)
        llama.hf_device_map = {"": 0}
        assert llama._compiles_decode(config)
    finally:
        del llama.hf_device_map


@pytest.mark.parametrize("method, compiled", [("bitsandbytes", False), ("gptq", False), ("awq", False),
                                              ("mxfp4", False), ("weight_only", True), ("fp8", True),
                                              ("compressed-tensors", True)])
def test_quantized_models_compile_only_where_transformers_does(llama, method, compiled):
    """transformers leaves the decode step of a model whose quantizer is not compileable eager (bitsandbytes,
    GPTQ, AWQ, MXFP4); asked for with a compile_config, it says so."""
    from types import SimpleNamespace

    from gpuformers.generation.config import GenerationConfig

    config = GenerationConfig(compile_config=CompileConfig(backend="eager"))
    llama.quantization_config = SimpleNamespace(quant_method=method)
    try:
        if compiled:
            assert llama._compiles_decode(config)
        else:
            with pytest.warns(UserWarning, match=f"a {method} quantized model's decode step is not compiled"):
                assert not llama._compiles_decode(config)
    finally:
        llama.quantization_config = None

def test_a_moe_model_with_its_host_reading_experts_is_not_compiled():
    from gpuformers.models.config import ModelConfig
    from gpuformers.models.registry import model_class_for
    from tests.fixtures.checkpoints import hf_config

    config = ModelConfig.from_dict(hf_config("qwen3_moe", num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=32).to_dict())
    moe = model_class_for(config)(config)
    assert not moe.supports_compiled_decode
    for module in moe.modules():  # what use_kernels does: the fused kernel syncs nothing
        if getattr(type(module), "syncs_host", False):
            module.forward = module.forward
    assert moe.supports_compiled_decode


def test_sdpa_with_a_mask_off_the_cpu_repeats_kv_heads_instead_of_enable_gqa(monkeypatch):
    """On CUDA, enable_gqa with a mask leaves only the math kernel (every score in float32): repeat the keys and
    values instead, as transformers does. Meta tensors stand for "not the CPU"."""
    from gpuformers.layers import attention

    seen = []
    real = attention.F.scaled_dot_product_attention

    def spy(query, key, value, **kwargs):
        seen.append((key.shape[1], kwargs.get("enable_gqa", False)))
        return real(query, key, value, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    module = torch.nn.Module().eval()
    for device in ("meta", "cpu"):
        q = torch.randn(2, 8, 5, 16, device=device)
        k = v = torch.randn(2, 2, 5, 16, device=device)
        mask = torch.ones(2, 1, 5, 5, dtype=torch.bool, device=device).tril()
        attention.sdpa_attention(module, q, k, v, mask, scaling=0.25)
        attention.sdpa_attention(module, q, k, v, None, scaling=0.25)
    # meta with a mask: 8 repeated heads; without one, and on the CPU (left as it was): enable_gqa
    assert seen == [(8, False), (2, True), (2, True), (2, True)]


def test_flash_backend_asks_once_whether_flash_attn_can_run(monkeypatch):
    """Every layer of every step calls the backend: whether the package is installed is asked once per device,
    not per call (a search of sys.path, and a graph break in a compiled step)."""
    from gpuformers.layers import flash_attention

    asked, ran = [], []
    monkeypatch.setattr(flash_attention, "_usable", {})
    monkeypatch.setattr(flash_attention, "_warned", {"flash_attention_2"})
    monkeypatch.setattr(flash_attention, "check_backend_device", lambda name, device: None)
    monkeypatch.setattr(flash_attention, "_flash_attn_usable",
                        lambda name, device: asked.append(name) or "the flash_attn package is not installed")
    monkeypatch.setattr(flash_attention, "triton_attention", lambda *args, **kwargs: ran.append(1) or (None, None))
    q = torch.zeros(1, 2, 3, 8, dtype=torch.bfloat16)
    for _ in range(3):
        flash_attention.flash_attention_2(None, q, q, q, None, scaling=1.0)
    assert asked == ["flash_attention_2"] and len(ran) == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_graph_decode_keeps_every_steps_scores_and_its_cache():
    """float32 on CUDA through torch.compile(mode="reduce-overhead"): the scores of every step as eager gives them,
    and the second call reuses the first one's static cache."""
    model = _pair("llama")[1].to("cuda")
    ids, mask = (t.cuda() for t in _prompt())
    settings = dict(attention_mask=mask, max_new_tokens=12, eos_token_id=None, return_dict_in_generate=True,
                    output_scores=True)
    try:
        eager = model.generate(ids, **settings)
        graphed = model.generate(ids, **settings, cache_implementation="static")
        again = model.generate(ids, **settings, cache_implementation="static")
        assert hasattr(model, "_compiled_decode") and again.past_key_values is graphed.past_key_values
        for out in (graphed, again):
            assert torch.equal(out.sequences, eager.sequences)
            for want, have in zip(eager.scores, out.scores):
                torch.testing.assert_close(have, want, atol=1e-4, rtol=0)
    finally:
        _forget_compiled(model)
