"""What the family tests share: tiny checkpoints per named case, our load of them, a left-padded batch, the logit
difference against transformers, loss and gradients against transformers', and the engine's greedy tokens against
generate()'s."""

from __future__ import annotations

import torch

from tests.fixtures.checkpoints import make_checkpoint

PROMPTS = [[5, 9, 23, 42], [7, 64, 100, 3, 8, 2, 77], [11]]


def checkpoint_cases(tmp_path_factory, model_type: str, cases: dict[str, dict], **common) -> dict:
    """case name -> (folder, transformers model): one tiny random checkpoint per case, with `common` settings."""
    out = {}
    for name, overrides in cases.items():
        folder = tmp_path_factory.mktemp(f"{model_type}-{name}")
        out[name] = (folder, make_checkpoint(folder, model_type, **common, **overrides))
    return out


def load(folder, **kwargs):
    from gpuformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, progress=False, **kwargs)


def left_padded(seq: int = 16, pad: int = 4, vocab: int = 128, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of two rows (2, seq); the second is left-padded with `pad` zeros."""
    ids = torch.randint(3, vocab, (2, seq), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    ids[1, :pad], mask[1, :pad] = 0, 0
    return ids, mask


def max_logit_diff(ours, hf, ids: torch.Tensor, mask: torch.Tensor) -> float:
    """The largest |ours - transformers'| logit over the unpadded positions."""
    with torch.no_grad():
        diff = ours(ids, attention_mask=mask).logits.float() - hf(ids, attention_mask=mask).logits.float()
    return diff[mask.bool()].abs().max().item()


def assert_engine_matches_generate(model, prompts: list[list[int]] = PROMPTS, max_new_tokens: int = 6) -> None:
    """generate_batch's greedy tokens (a small paged cache) equal generate()'s for each prompt alone."""
    expected = [model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                               eos_token_id=None)[0, len(p):].tolist() for p in prompts]
    outputs = model.generate_batch(prompts, max_new_tokens=max_new_tokens, eos_token_id=None, progress_bar=False,
                                   block_size=8, num_blocks=16)
    assert [r.generated_tokens for r in outputs.values()] == expected


def assert_engine_serves_adapter(folder, adapter, prompts: tuple[list[int], ...] = ([5, 9, 3, 7], [11, 4, 8, 2, 6, 10]),
                                 max_new_tokens: int = 6) -> None:
    """Multi-LoRA serving of the adapter folder `adapter` over the checkpoint `folder`: generate_batch's greedy
    tokens equal generate()'s of the model with that adapter loaded in place (model.load_adapter)."""
    reference = load(folder)
    reference.load_adapter(adapter)
    expected = [reference.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                                   eos_token_id=None)[0, len(p):].tolist() for p in prompts]
    outputs = load(folder).generate_batch(list(prompts), adapters={"x": str(adapter)}, adapter_names="x",
                                          max_new_tokens=max_new_tokens, eos_token_id=None, progress_bar=False)
    assert [r.generated_tokens for r in outputs.values()] == expected


def train_logits(model, seed: int) -> torch.Tensor:
    """Logits of the left-padded batch in training mode (dropout on), the random masks drawn from `seed`."""
    ids, mask = left_padded()
    model.train()
    try:
        with torch.no_grad():
            torch.manual_seed(seed)
            return model(ids, attention_mask=mask).logits[mask.bool()]
    finally:
        model.eval()


def assert_greedy_matches(ours, hf, cache: str | None = None) -> None:
    """Greedy generate() on a left-padded batch gives transformers' tokens (`cache`: None or "static")."""
    ids, mask = left_padded(seq=10, pad=3)
    greedy = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0,
                  cache_implementation=cache)
    assert torch.equal(ours.generate(ids, **greedy), hf.generate(ids, **greedy))


def assert_loss_matches_and_trains(ours, hf) -> None:
    """The loss on a left-padded batch equals transformers', and a training backward runs (the caller checks which
    gradients its family must have)."""
    ids, mask = left_padded()
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, attention_mask=mask, labels=labels).loss,
                                   hf(ids, attention_mask=mask, labels=labels).loss, atol=1e-5, rtol=0)
    ours.train()
    ours(ids, attention_mask=mask, labels=labels).loss.backward()


