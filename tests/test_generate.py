"""generate() against transformers' generate on the same tiny random weights (float32): greedy, sampling, beam
search, static cache, eos lists, stop strings, processed scores; and the errors users meet.

transformers is imported inside fixtures (it costs seconds).
"""

from __future__ import annotations

import pytest
import torch

from gpuformers.generation import generate as generate_module
from gpuformers.generation.cache import DynamicCache, StaticCache
from tests.fixtures.checkpoints import hf_config
from tests.fixtures.streamers import RecordingStreamer

PROMPT_LENGTH, PAD = 10, 4


def _pair(model_type: str, **overrides):
    """(transformers model, our model) holding the same random weights."""
    import transformers

    from gpuformers.models.config import ModelConfig
    from gpuformers.models.registry import model_class_for

    config = hf_config(model_type, bos_token_id=1, eos_token_id=2, pad_token_id=0, **overrides)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms start at 1: perturb them so that a skipped norm would show
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    ours_config = ModelConfig.from_dict(config.to_dict())
    ours = model_class_for(ours_config)(ours_config)
    ours.load_state_dict(hf.state_dict())
    return hf, ours.eval()


@pytest.fixture(scope="module")
def models():
    return {"llama": _pair("llama"), "qwen3": _pair("qwen3", head_dim=24)}


