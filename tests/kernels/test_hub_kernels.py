"""Hub and local kernels through the `kernels` package, with transformers' spellings: a kernel folder in the kernels
layout (a pure-torch "torch-universal" build written here) named through KernelConfig(..., use_local_kernel=True)
replaces a layer's forward with equal logits and swaps its training variant in on model.train(); the same kernel as a
Hub repo resolves from a Hugging Face cache laid out here with HF_HUB_OFFLINE=1; offline without it in the cache the
error names the repo and how to fetch it; repos outside kernels-community need explicit trust; and
attn_implementation="org/repo" runs a Hub attention kernel."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("kernels")

from tests.fixtures.checkpoints import make_checkpoint  # noqa: E402

from gpuformers import AutoModelForCausalLM  # noqa: E402
from gpuformers.kernels.mapping import KernelConfig  # noqa: E402

COMMIT = "0123456789abcdef0123456789abcdef01234567"

# The kernel's Python: RMSNorm as the model computes it, counting its calls, in an inference and a training class
# (the kernels package's layer rule: no __init__, only the replaced layer's attributes are read).
LAYERS = '''
import torch

CALLS = {"inference": 0, "training": 0}


def _rms_norm(self, hidden_states):
    dtype = hidden_states.dtype
    x = hidden_states.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x.to(dtype)


class MyRMSNorm(torch.nn.Module):
    def forward(self, hidden_states):
        CALLS["inference"] += 1
        return _rms_norm(self, hidden_states)


class MyRMSNormTraining(torch.nn.Module):
    def forward(self, hidden_states):
        CALLS["training"] += 1
        return _rms_norm(self, hidden_states)
'''

# An attention kernel with flash-attn 2's flash_attn_func: (batch, seq, heads, head_dim), bottom-right causal.
ATTENTION = '''
import torch

CALLS = []


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1)):
    CALLS.append((tuple(q.shape), tuple(k.shape), causal, window_size))
    heads, kv_heads = q.shape[2], k.shape[2]
    k = k.repeat_interleave(heads // kv_heads, dim=2)
    v = v.repeat_interleave(heads // kv_heads, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * softmax_scale
    q_len, kv_len = q.shape[1], k.shape[1]
    if causal:
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
'''

# Every built-in kernel off, so that the only change to the model is the one under test.
TORCH_ELSEWHERE = {name: "torch" for name in ("SwiGLUMLP", "SiLU", "rotary_pos_emb", "ForCausalLMLoss", "AddRMSNorm",
                                               "LinearForCausalLMLoss", "SparseMoeBlock")}


def write_kernel(root: Path, package: str, source: str) -> Path:
    """`root` laid out as the kernels package reads a kernel: build/torch-universal/<package>/ and metadata.json."""
    variant = root / "build" / "torch-universal"
    (variant / package).mkdir(parents=True)
    (variant / package / "__init__.py").write_text("from . import layers\nfrom .layers import *\n")
    (variant / package / "layers.py").write_text(source)
    (variant / "metadata.json").write_text(json.dumps({"id": package, "name": package.replace("_", "-"), "version": 1,
                                                       "license": "Apache-2.0", "python-depends": [],
                                                       "backend": {"type": "universal"}}))
    return root


def write_cached_repo(cache: Path, repo_id: str, package: str, source: str) -> None:
    """A kernel repo as the Hub cache holds it: kernels--org--repo/snapshots/<commit>/build/..., refs/v1."""
    folder = cache / ("kernels--" + repo_id.replace("/", "--"))
    write_kernel(folder / "snapshots" / COMMIT, package, source)
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "v1").write_text(COMMIT)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    make_checkpoint(folder, "llama")
    return folder


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE=1 with the Hugging Face cache in tmp_path (huggingface_hub reads both at import: its
    constants are set too)."""
    import huggingface_hub.constants as constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("KERNELS_CACHE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _kernel_calls(model):
    return sys.modules[model.model.norm.forward.__func__.__module__].CALLS


def test_a_local_kernel_replaces_the_layer_in_each_mode(llama_dir, tmp_path):
    kernel = write_kernel(tmp_path / "my_rms_norm", "my_rms_norm", LAYERS)
    config = KernelConfig({"RMSNorm": {"inference": f"{kernel}:MyRMSNorm", "training": f"{kernel}:MyRMSNormTraining"},
                           **TORCH_ELSEWHERE}, use_local_kernel=True)  # "torch" still names the torch forward
    plain = AutoModelForCausalLM.from_pretrained(llama_dir)
    model = AutoModelForCausalLM.from_pretrained(llama_dir, use_kernels=True, kernel_config=config)
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])

    assert model.model.norm.forward.__func__.__qualname__ == "MyRMSNorm.forward"
    calls = _kernel_calls(model)
    want = _logits(plain, ids)
    torch.testing.assert_close(_logits(model, ids), want, atol=1e-5, rtol=0)
    # 2 layers x 2 norms + the final norm
    assert calls == {"inference": 5, "training": 0}

    model.train()
    assert model.model.norm.forward.__func__.__qualname__ == "MyRMSNormTraining.forward"
    loss = model(ids, labels=ids).loss
    loss.backward()  # the kernel's forward is torch: gradients flow
    assert calls["training"] == 5 and model.model.norm.weight.grad is not None
    model.eval()
    torch.testing.assert_close(_logits(model, ids), want, atol=1e-5, rtol=0)
    assert calls["inference"] == 10


