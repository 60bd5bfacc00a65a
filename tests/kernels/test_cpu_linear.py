"""Copies of the linear weights for the CPU (kernels/cpu_linear.py), oneDNN-packed, transposed or concatenated: the
same numbers as F.linear up to rounding, the same greedy tokens from the engine and generate() as without them,
each form where it was chosen (PACKED at the row counts it serves, a batch-1 decode's forms per shape), the model
untouched outside a use, weights changed between uses copied again, and the automatic decisions (on for float32
on the CPU while the copies fit; refused by name elsewhere). Which form wins is kernels/cpu_matmul_probe.py's
question (tests/kernels/test_cpu_matmul_probe.py)."""

from __future__ import annotations

import contextlib
import copy
import itertools
import types

import pytest
import torch
import torch.nn.functional as F

from gpuformers.engine.config import ContinuousBatchingConfig
from gpuformers.kernels import cpu_linear, cpu_matmul_probe
from gpuformers.kernels.cpu_linear import COLUMNS, PACKED, ROWS, PackedLinears, packable_linears
from gpuformers.kernels.cpu_matmul_probe import packed_faster, prepack_available
from gpuformers.engine.manager import ContinuousBatchingManager
from tests.engine.test_engine import NEW_TOKENS, greedy_reference, make_prompts, tiny_model

pytestmark = pytest.mark.skipif(not prepack_available(), reason="this torch build has no oneDNN")