def _prompt(batch=2, seed=1):
    """(batch, PROMPT_LENGTH) ids with the second row left-padded by PAD tokens, and its mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (batch, PROMPT_LENGTH), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:
        ids[1, :PAD], mask[1, :PAD] = 0, 0
    return ids, mask


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("batch", [1, 2])
def test_greedy_matches_transformers(models, family, batch):
    hf, ours = models[family]
    ids, mask = _prompt(batch)
    expected = hf.generate(ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    got = ours.generate(ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32)
    assert got.shape == (batch, PROMPT_LENGTH + 32)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_static_cache_and_no_cache_equal_dynamic(models, family):
    hf, ours = models[family]
    ids, mask = _prompt()
    expected = hf.generate(ids, attention_mask=mask, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    dynamic = ours.generate(ids, attention_mask=mask, max_new_tokens=24, min_new_tokens=24)
    out = ours.generate(ids, attention_mask=mask, max_new_tokens=24, min_new_tokens=24,
                        cache_implementation="static", return_dict_in_generate=True)
    uncached = ours.generate(ids, attention_mask=mask, max_new_tokens=24, min_new_tokens=24, use_cache=False)
    # fixed shapes (what a compiled CUDA step gets): attention over all slots, the mask hides the empty ones
    fixed = StaticCache(ours.config, max_cache_len=PROMPT_LENGTH + 24)
    fixed_out = ours.generate(ids, attention_mask=mask, max_new_tokens=24, min_new_tokens=24, past_key_values=fixed)
    for cache in (out.past_key_values, fixed):
        assert isinstance(cache, StaticCache)
        assert cache.key_cache[0].shape == (2, 2, PROMPT_LENGTH + 24, ours.config.head_dim)
        assert cache.get_seq_length() == PROMPT_LENGTH + 23  # the last token is never fed back
    assert not out.past_key_values.fixed_shape and fixed.kv_length(1) == PROMPT_LENGTH + 24
    assert torch.equal(dynamic, expected)
    assert torch.equal(out.sequences, expected)
    assert torch.equal(fixed_out, expected)
    assert torch.equal(uncached, expected)


# eos 46 and 80 are frequent tokens of this random model: beams end early, so the finished list, the length
# penalty and the early-stopping rules all decide the result.
@pytest.mark.parametrize("settings", [
    dict(),
    dict(eos_token_id=[46, 80], length_penalty=1.0, early_stopping="never"),
    dict(eos_token_id=[46, 80], length_penalty=2.0, early_stopping=True),
    dict(eos_token_id=[82], length_penalty=-1.0),
    dict(eos_token_id=[46, 80], cache_implementation="static"),
    dict(eos_token_id=[46, 80], fixed_static_cache=True),
])
def test_beam_search_matches_transformers(models, settings):
    hf, ours = models["qwen3"]
    ids, mask = _prompt()
    common = dict(attention_mask=mask, max_new_tokens=24, num_beams=4, num_return_sequences=2,
                  return_dict_in_generate=True, output_scores=True)
    hf_settings = {k: v for k, v in settings.items() if k not in ("cache_implementation", "fixed_static_cache")}
    expected = hf.generate(ids, do_sample=False, **common, **hf_settings)
    settings = dict(settings)
    if settings.pop("fixed_static_cache", False):
        settings["past_key_values"] = StaticCache(ours.config, max_cache_len=PROMPT_LENGTH + 24)
    got = ours.generate(ids, **common, **settings)
    assert torch.equal(got.sequences, expected.sequences)
    assert torch.allclose(got.sequences_scores, expected.sequences_scores, atol=1e-5)
    assert torch.equal(got.beam_indices, expected.beam_indices.long())
    assert len(got.scores) == len(expected.scores)


def test_sampling_matches_transformers_and_is_reproducible(models):
    hf, ours = models["llama"]
    ids, mask = _prompt()
    settings = dict(attention_mask=mask, max_new_tokens=20, do_sample=True, top_k=20, top_p=0.9, temperature=0.8,
                    num_return_sequences=2)
    torch.manual_seed(3)
    expected = hf.generate(ids, **settings)
    torch.manual_seed(3)
    first = ours.generate(ids, **settings)
    torch.manual_seed(3)
    second = ours.generate(ids, **settings)
    assert first.shape == (4, PROMPT_LENGTH + 20)
    assert torch.equal(first, second)
    # On the CPU sampling draws from torch.multinomial, the same random stream as transformers.
    assert torch.equal(first, expected)
    torch.manual_seed(4)
    assert not torch.equal(ours.generate(ids, **settings), first)


def test_top_k_1_sampling_equals_greedy(models):
    _, ours = models["qwen3"]
    ids, mask = _prompt()
    greedy = ours.generate(ids, attention_mask=mask, max_new_tokens=20)
    torch.manual_seed(0)
    sampled = ours.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=True, top_k=1, temperature=1.5)
    assert torch.equal(sampled, greedy)


@pytest.mark.parametrize("seed", range(6))
def test_sampled_tokens_lie_in_top_k_and_top_p_sets(models, seed):
    _, ours = models["llama"]
    ids, mask = _prompt()
    torch.manual_seed(seed)
    top_k = ours.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=True, top_k=3, top_p=1.0,
                          temperature=2.0, return_dict_in_generate=True, output_logits=True)
    top_p = ours.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=True, top_k=0, top_p=0.5,
                          return_dict_in_generate=True, output_logits=True)
    for out in (top_k, top_p):
        tokens = out.sequences[:, PROMPT_LENGTH:]
        for step, logits in enumerate(out.logits):
            token = tokens[:, step]
            if out is top_k:
                allowed = logits.topk(3, dim=-1).indices
                assert (allowed == token[:, None]).any(dim=-1).all()
            else:  # the smallest set of most likely tokens whose probability reaches 0.5 (computed here)
                probs, order = logits.softmax(-1).sort(dim=-1, descending=True)
                before = probs.cumsum(-1) - probs  # mass of the more likely tokens
                rank = (order == token[:, None]).float().argmax(-1)
                assert (before.gather(1, rank[:, None]) < 0.5).all()


def test_eos_list_stops_each_row(models):
    hf, ours = models["llama"]
    ids, mask = _prompt()
    free = ours.generate(ids, attention_mask=mask, max_new_tokens=30, eos_token_id=None)[:, PROMPT_LENGTH:]
    # one eos token first produced by row 0 at step 3, another first produced by row 1 at a later step
    eos = [int(free[0, 3])]
    later = [i for i in range(5, 30) if int(free[1, i]) not in free[1, :i].tolist() + free[0, :4].tolist()]
    assert later, "the random model repeats itself too much for this test"
    eos.append(int(free[1, later[0]]))
    common = dict(attention_mask=mask, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    got = ours.generate(ids, **common)
    assert torch.equal(got, hf.generate(ids, do_sample=False, **common))
    new = got[:, PROMPT_LENGTH:]
    row0_end = new[0].tolist().index(eos[0]) if eos[0] in new[0].tolist() else None
    assert row0_end is not None and row0_end <= 3
    assert (new[0, row0_end + 1:] == 0).all()  # finished rows are padded
    assert int(new[1, -1]) in eos  # the longest row ends the batch with its eos


def test_spaced_stop_checks_give_the_same_output(models, monkeypatch):
    """On an accelerator the all-finished check runs every few steps; the extra steps must not show."""
    _, ours = models["llama"]
    ids, mask = _prompt()
    free = ours.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=None)[:, PROMPT_LENGTH:]
    settings = dict(attention_mask=mask, max_new_tokens=20, eos_token_id=[int(free[0, 2]), int(free[1, 6])],
                    return_dict_in_generate=True, output_scores=True)
    expected = ours.generate(ids, **settings)
    monkeypatch.setattr(generate_module, "_stop_check_interval", lambda device, streamer: 4)
    got = ours.generate(ids, **settings)
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.scores) == len(expected.scores) == expected.sequences.shape[1] - PROMPT_LENGTH


def test_processed_scores_and_logits_match_transformers(models):
    hf, ours = models["qwen3"]
    ids, mask = _prompt()
    settings = dict(attention_mask=mask, max_new_tokens=12, repetition_penalty=1.5, no_repeat_ngram_size=2,
                    bad_words_ids=[[7], [8, 9]], min_new_tokens=5, return_dict_in_generate=True,
                    output_scores=True, output_logits=True)
    expected = hf.generate(ids, do_sample=False, **settings)
    got = ours.generate(ids, **settings)
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.scores) == len(expected.scores) == 12
    for ours_scores, hf_scores in zip(got.scores, expected.scores):
        finite = torch.isfinite(hf_scores)
        assert torch.equal(finite, torch.isfinite(ours_scores))
        assert (ours_scores[finite] - hf_scores[finite]).abs().max() < 1e-4
    for ours_logits, hf_logits in zip(got.logits, expected.logits):
        assert (ours_logits - hf_logits).abs().max() < 1e-4


def test_stop_strings_stop_where_transformers_does(tmp_path):
    from tests.assets import qwen3_tokenizer_dir

    folder = qwen3_tokenizer_dir()
    import transformers

    from gpuformers.tokenizer import PreTrainedTokenizerFast

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    hf, ours = _pair("qwen3", vocab_size=151936, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    ids = torch.tensor([tokenizer.encode("The capital of France is")])
    free = ours.generate(ids, max_new_tokens=12, eos_token_id=None)[0, ids.shape[1]:].tolist()
    # a stop string that spans the end of token 4 and the start of token 5 (or the longest text available)
    text4, text5 = tokenizer.decode(free[:5]), tokenizer.decode(free[:6])
    stop = text4[-2:] + text5[len(text4):][:2]
    settings = dict(max_new_tokens=12, stop_strings=[stop, "\u00a7never\u00a7"], eos_token_id=None)
    got = ours.generate(ids, tokenizer=tokenizer, **settings)
    expected = hf.generate(ids, tokenizer=hf_tokenizer, do_sample=False, **settings)
    assert torch.equal(got, expected)
    assert got.shape[1] <= ids.shape[1] + 6
    assert stop in tokenizer.decode(got[0, ids.shape[1]:].tolist())


def test_streamer_gets_prompt_then_each_token_then_end(models):
    _, ours = models["llama"]
    ids, _ = _prompt(batch=1)
    streamer = RecordingStreamer()
    out = ours.generate(ids, max_new_tokens=5, streamer=streamer, eos_token_id=None)
    assert streamer.calls[0] == ids.tolist()
    assert streamer.calls[1:-1] == [[t] for t in out[0, PROMPT_LENGTH:].tolist()]
    assert streamer.calls[-1] == "end"


def test_cache_passed_in_continues_from_its_contents(models):
    _, ours = models["llama"]
    ids, _ = _prompt(batch=1)
    cache = DynamicCache()
    ours(ids[:, :6], past_key_values=cache, use_cache=True)  # a prefix already in the cache
    got = ours.generate(ids, max_new_tokens=8, past_key_values=cache, eos_token_id=None)
    assert torch.equal(got, ours.generate(ids, max_new_tokens=8, eos_token_id=None))


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "dynamic", "factor": 2.0}])
def test_outputs_and_model_train_after_generate(rope_scaling):
    # generate runs its loop in inference mode; nothing it returns or leaves on the model may be an inference
    # tensor: the ids are edited in place and trained on, the model (dynamic rope: frequencies set during
    # generate, past the trained length) trains afterwards, and a cache returned in a dict continues outside it.
    _, ours = _pair("llama", rope_scaling=rope_scaling, max_position_embeddings=16)
    ids, _ = _prompt(batch=1)
    out = ours.generate(ids, max_new_tokens=12, eos_token_id=None)
    assert not out.is_inference()
    out[:, 0] = 1
    ours.train()
    loss = ours(out, labels=out).loss
    loss.backward()
    assert all(p.grad is not None for p in ours.parameters())
    ours.zero_grad(set_to_none=True)
    ours.eval()
    result = ours.generate(ids, max_new_tokens=4, eos_token_id=None, return_dict_in_generate=True)
    with torch.no_grad():
        ours(result.sequences[:, -1:], past_key_values=result.past_key_values, use_cache=True)
    # a caller working in inference mode keeps it: its own cache (inference tensors) is written in place
    with torch.inference_mode():
        cache = StaticCache(ours.config, max_cache_len=32, max_batch_size=1)  # preallocated: written in place
        ours(ids[:, :4], past_key_values=cache, use_cache=True)
        ours.generate(ids, max_new_tokens=4, eos_token_id=None, past_key_values=cache)


def test_max_length_default_and_generation_config(models):
    from gpuformers.generation.config import GenerationConfig

    _, ours = models["llama"]
    ids, _ = _prompt(batch=1)
    assert ours.generate(ids, eos_token_id=None).shape[1] == PROMPT_LENGTH + 20  # transformers' default
    assert ours.generate(ids, max_length=13, eos_token_id=None).shape[1] == 13
    config = GenerationConfig(max_new_tokens=3, eos_token_id=None)
    assert ours.generate(ids, generation_config=config).shape[1] == PROMPT_LENGTH + 3
    assert ours.generate(ids, generation_config=config, max_new_tokens=4).shape[1] == PROMPT_LENGTH + 4


def test_errors_name_the_problem(models):
    _, ours = models["llama"]
    ids, _ = _prompt(batch=1)
    with pytest.raises(TypeError, match="max_new_token .*did you mean max_new_tokens"):
        ours.generate(ids, max_new_token=3)
    with pytest.raises(ValueError, match="meta.*cpu"):
        ours.generate(ids.to("meta"), max_new_tokens=3)
    too_long = torch.ones(1, 300, dtype=torch.long)
    with pytest.raises(ValueError, match="300 tokens.*max_position_embeddings=256"):
        ours.generate(too_long, max_new_tokens=3)
    with pytest.raises(ValueError, match="cache_implementation 'offloaded' is not supported"):
        ours.generate(ids, max_new_tokens=3, cache_implementation="offloaded")
    with pytest.raises(ValueError, match="temperature"):
        ours.generate(ids, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="streamer cannot be used with beam search"):
        ours.generate(ids, num_beams=2, streamer=RecordingStreamer())
    with pytest.raises(ValueError, match=r"\(batch, seq\)"):
        ours.generate(ids[0], max_new_tokens=3)


def test_static_cache_writes_in_place_and_refuses_overflow():
    from gpuformers.models.config import ModelConfig

    config = ModelConfig.from_dict(hf_config("llama").to_dict())
    cache = StaticCache(config, max_cache_len=6)
    k = torch.randn(1, 2, 4, 16)
    keys, _ = cache.update(0, k, k)
    address = keys.data_ptr()
    assert keys.shape == (1, 2, 6, 16) and cache.get_seq_length(0) == 4 and cache.kv_length(1) == 6
    step = torch.randn(1, 2, 1, 16)
    keys, _ = cache.update(0, step, step)
    assert keys.data_ptr() == address
    assert torch.equal(keys[:, :, :4], k) and torch.equal(keys[:, :, 4:5], step)
    assert isinstance(cache.get_seq_length(0), int) and cache.get_seq_length(0) == 5
    with pytest.raises(ValueError, match="at most 6 tokens"):
        cache.update(0, k, k)


def test_compiled_decode_plumbing(models, monkeypatch):
    """The CUDA path (compile the decode step over a fixed-shape static cache), run on the CPU with torch.compile's
    eager backend: the same tokens, and the compiled step is kept for the next call."""
    from gpuformers.generation.config import CompileConfig
    from gpuformers.generation.generate import GenerationMixin

    _, ours = models["llama"]
    ids, mask = _prompt()
    expected = ours.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=None)
    monkeypatch.setattr(GenerationMixin, "_compiles_decode", lambda self, config: not config.disable_compile)
    settings = dict(attention_mask=mask, max_new_tokens=4, eos_token_id=None, cache_implementation="static",
                    compile_config=CompileConfig(backend="eager"), return_dict_in_generate=True)
    out = ours.generate(ids, **settings)
    assert out.past_key_values.fixed_shape and torch.equal(out.sequences, expected)
    compiled = ours._compiled_decode
    assert torch.equal(ours.generate(ids, **settings).sequences, expected)
    assert ours._compiled_decode is compiled
    assert not ours.generate(ids, **settings, disable_compile=True).past_key_values.fixed_shape
    del ours._compiled_decode


def test_compiled_decode_is_built_once(models, monkeypatch):
    """The decode step over a fixed-shape StaticCache takes its cache slot as a tensor: torch.compile builds its
    graphs once and reuses them at every later step (no recompilation per length), with the same tokens."""
    from gpuformers.generation.config import CompileConfig
    from gpuformers.generation.generate import GenerationMixin

    _, ours = models["llama"]
    assert ours.supports_compiled_decode
    ids, mask = _prompt()
    graphs = []

    def counting_backend(gm, example_inputs, **options):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(GenerationMixin, "_compiles_decode", lambda self, config: not config.disable_compile)
    torch._dynamo.reset()
    try:
        settings = dict(attention_mask=mask, eos_token_id=None, cache_implementation="static",
                        compile_config=CompileConfig(backend=counting_backend))
        first = ours.generate(ids, max_new_tokens=12, **settings)
        after_first = len(graphs)
        again = ours.generate(ids, max_new_tokens=12, **settings)
        expected = ours.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None)
    finally:
        del ours._compiled_decode
        torch._dynamo.reset()
    assert torch.equal(first, expected) and torch.equal(again, expected)
    # 11 decode steps, each at a new length, share one graph; the second call compiles nothing.
    assert after_first == 1 and len(graphs) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_graph_decode_matches_eager(models):
    """On CUDA, the static cache's decode step runs through torch.compile(mode="reduce-overhead") (CUDA graphs)
    and gives the eager tokens."""
    _, ours = models["llama"]
    model = ours.to("cuda")
    try:
        ids, mask = (t.cuda() for t in _prompt())
        eager = model.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=None)
        graphed = model.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=None,
                                 cache_implementation="static")
        assert hasattr(model, "_compiled_decode")
        assert torch.equal(eager, graphed)
    finally:
        model.to("cpu")
        if hasattr(model, "_compiled_decode"):
            del model._compiled_decode


def test_dynamic_cache_writes_in_place_and_equals_concatenation():
    """Each step writes its tokens into a buffer with room (no copy of the whole cache per step) and attention sees
    exactly the concatenation of every step's keys and values, across growths, crops and beam reorders."""
    torch.manual_seed(0)
    steps = [torch.randn(2, 2, n, 8) for n in (5, 1, 1, 300, 1, 1)]
    cache = DynamicCache()
    buffers = []
    for step in steps:
        keys, values = cache.update(0, step, -step)
        buffers.append(cache._keys[0].data_ptr())
    expected = torch.cat(steps, dim=2)
    assert torch.equal(keys, expected) and torch.equal(values, -expected)
    assert cache.get_seq_length() == 309 and cache.key_cache[0].shape == (2, 2, 309, 8)
    assert buffers[1] == buffers[2] and buffers[4] == buffers[5]  # one-token steps after a growth: no new buffer
    cache.crop(6)
    keys, _ = cache.update(0, steps[1], steps[1])
    assert torch.equal(keys, torch.cat([expected[:, :, :6], steps[1]], dim=2))
    cache.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(cache.key_cache[0], torch.cat([expected[:, :, :6], steps[1]], dim=2)[[1, 0]])