def run_two_processes(worker: str, *args: str, tmp_path, timeout: int = 240) -> dict:
    """`worker` (a script's text) under torchrun, 2 processes on gloo (CPU), given `args` and then the path its
    process 0 writes a JSON result to, which is returned. A worker ends with gpuformers.distributed.exit_process:
    the interpreter's own teardown aborts about one gloo process in twenty-five (see there)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "src"
    script, out = tmp_path / "worker.py", tmp_path / "result.json"
    script.write_text(worker)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script), *args, str(out)], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(out.read_text())


def assert_tensor_parallel_matches(folder, tmp_path) -> dict:
    """tp_plan="auto" under torchrun, 2 processes on gloo: tests/tp_worker.py compares the split model's logits,
    greedy tokens (one prompt and a batch), engine and saved checkpoint with the whole model's. Returns its result
    for the caller's own checks (the local shapes of the split layers)."""
    from pathlib import Path

    worker = (Path(__file__).resolve().parents[1] / "tp_worker.py").read_text()
    result = run_two_processes(worker, str(folder), tmp_path=tmp_path)
    assert result["logits_diff"] < 1e-5 * max(1.0, result["logits_scale"])
    assert result["tokens_equal"] and result["batch_tokens_equal"] and result["engine_equal"]
    assert result["saved_logits_diff"] == 0.0
    return result

def count_fused_moe_calls(monkeypatch) -> list[int]:
    """Skip unless the Triton kernels run here (the interpreter on the CPU); else spy on the fused MoE kernel and
    return the list each of its calls appends its token count to."""
    import pytest

    import gpuformers.kernels.moe as moe_kernels
    from gpuformers.kernels.mapping import kernels_available

    available, why = kernels_available("cpu")
    if not available:
        pytest.skip(f"Triton kernels cannot run here: {why}")
    calls: list[int] = []
    original = moe_kernels.fused_moe_forward
    monkeypatch.setattr(moe_kernels, "fused_moe_forward", lambda *a: calls.append(a[0].shape[0]) or original(*a))
    return calls


def assert_moe_loss_and_grads_match(ours, hf, router_layers: int, grad_names: tuple[str, ...],
                                    expert_layer: int) -> None:
    """With output_router_logits: aux loss, loss and every router's logits equal transformers' on a left-padded
    batch (`router_layers` of them: the sparse layers), then the gradients of `grad_names` and of layer
    `expert_layer`'s experts after the backward."""
    ids, mask = left_padded(seq=12, pad=3)
    labels = ids.masked_fill(mask == 0, -100)
    theirs, mine = hf(ids, attention_mask=mask, labels=labels), ours(ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(mine.aux_loss, theirs.aux_loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(mine.loss, theirs.loss, atol=1e-5, rtol=0)
    assert len(mine.router_logits) == len(theirs.router_logits) == router_layers
    for a, b in zip(mine.router_logits, theirs.router_logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    mine.loss.backward(), theirs.loss.backward()
    hf_params, ours_params = dict(hf.named_parameters()), dict(ours.named_parameters())
    for name in grad_names:
        torch.testing.assert_close(ours_params[name].grad, hf_params[name].grad, atol=1e-6, rtol=1e-5)
    # transformers stacks the experts: (experts, 2 * intermediate, hidden)
    assert_expert_grads_match(ours.model.layers[expert_layer].mlp.experts,
                              hf_params[f"model.layers.{expert_layer}.mlp.experts.gate_up_proj"].grad)

def assert_expert_grads_match(experts, stacked_grad: torch.Tensor, gate: str = "gate_proj",
                              up: str = "up_proj") -> None:
    """Our per-expert gate / up Linears' gradients against transformers' stacked gate_up_proj gradient (experts,
    2 * intermediate, hidden): gate rows, then up rows. An expert no token reached has no gradient: zeros."""
    for e, expert in enumerate(experts):
        weights = [getattr(expert, name).weight for name in (gate, up)]
        grads = [w.grad if w.grad is not None else torch.zeros_like(w) for w in weights]
        torch.testing.assert_close(torch.cat(grads), stacked_grad[e], atol=1e-6, rtol=1e-5)


def assert_loss_and_gradients_match(ours, hf, attn: str, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """Loss and every parameter's gradient equal transformers' (hf, run in attention backend `attn` for this call)
    on a left-padded batch whose labels skip the padding: the last pad still predicts the first real token."""
    labels = ids.masked_fill(mask == 0, -100)
    previous = hf.config._attn_implementation
    hf.set_attn_implementation(attn)
    try:
        hf.zero_grad()
        expected = hf(ids, attention_mask=mask, labels=labels).loss
        expected.backward()
    finally:
        hf.set_attn_implementation(previous)
    got = ours(ids, attention_mask=mask, labels=labels).loss
    assert abs(got.item() - expected.item()) < 1e-5
    got.backward()
    theirs = dict(hf.named_parameters())
    for name, param in ours.named_parameters():
        reference = theirs[name].grad
        assert param.grad is not None and reference is not None, name
        assert (param.grad - reference).abs().max() <= 1e-5 * reference.abs().max() + 1e-8, name
    hf.zero_grad()