def _spy_on_sibling_matmuls(monkeypatch) -> list[int]:
    """The row counts of the packed sibling-group calls (q/k/v, gate/up) from now on, in a list that fills up: a
    layer's forward."""
    rows_seen = []
    packed_forward = cpu_linear._PackedGroup.forward

    def spy(self, index, x):
        rows_seen.append(x.numel() // x.shape[-1])
        return packed_forward(self, index, x)

    monkeypatch.setattr(cpu_linear._PackedGroup, "forward", spy)
    return rows_seen


@pytest.fixture(autouse=True)
def packed_everywhere(monkeypatch):
    """Packed weights for every row count, whatever this machine's calibration says, so that each test runs the
    path it is about; tests of the calibration itself unset it."""
    monkeypatch.setenv(cpu_linear.ENV, "all")


def test_packed_linear_equals_f_linear_and_leaves_other_row_counts_to_it(monkeypatch):
    monkeypatch.setenv(cpu_linear.ENV, "4-192")
    layer = torch.nn.Linear(64, 96, bias=True)
    packed = PackedLinears(layer)
    with torch.inference_mode(), packed.active():
        for rows in (1, 3, 4, 17, 192, 193, 300):
            x = torch.randn(1, rows, 64)
            got, want = layer(x), F.linear(x, layer.weight, layer.bias)
            assert got.shape == want.shape == (1, rows, 96)
            if packed_faster(rows):
                assert (got - want).abs().max() < 1e-5  # another summation order
            else:
                assert torch.equal(got, want)  # F.linear itself
    with torch.enable_grad(), packed.active():  # a call that records a backward stays on F.linear
        x = torch.randn(8, 64, requires_grad=True)
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert "forward" not in layer.__dict__


@pytest.mark.parametrize("model_type, overrides", [("qwen3", {}), ("qwen2", {"qkv_bias": True})])
def test_engine_tokens_equal_generate_with_packed_weights_and_the_model_is_left_as_it_was(monkeypatch, model_type,
                                                                                         overrides):
    model = tiny_model(model_type, **overrides)
    prompts = make_prompts(24)
    expected = greedy_reference(model, prompts)
    manager = ContinuousBatchingManager(model, continuous_batching_config=ContinuousBatchingConfig(
        prepack_weights=True))
    groups = [[layer for layer in group.layers] for group in manager.runner.packed.groups]
    assert sorted(id(layer) for group in groups for layer in group) == sorted(map(id, packable_linears(model)))
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert [attention.q_proj, attention.k_proj, attention.v_proj] in groups  # siblings share one matmul
    assert [mlp.gate_proj, mlp.up_proj] in groups and [mlp.down_proj] in groups
    assert "prepacked linear weights" in manager.memory_summary()
    rows_seen = _spy_on_sibling_matmuls(monkeypatch)
    ids = [manager.add_request(p, max_new_tokens=10) for p in prompts]
    manager.run_until_done()
    assert [manager.get_result(i, timeout=0).generated_tokens for i in ids] == expected
    assert any(packed_faster(rows) for rows in rows_seen)  # the packed path did run
    assert not any("forward" in layer.__dict__ for layer in packable_linears(model))
    assert all(getattr(group._last, "input", None) is None for group in manager.runner.packed.groups)  # none kept


def test_a_weight_changed_between_steps_is_packed_again():
    model = tiny_model()
    prompts = make_prompts(8, seed=3)
    manager = ContinuousBatchingManager(model, continuous_batching_config=ContinuousBatchingConfig(
        prepack_weights=True))
    ids = [manager.add_request(p, max_new_tokens=4) for p in prompts]
    manager.run_until_done()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(3.0)  # in place: the same storage, a new version
            layer.self_attn.k_proj.weight.mul_(-2.0)  # one layer of a sibling group
        model.model.layers[0].self_attn.o_proj.weight = torch.nn.Parameter(
            model.model.layers[0].self_attn.o_proj.weight.flip(0).clone())  # a new storage
    expected = greedy_reference(model, prompts, new_tokens=6)
    ids = [manager.add_request(p, max_new_tokens=6) for p in prompts]
    manager.run_until_done()
    assert [manager.get_result(i, timeout=0).generated_tokens for i in ids] == expected


def test_weights_made_in_inference_mode():
    with torch.inference_mode():  # weights without a version counter, as a loader in inference mode leaves them
        model = tiny_model()
    prompts = make_prompts(6, seed=5)
    expected = greedy_reference(model, prompts)
    out = model.generate_batch(prompts, max_new_tokens=NEW_TOKENS, progress_bar=False, prepack_weights=True)
    assert [r.generated_tokens for r in out.values()] == expected


def test_automatic_decision(monkeypatch):
    model = tiny_model()
    assert ContinuousBatchingConfig().resolve(model).prepack_weights is True
    monkeypatch.setenv(cpu_linear.ENV, "none")  # as on a CPU where they are never faster: not worth the memory
    assert ContinuousBatchingConfig().resolve(model).prepack_weights is False
    assert ContinuousBatchingConfig(prepack_weights=True).resolve(model).prepack_weights is True
    monkeypatch.setenv(cpu_linear.ENV, "all")
    assert ContinuousBatchingConfig(prepack_weights=False).resolve(model).prepack_weights is False
    half = tiny_model().to(torch.bfloat16)
    assert ContinuousBatchingConfig().resolve(half).prepack_weights is False
    with pytest.raises(ValueError, match="prepack_weights=True: the model has no float32 nn.Linear"):
        ContinuousBatchingConfig(prepack_weights=True).resolve(half)


def test_automatic_decision_leaves_them_out_when_memory_is_short(monkeypatch):
    model = tiny_model()
    linear_bytes = sum(layer.weight.numel() * 4 for layer in packable_linears(model))
    monkeypatch.setattr(cpu_linear, "available_ram", lambda: 3 * linear_bytes)  # the rule of generate()'s copies
    assert ContinuousBatchingConfig(num_blocks=8).resolve(model).prepack_weights is False
    assert ContinuousBatchingConfig(prepack_weights=True, num_blocks=8).resolve(model).prepack_weights is True
    monkeypatch.setattr(cpu_linear, "available_ram", lambda: 4 * linear_bytes)
    assert ContinuousBatchingConfig(num_blocks=8).resolve(model).prepack_weights is True


# --- generate() -----------------------------------------------------------------------------------------------------


def _generate(model, prompts, **kwargs):
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return model.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None, pad_token_id=0, **kwargs)