def test_dynamic_cache_under_autograd_keeps_gradients():
    first, second = torch.randn(1, 2, 3, 4, requires_grad=True), torch.randn(1, 2, 1, 4, requires_grad=True)
    cache = DynamicCache()
    early, _ = cache.update(0, first, first)
    late, _ = cache.update(0, second, second)
    (early.sum() + late.pow(2).sum()).backward()  # an in-place write would have broken the first step's graph
    torch.testing.assert_close(first.grad, 1 + 2 * first.detach())
    torch.testing.assert_close(second.grad, 2 * second.detach())


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_hidden_states_of_every_step_match_transformers(models, family):
    hf, ours = models[family]
    ids, mask = _prompt()
    kwargs = dict(attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                  output_hidden_states=True, return_dict_in_generate=True)
    expected, got = hf.generate(ids, **kwargs), ours.generate(ids, **kwargs)
    assert torch.equal(got.sequences, expected.sequences) and len(got.hidden_states) == 5
    for step, (want, have) in enumerate(zip(expected.hidden_states, got.hidden_states)):
        assert len(have) == len(want) == hf.config.num_hidden_layers + 1
        for a, b in zip(want, have):  # (rows, prompt length or 1, hidden); the padded row's real positions
            assert a.shape == b.shape == (2, PROMPT_LENGTH if step == 0 else 1, hf.config.hidden_size)
            assert (a[0] - b[0]).abs().max() < 1e-4 and (a[1, -1] - b[1, -1]).abs().max() < 1e-4


def test_outputs_generate_does_not_make_are_refused_by_name(models):
    _, ours = models["llama"]
    ids, _ = _prompt(batch=1)
    with pytest.raises(NotImplementedError, match="output_attentions=True"):
        ours.generate(ids, max_new_tokens=2, output_attentions=True, return_dict_in_generate=True)
    with pytest.raises(NotImplementedError, match="not for beam search"):
        ours.generate(ids, max_new_tokens=2, num_beams=2, output_hidden_states=True, return_dict_in_generate=True)
    plain = ours.generate(ids, max_new_tokens=2, output_attentions=True)  # no dict asked: the ids, as transformers
    assert plain.shape == (1, PROMPT_LENGTH + 2)