def test_a_hub_repo_resolves_from_the_cache_offline(llama_dir, offline_cache):
    write_cached_repo(offline_cache, "kernels-community/tiny-rms-norm", "tiny_rms_norm", LAYERS)
    write_cached_repo(offline_cache, "someone/rms-norm", "someone_rms_norm", LAYERS)
    plain = AutoModelForCausalLM.from_pretrained(llama_dir)
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    for kernel in ("kernels-community/tiny-rms-norm:MyRMSNorm",
                   ("someone/rms-norm:MyRMSNorm", {"version": 1, "trust_remote_code": True}),
                   {"cuda": "kernels-community/tiny-rms-norm@" + COMMIT + ":MyRMSNorm", "rocm": "other/repo:X"}):
        config = KernelConfig({"RMSNorm": kernel, **TORCH_ELSEWHERE})
        model = AutoModelForCausalLM.from_pretrained(llama_dir, use_kernels=True, kernel_config=config)
        assert model.model.norm.forward.__func__.__qualname__ == "MyRMSNorm.forward", kernel
        assert str(offline_cache) in sys.modules[model.model.norm.forward.__func__.__module__].__file__
        torch.testing.assert_close(_logits(model, ids), _logits(plain, ids), atol=1e-5, rtol=0)


def test_offline_a_kernel_not_in_the_cache_names_the_repo_and_how_to_fetch_it(llama_dir, offline_cache):
    config = KernelConfig({"RMSNorm": "kernels-community/not-downloaded:LigerRMSNorm", **TORCH_ELSEWHERE})
    with pytest.raises(FileNotFoundError, match=r"kernel repo 'kernels-community/not-downloaded' \(version 1\) is not in "
                                                r".*HF_HUB_OFFLINE=1.*get_kernel\('kernels-community/not-downloaded'"):
        AutoModelForCausalLM.from_pretrained(llama_dir, use_kernels=True, kernel_config=config)


def test_repos_outside_kernels_community_need_explicit_trust(llama_dir, offline_cache):
    write_cached_repo(offline_cache, "someone/rms-norm", "someone_rms_norm2", LAYERS)
    config = KernelConfig({"RMSNorm": "someone/rms-norm:MyRMSNorm", **TORCH_ELSEWHERE})
    with pytest.raises(ValueError, match="'someone/rms-norm' is outside 'kernels-community'.*trust_remote_code"):
        AutoModelForCausalLM.from_pretrained(llama_dir, use_kernels=True, kernel_config=config)
    with pytest.raises(ValueError, match="'someone/rms-norm' is outside 'kernels-community'.*allow_all_kernels=True"):
        AutoModelForCausalLM.from_pretrained(llama_dir, attn_implementation="someone/rms-norm")


def test_mapping_errors_name_the_fix(llama_dir, tmp_path):
    with pytest.raises(ValueError, match="names no layer: write 'org/repo:Layer'"):
        KernelConfig({"RMSNorm": "kernels-community/liger-kernels"})
    with pytest.raises(ValueError, match="not a Hub repo id 'org/repo' \\(a local folder needs use_local_kernel=True\\)"):
        KernelConfig({"RMSNorm": "/some/folder/kernel:Layer"})
    with pytest.raises(NotImplementedError, match="rotary_pos_emb is a function layer"):
        KernelConfig({"rotary_pos_emb": "kernels-community/rotary:Rotary"})
    kernel = write_kernel(tmp_path / "k", "k_pkg", LAYERS)
    with pytest.raises(ValueError, match="has no layer class 'Missing' in its layers module; it has: MyRMSNorm"):
        AutoModelForCausalLM.from_pretrained(llama_dir, use_kernels=True,
                                             kernel_config=KernelConfig({"RMSNorm": f"{kernel}:Missing"},
                                                                        use_local_kernel=True))
    with pytest.raises(ValueError, match="maps Mamba2Mixer to a Hub kernel, but this model has no such layer"):
        AutoModelForCausalLM.from_pretrained(llama_dir, use_kernels=True,
                                             kernel_config=KernelConfig({"Mamba2Mixer": f"{kernel}:MyRMSNorm"},
                                                                        use_local_kernel=True))


def test_attn_implementation_names_a_hub_attention_kernel(llama_dir, offline_cache):
    write_cached_repo(offline_cache, "kernels-community/tiny-flash-attn", "tiny_flash_attn", ATTENTION)
    plain = AutoModelForCausalLM.from_pretrained(llama_dir)
    model = AutoModelForCausalLM.from_pretrained(llama_dir, attn_implementation="kernels-community/tiny-flash-attn")
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2]])
    torch.testing.assert_close(_logits(model, ids), _logits(plain, ids), atol=1e-5, rtol=0)
    kernel_module = next(m for name, m in sys.modules.items() if name.startswith("tiny_flash_attn")
                         and hasattr(m, "CALLS"))
    calls = kernel_module.CALLS
    # one call per layer: (batch, seq, heads, head_dim) query, 2 kv heads, causal, no window
    assert calls == [((1, 7, 4, 16), (1, 7, 2, 16), True, (-1, -1))] * 2
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, plain.generate(ids, max_new_tokens=4, do_sample=False))


def test_allow_all_kernels_trusts_an_attention_kernel_outside_kernels_community(llama_dir, offline_cache):
    write_cached_repo(offline_cache, "someone/flash-attn", "someone_flash_attn", ATTENTION)
    plain = AutoModelForCausalLM.from_pretrained(llama_dir)
    model = AutoModelForCausalLM.from_pretrained(llama_dir, attn_implementation="someone/flash-attn",
                                                 allow_all_kernels=True)
    ids = torch.tensor([[2, 7, 1, 8, 2, 8]])
    torch.testing.assert_close(_logits(model, ids), _logits(plain, ids), atol=1e-5, rtol=0)
    assert model.attn_implementation == "someone/flash-attn"