def test_generate_uses_them_with_the_same_tokens_and_leaves_the_model_as_it_was(monkeypatch):
    model = tiny_model()
    prompts = make_prompts(5, seed=7)
    monkeypatch.setenv(cpu_linear.ENV, "none")
    greedy = _generate(model, prompts, do_sample=False)
    torch.manual_seed(3)
    sampled = _generate(model, prompts, do_sample=True, top_k=20)
    beams = _generate(model, prompts[:2], num_beams=3, do_sample=False)
    monkeypatch.setenv(cpu_linear.ENV, "all")
    rows_seen = _spy_on_sibling_matmuls(monkeypatch)
    assert torch.equal(_generate(model, prompts, do_sample=False), greedy)
    assert 5 in rows_seen and 5 * 48 >= max(rows_seen) > 5  # the decode steps (5 rows) and the prefill
    torch.manual_seed(3)
    assert torch.equal(_generate(model, prompts, do_sample=True, top_k=20), sampled)
    assert torch.equal(_generate(model, prompts[:2], num_beams=3, do_sample=False), beams)
    packed = cpu_linear.packed_for(model)
    assert packed is not None and packed is cpu_linear.packed_for(model)  # made once, kept with the model
    assert not any("forward" in layer.__dict__ for layer in packable_linears(model))
    rows_seen.clear()
    with torch.no_grad():
        model(torch.tensor([prompts[0]]))  # a plain forward outside generate(): F.linear itself
    assert rows_seen == []


def test_generate_after_the_model_changed_packs_again_or_not_at_all(monkeypatch):
    model = tiny_model()
    prompts = make_prompts(3, seed=9)
    first = cpu_linear.packed_for(model)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(-1.5)  # an edited weight: repacked before its next use
    monkeypatch.setenv(cpu_linear.ENV, "none")
    expected = _generate(copy.deepcopy(model), prompts, do_sample=False)
    monkeypatch.setenv(cpu_linear.ENV, "all")
    assert torch.equal(_generate(model, prompts, do_sample=False), expected)
    assert cpu_linear.packed_for(model) is first
    monkeypatch.setenv(cpu_linear.ENV, "none")  # turned off: the copies are let go
    _generate(model, prompts, do_sample=False)
    assert model not in cpu_linear._FOR_MODEL
    monkeypatch.setenv(cpu_linear.ENV, "all")
    first = cpu_linear.packed_for(model)
    old = model.model.layers[1].self_attn.o_proj
    model.model.layers[1].self_attn.o_proj = torch.nn.Linear(old.in_features, old.out_features, bias=False)  # new
    assert cpu_linear.packed_for(model) is not first
    model.to(torch.bfloat16)  # no float32 linear layer left: nothing to pack, and the old copies are let go
    _generate(model, prompts, do_sample=False)
    assert model not in cpu_linear._FOR_MODEL


def test_biases_are_packed_with_their_weights_and_again_when_edited(monkeypatch):
    model = tiny_model("qwen2", qkv_bias=True)  # q/k/v with biases: one packed weight and one stacked bias
    prompts = make_prompts(3, seed=13)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.bias.normal_()
    packed = cpu_linear.packed_for(model)
    assert any(group.bias is not None and len(group.layers) == 3 for group in packed.groups)
    for _ in range(2):
        monkeypatch.setenv(cpu_linear.ENV, "none")
        expected = _generate(model, prompts, do_sample=False)
        monkeypatch.setenv(cpu_linear.ENV, "all")
        assert torch.equal(_generate(model, prompts, do_sample=False), expected)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.v_proj.bias.mul_(-3.0)  # in place, between two calls


def test_generate_and_an_engine_on_one_model_share_one_copy():
    model = tiny_model()
    manager = ContinuousBatchingManager(model, continuous_batching_config=ContinuousBatchingConfig(
        prepack_weights=True))
    assert cpu_linear.packed_for(model) is manager.runner.packed


def test_generate_leaves_them_out_when_memory_is_short(monkeypatch):
    model = tiny_model()
    linear_bytes = sum(layer.weight.numel() * 4 for layer in packable_linears(model))
    monkeypatch.setattr(cpu_linear, "available_ram", lambda: 3 * linear_bytes)
    assert cpu_linear.packed_for(model) is None
    monkeypatch.setattr(cpu_linear, "available_ram", lambda: 4 * linear_bytes)
    assert cpu_linear.packed_for(model) is not None


def test_two_threads_generating_on_one_model_get_their_own_tokens(monkeypatch):
    import threading

    model = tiny_model()
    batches = [make_prompts(3, seed=s) for s in (11, 12)]
    monkeypatch.setenv(cpu_linear.ENV, "none")
    expected = [_generate(model, prompts, do_sample=False) for prompts in batches]
    monkeypatch.setenv(cpu_linear.ENV, "all")
    results = [[], []]

    def worker(i):
        for _ in range(4):
            results[i].append(_generate(model, batches[i], do_sample=False))

    threads = [threading.Thread(target=worker, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in (0, 1):
        assert len(results[i]) == 4 and all(torch.equal(r, expected[i]) for r in results[i])
    assert not any("forward" in layer.__dict__ for layer in packable_linears(model))


def test_an_input_off_the_cpu_takes_the_layer_weights_as_they_are(monkeypatch):
    """A layer offloaded to the CPU runs on a GPU with its weights copied in (device_map): the packed CPU copy must
    not serve it. Simulated on the CPU: an input that says it is not on the CPU gets F.linear on the layer's weight."""
    layer = torch.nn.Linear(64, 96)
    packed = PackedLinears(layer)
    with torch.no_grad():
        layer.weight.data.mul_(2.0)  # unseen by the packed copy (as the GPU copy a hook puts in place would be)
    x = torch.randn(4, 64)

    class Elsewhere(torch.Tensor):
        @property
        def is_cpu(self):
            return False

    with torch.inference_mode(), packed.active():
        out = layer(x.as_subclass(Elsewhere))
    assert torch.equal(out.as_subclass(torch.Tensor), F.linear(x, layer.weight, layer.bias))


def test_generate_on_a_model_off_the_cpu_lets_its_copies_go(monkeypatch):
    model = tiny_model()
    assert cpu_linear.packed_for(model) is not None and model in cpu_linear._FOR_MODEL
    on_a_gpu = types.SimpleNamespace(weight=types.SimpleNamespace(device=torch.device("cuda", 0)))
    monkeypatch.setattr(model, "get_input_embeddings", lambda: on_a_gpu)  # as after model.to("cuda")
    assert isinstance(model._cpu_matmuls(model, 1), contextlib.nullcontext) and model not in cpu_linear._FOR_MODEL


def test_assisted_generation_packs_the_assistant_too(monkeypatch):
    model, assistant = tiny_model(), tiny_model("llama")  # another family with the same vocabulary
    prompts = make_prompts(1, seed=17)
    monkeypatch.setenv(cpu_linear.ENV, "none")
    expected = _generate(model, prompts, do_sample=False, assistant_model=assistant)
    monkeypatch.setenv(cpu_linear.ENV, "all")
    assert torch.equal(_generate(model, prompts, do_sample=False, assistant_model=assistant), expected)
    assert model in cpu_linear._FOR_MODEL and assistant in cpu_linear._FOR_MODEL


# --- batch-1 decoding: each group's fastest form at one row, within a memory budget ---------------------------------

# Measurement stood in by a table over tiny_model("qwen2")'s shapes, (in, out) -> ms per form at one row, so that
# every form is used: q/k/v (64 -> 128, also the LM head's shape) COLUMNS 50% faster than its weight, gate/up
# (64 -> 192) ROWS (concatenated in place), o_proj (64 -> 64) ROWS (a lone layer: no copy), down_proj (96 -> 64)
# PACKED 40% faster.
ONE_ROW_TIMES = {(64, 128): {ROWS: 2.0, COLUMNS: 1.0, PACKED: 3.0}, (64, 192): {ROWS: 1.0, COLUMNS: 1.5, PACKED: 2.0},
                 (64, 64): {ROWS: 1.0, COLUMNS: 2.0, PACKED: 2.0}, (96, 64): {ROWS: 1.0, COLUMNS: 1.2, PACKED: 0.6}}


def _one_row_forms(monkeypatch) -> list:
    """ONE_ROW_TIMES for the measurement (cpu_matmul_probe's own, so any caller sees it); the shapes asked."""
    asked = []
    monkeypatch.delenv(cpu_linear.ENV)
    monkeypatch.setattr(cpu_matmul_probe, "_one_row_times",
                        lambda i, o, threads: asked.append((i, o)) or ONE_ROW_TIMES[(i, o)])
    return asked


def test_batch_one_generate_takes_each_groups_fastest_form_within_half_the_weights(monkeypatch):
    """Batch-1 copies where they save most, up to half the weights again (never a second full copy); gate/up, whose
    own weights are fastest, become row slices of one buffer (one matmul, no copy); same tokens as F.linear."""
    model = tiny_model("qwen2", qkv_bias=True)  # q/k/v biases: stacked with their copy
    prompts = make_prompts(3, seed=19)
    monkeypatch.setenv(cpu_linear.ENV, "none")
    expected = [_generate(model, [p], do_sample=False) for p in prompts]
    torch.manual_seed(5)
    sampled = _generate(model, prompts[:1], do_sample=True, top_k=20)
    weights = {name: p.clone() for name, p in model.named_parameters()}
    _one_row_forms(monkeypatch)
    rows_seen = _spy_on_sibling_matmuls(monkeypatch)
    got = [_generate(model, [p], do_sample=False) for p in prompts]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert 1 in rows_seen and max(rows_seen) > 1  # the copies served the decode steps and the prompts
    torch.manual_seed(5)
    assert torch.equal(_generate(model, prompts[:1], do_sample=True, top_k=20), sampled)
    kept = cpu_linear._FOR_MODEL[model]
    forms = {tuple(id(layer) for layer in group.layers): group.form for group in kept.groups}
    first, second = model.model.layers
    for layer in (first, second):
        attention, mlp = layer.self_attn, layer.mlp
        assert forms[(id(attention.q_proj), id(attention.k_proj), id(attention.v_proj))] == COLUMNS  # saves 50%
        assert forms[(id(mlp.gate_proj), id(mlp.up_proj))] == ROWS
        assert (id(attention.o_proj),) not in forms  # its own weight is its fastest form: no copy
    assert forms[(id(model.lm_head),)] == COLUMNS
    # down_proj saves 40%: the first fits in half the weights after the q/k/v and LM head copies, the second not
    assert forms[(id(first.mlp.down_proj),)] == PACKED and (id(second.mlp.down_proj),) not in forms
    linear_bytes = sum(layer.weight.numel() * 4 for layer in packable_linears(model))
    assert linear_bytes / 4 < kept.nbytes <= linear_bytes / 2
    for group in kept.groups:
        if group.form == ROWS:  # each weight is its rows of the group's buffer: the model's own memory
            starts = [0, *itertools.accumulate(group.widths)][:-1]
            assert group.nbytes == 0
            assert [layer.weight.data_ptr() for layer in group.layers] == [group.copy[s].data_ptr() for s in starts]
    assert all(torch.equal(p, weights[name]) and p.is_contiguous() for name, p in model.named_parameters())
    assert not any("forward" in layer.__dict__ for layer in packable_linears(model))


def test_one_shot_generate_measures_and_copies_nothing(monkeypatch):
    """`gpuformers generate` answers once: the measurement and the copies would cost more than they save, and
    their memory would stay to the end. Outside the block the same model gets its copies."""
    model = tiny_model("qwen2")
    prompt = make_prompts(1, seed=31)
    asked = _one_row_forms(monkeypatch)
    weights = [layer.weight for layer in packable_linears(model)]
    with cpu_linear.one_shot():
        first = _generate(model, prompt, do_sample=False)
    assert asked == [] and model not in cpu_linear._FOR_MODEL
    assert all(layer.weight is w and layer.weight.data_ptr() == w.data_ptr()
               for layer, w in zip(packable_linears(model), weights))
    assert torch.equal(_generate(model, prompt, do_sample=False), first)  # (greedy: the same tokens)
    assert asked and cpu_linear._FOR_MODEL[model].nbytes > 0


def test_batch_one_groups_follow_the_weights_and_leave_training_as_it_was(monkeypatch):
    """The concatenated weights are the model's: an in-place edit is seen at once, a replaced weight is laid in
    again, and the model still trains (its parameters are not inference tensors)."""
    model = tiny_model("qwen2")
    prompts = make_prompts(2, seed=37)
    _one_row_forms(monkeypatch)
    _generate(model, prompts[:1], do_sample=False)
    with torch.no_grad():
        model.model.layers[0].mlp.gate_proj.weight.mul_(-2.0)
        model.model.layers[1].mlp.up_proj.weight = torch.nn.Parameter(model.model.layers[1].mlp.up_proj.weight * 3)
    monkeypatch.setenv(cpu_linear.ENV, "none")
    expected = _generate(copy.deepcopy(model), prompts[:1], do_sample=False)
    monkeypatch.delenv(cpu_linear.ENV)
    assert torch.equal(_generate(model, prompts[:1], do_sample=False), expected)
    up = model.model.layers[1].mlp.up_proj.weight
    group = next(g for g in cpu_linear._FOR_MODEL[model].groups if model.model.layers[1].mlp.up_proj in g.layers)
    assert group.form == ROWS and up.data_ptr() == group.copy[group.widths[0]].data_ptr()  # laid in again
    model(torch.tensor([prompts[0]])).logits.sum().backward()
    assert model.model.layers[0].mlp.gate_proj.weight.grad is not None


def test_a_batch_of_another_size_replaces_the_batch_one_copies(monkeypatch):
    model = tiny_model("qwen2")
    prompts = make_prompts(3, seed=23)
    monkeypatch.setenv(cpu_linear.ENV, "none")
    one, three = _generate(model, prompts[:1], do_sample=False), _generate(model, prompts, do_sample=False)
    _one_row_forms(monkeypatch)
    assert torch.equal(_generate(model, prompts[:1], do_sample=False), one)
    batch_one = cpu_linear._FOR_MODEL[model]
    assert {group.form for group in batch_one.groups} == {COLUMNS, ROWS, PACKED}
    monkeypatch.setenv(cpu_linear.ENV, "all")  # three rows a step: PACKED for every group
    assert torch.equal(_generate(model, prompts, do_sample=False), three)
    assert cpu_linear._FOR_MODEL[model] is not batch_one
    assert {group.form for group in cpu_linear._FOR_MODEL[model].groups} == {PACKED}
    # the memory rule counts the copies a plan makes: not the ROWS groups, concatenated in place
    _one_row_forms(monkeypatch)
    planned = sum(group.nbytes for group in batch_one.groups)
    monkeypatch.setattr(cpu_linear, "available_ram", lambda: 4 * planned - 4)
    assert cpu_linear.packed_for(model, 1) is None
    monkeypatch.setattr(cpu_linear, "available_ram", lambda: 4 * planned)
    assert cpu_linear.packed_for(model, 1) is not None


def test_packed_matmuls_run_at_a_bounded_set_of_row_counts(monkeypatch):
    """oneDNN keeps a primitive per row count it meets, and a server meets hundreds: the PACKED calls pad their
    rows to a few counts (at most 25% more rows), with the numbers of F.linear on the rows asked."""
    layer = torch.nn.Linear(64, 96)
    packed = PackedLinears(layer)
    (group,) = packed.groups
    run_at, matmul = [], group.matmul
    group.matmul = lambda x, *args: run_at.append(x.numel() // x.shape[-1]) or matmul(x, *args)
    with torch.inference_mode(), packed.active():
        for rows in range(1, 513):
            x = torch.randn(rows, 64) if rows % 2 else torch.randn(1, rows, 64)
            got = layer(x)
            assert got.shape == (*x.shape[:-1], 96) and (got - F.linear(x, layer.weight, layer.bias)).abs().max() < 1e-5
            assert rows <= run_at[-1] <= max(rows, 1.25 * rows)
    assert len(set(run_at)) == 8 + 4 * 6  # 1-8, then 4 counts per doubling up to 512


@pytest.mark.parametrize("form", [COLUMNS, ROWS, PACKED])
def test_each_form_equals_f_linear_and_a_recorded_backward_takes_f_linear(monkeypatch, form):
    monkeypatch.setenv(cpu_linear.ENV, "all")  # (PACKED serves every row count)
    module = torch.nn.Module()
    module.gate_proj, module.up_proj = torch.nn.Linear(64, 96), torch.nn.Linear(64, 80, bias=False)
    copies = PackedLinears(module, plan=[([module.gate_proj, module.up_proj], form)])
    with torch.inference_mode(), copies.active():
        for rows in (1, 3, 40):
            x = torch.randn(2, rows, 64)
            for layer in (module.gate_proj, module.up_proj):
                got, want = layer(x), F.linear(x, layer.weight, layer.bias)
                assert got.shape == want.shape and (got - want).abs().max() < 1e-5
    with torch.enable_grad(), copies.active():
        x = torch.randn(4, 64, requires_grad=True)
        assert torch.equal(module.gate_proj(x), F.linear(x, module.gate_proj.weight, module.gate_proj.bias))
