"""Checkpoint loading and saving: safetensors read/write, sharding, meta-device materialisation, errors, memory."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, safe_open, save_file
from torch import nn

from gpuformers.loading import save as save_module
from gpuformers.loading import weights as weights_module
from gpuformers.loading.safetensors import SafetensorsError, SafetensorsFile, write_file
from gpuformers.loading.save import save_checkpoint
from gpuformers.loading.weights import CheckpointFiles, assign_tensor, load_weights

TIE = {"lm_head.weight": "model.embed_tokens.weight"}


# --- a tiny model with Hugging Face names ------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.q_proj = nn.Linear(h, h, bias=True)
        self.o_proj = nn.Linear(h, h, bias=False)


class Layer(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.self_attn = Attention(h)
        self.input_layernorm = nn.LayerNorm(h, bias=False)


class Body(nn.Module):
    def __init__(self, vocab, h, layers):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, h)
        self.layers = nn.ModuleList(Layer(h) for _ in range(layers))
        self.norm = nn.LayerNorm(h, bias=False)
        self.register_buffer("step", torch.zeros(3, dtype=torch.int64))  # persistent, integer
        self.register_buffer("inv_freq", torch.ones(4), persistent=False)  # computed by the caller


class TinyLM(nn.Module):
    def __init__(self, vocab=32, h=8, layers=2, tie_by_object=False):
        super().__init__()
        self.model = Body(vocab, h, layers)
        self.lm_head = nn.Linear(h, vocab, bias=False)
        if tie_by_object:
            self.lm_head.weight = self.model.embed_tokens.weight


def reference_state(seed=0, **kw) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = TinyLM(**kw)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for k, v in state.items():
        if v.is_floating_point():
            v.normal_()
        else:
            v.copy_(torch.arange(v.numel()).reshape(v.shape) + 7)
    return state


def meta_model(**kw) -> TinyLM:
    with torch.device("meta"):
        return TinyLM(**kw)


def write_hf(folder: Path, state: dict) -> Path:
    """A single model.safetensors written by the safetensors library."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def load(folder, model=None, **kw):
    model = model or meta_model()
    kw.setdefault("dtype", torch.float32)
    kw.setdefault("device", "cpu")
    info = load_weights(model, CheckpointFiles.find(folder), progress=False, **kw)
    return model, info


def assert_matches(model: nn.Module, state: dict, dtype=torch.float32):
    got = model.state_dict()
    for name, want in state.items():
        if name in got:
            expected = want.to(dtype) if want.is_floating_point() else want
            assert got[name].dtype == expected.dtype, name
            assert torch.equal(got[name], expected), name


# --- loading ---------------------------------------------------------------------------------------------


def test_single_file_load_materialises_every_tensor(tmp_path):
    state = reference_state()
    model, info = load(write_hf(tmp_path, state))
    assert_matches(model, state)
    assert info.missing == [] and info.unexpected == []
    assert info.num_loaded == len(state)
    w = model.model.layers[1].self_attn.q_proj.weight
    assert type(w) is nn.Parameter and w.requires_grad and w.device.type == "cpu"
    assert model.model.step.dtype == torch.int64 and not isinstance(model.model.step, nn.Parameter)
    assert model.model.inv_freq.is_meta  # non-persistent buffers are left to the caller


def test_sharded_load_of_our_writer(tmp_path):
    state = reference_state()
    written = save_checkpoint(state, tmp_path, config={"model_type": "tiny"}, max_shard_size=600)
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(state)
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    assert all(p in written for p in shards)
    assert all(p.stat().st_size <= 600 + 1024 or len(safe_open(p, "pt").keys()) == 1 for p in shards)
    model, info = load(tmp_path)
    assert_matches(model, state)
    assert info.unexpected == []


@pytest.mark.parametrize("stored, wanted", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                            (torch.float16, torch.float16)])
def test_dtype_conversion(tmp_path, stored, wanted, monkeypatch):
    monkeypatch.setattr(weights_module, "CHUNK_BYTES", 64)  # several chunks per tensor: the chunk loop is exercised
    state = {k: (v.to(stored) if v.is_floating_point() else v) for k, v in reference_state().items()}
    model, _ = load(write_hf(tmp_path, state), dtype=wanted)
    assert_matches(model, state, dtype=wanted)
    assert model.model.embed_tokens.weight.dtype == wanted
    assert model.model.step.dtype == torch.int64  # integers keep the model's dtype


def test_tied_target_shares_the_source_and_ignores_its_copy(tmp_path):
    state = reference_state()  # holds a different lm_head.weight: it must not win over the embeddings
    model, info = load(write_hf(tmp_path, state), tied=TIE)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"])
    assert "lm_head.weight" not in info.unexpected and info.missing == []


def test_tied_checkpoint_without_the_target(tmp_path):
    state = reference_state()
    del state["lm_head.weight"]
    model, info = load(write_hf(tmp_path, state), model=meta_model(tie_by_object=True))
    # tied on the meta device by object: both names still point at one Parameter after the load
    assert model.lm_head.weight is model.model.embed_tokens.weight
    head, embed = model.lm_head.weight, model.model.embed_tokens.weight
    assert head.untyped_storage().data_ptr() == embed.untyped_storage().data_ptr()
    assert info.missing == []


def test_pytorch_model_bin_single_and_indexed(tmp_path):
    state = reference_state()
    torch.save(state, tmp_path / "pytorch_model.bin")
    files = CheckpointFiles.find(tmp_path)
    assert files.format == "bin"
    model, _ = load(tmp_path, dtype=torch.bfloat16)
    assert_matches(model, state, dtype=torch.bfloat16)

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    names = list(state)
    halves = {"pytorch_model-00001-of-00002.bin": names[:4], "pytorch_model-00002-of-00002.bin": names[4:]}
    for file, keys in halves.items():
        torch.save({k: state[k] for k in keys}, sharded / file)
    weight_map = {k: file for file, keys in halves.items() for k in keys}
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model, _ = load(sharded)
    assert_matches(model, state)


def test_safetensors_preferred_and_keys_and_auto_dtype(tmp_path):
    state = {k: (v.half() if v.is_floating_point() else v) for k, v in reference_state().items()}
    write_hf(tmp_path, state)
    torch.save({}, tmp_path / "pytorch_model.bin")
    files = CheckpointFiles.find(tmp_path)
    assert files.format == "safetensors"
    assert set(files.keys()) == set(state)
    assert files.first_floating_dtype() == torch.float16


def test_unexpected_keys_are_reported_not_fatal(tmp_path):
    state = reference_state()
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    _, info = load(write_hf(tmp_path, state))
    assert info.unexpected == ["model.layers.0.self_attn.rotary_emb.inv_freq"]
    assert info.to_dict()["unexpected_keys"] == info.unexpected


def test_shard_fn_loads_slices(tmp_path):
    state = reference_state()
    write_hf(tmp_path, state)
    model = meta_model()
    with torch.device("meta"):  # a "rank" holding rows 8..16 of the embeddings and columns 2..6 of o_proj
        model.model.embed_tokens.weight = nn.Parameter(torch.empty(8, 8))
        model.model.layers[0].self_attn.o_proj.weight = nn.Parameter(torch.empty(8, 4))

    def shard_fn(name, full_shape):
        if name == "model.embed_tokens.weight":
            return (slice(8, 16),)
        if name == "model.layers.0.self_attn.o_proj.weight":
            return (slice(None), slice(2, 6))
        return None

    load(tmp_path, model=model, shard_fn=shard_fn)
    assert torch.equal(model.model.embed_tokens.weight, state["model.embed_tokens.weight"][8:16])
    o_proj = state["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(model.model.layers[0].self_attn.o_proj.weight, o_proj[:, 2:6])
    assert torch.equal(model.lm_head.weight, state["lm_head.weight"])


class HookedLinear(nn.Module):
    """Stands for a quantized Linear: stores int8 weights and a scale, whatever the checkpoint holds."""

    def __init__(self):
        super().__init__()
        self.register_buffer("qweight", torch.empty(8, 8, dtype=torch.int8))
        self.register_buffer("scale", torch.empty(()))
        self.received = {}

    def load_from_checkpoint(self, name, tensor):
        self.received[name] = tensor
        if name == "weight":
            scale = tensor.abs().max() / 127
            self.qweight = (tensor / scale).round().to(torch.int8)
            self.scale = scale


def test_module_hook_receives_its_tensors(tmp_path):
    state = reference_state()
    state["model.layers.0.self_attn.q_proj.weight_scale"] = torch.ones(())
    write_hf(tmp_path, state)
    model = meta_model()
    with torch.device("meta"):
        model.model.layers[0].self_attn.q_proj = HookedLinear()
    _, info = load(tmp_path, model=model)
    hooked = model.model.layers[0].self_attn.q_proj
    assert set(hooked.received) == {"weight", "bias", "weight_scale"}
    assert torch.equal(hooked.received["weight"], state["model.layers.0.self_attn.q_proj.weight"])
    assert hooked.qweight.dtype == torch.int8 and not hooked.qweight.is_meta
    assert info.unexpected == [] and info.missing == []

    # a hooked module that leaves a tensor unfilled is reported as missing
    model = meta_model()
    with torch.device("meta"):
        model.model.layers[0].self_attn.q_proj = HookedLinear()
    del state["model.layers.0.self_attn.q_proj.weight"]
    write_hf(tmp_path, state)
    with pytest.raises(ValueError, match=r"q_proj\.qweight"):
        load(tmp_path, model=model)


def test_assign_tensor_keeps_parameters():
    model = meta_model()
    assign_tensor(model, "model.norm.weight", torch.ones(8))
    assert type(model.model.norm.weight) is nn.Parameter and model.model.norm.weight.requires_grad
    with pytest.raises(ValueError, match=r"\[8\].*\[9\]"):
        assign_tensor(model, "model.norm.weight", torch.ones(9))


# --- errors ----------------------------------------------------------------------------------------------


def test_error_no_weights_lists_the_folder(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.gguf").write_text("")
    with pytest.raises(FileNotFoundError, match=r"no model weights .*config\.json, model\.gguf"):
        CheckpointFiles.find(tmp_path)


def test_error_missing_shard_and_bad_index(tmp_path):
    save_checkpoint(reference_state(), tmp_path, config={}, max_shard_size=600)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=rf"shard '{shard.name}' named in .*index\.json is missing"):
        CheckpointFiles.find(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a": ')
    with pytest.raises(ValueError, match=r"index\.json is not valid JSON"):
        CheckpointFiles.find(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match=r"malformed: it needs a 'weight_map'"):
        CheckpointFiles.find(tmp_path)


def test_error_shape_mismatch_names_both_shapes(tmp_path):
    state = reference_state()
    state["model.norm.weight"] = torch.ones(9)
    message = r"'model\.norm\.weight' in model\.safetensors has shape \[9\], .* has shape \[8\]"
    with pytest.raises(ValueError, match=message):
        load(write_hf(tmp_path, state))


def test_error_missing_keys_listed_and_ignore_missing(tmp_path):
    state = reference_state(layers=2)
    write_hf(tmp_path, state)
    with pytest.raises(ValueError, match=r"lacks 16 tensor\(s\).*layers\.2\.self_attn.*and 6 more"):
        load(tmp_path, model=meta_model(layers=6))  # 4 layers x 4 tensors absent; 10 named
    model, info = load(tmp_path, model=meta_model(layers=6), ignore_missing=[r"layers\.[2-5]\."])
    assert len(info.missing) == 16 and all(n.split(".")[2] in "2345" for n in info.missing)
    assert torch.count_nonzero(model.model.layers[5].self_attn.q_proj.weight) == 0  # zeros, for the caller to init


def _corrupt(tmp_path: Path, how: str) -> Path:
    path = write_hf(tmp_path, reference_state()) / "model.safetensors"
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    if how == "header_len":
        raw = struct.pack("<Q", len(raw) * 2) + raw[8:]
    elif how == "truncated":
        raw = raw[: len(raw) - 40]
    elif how == "json":
        raw = raw[:8] + b"{not json" + raw[8 + 9 :]
    elif how == "dtype":
        header = raw[8 : 8 + header_len].replace(b'"F32"', b'"F7X"', 1)
        raw = raw[:8] + header + raw[8 + header_len :]
    path.write_bytes(raw)
    return path


@pytest.mark.parametrize("how, message", [
    ("header_len", r"model\.safetensors is truncated or corrupt: its header length \d+ is beyond the file size"),
    ("truncated", r"model\.safetensors is truncated: tensor '.*' ends at data byte \d+ but the file holds only"),
    ("json", r"model\.safetensors is corrupt: its header is not valid JSON"),
    ("dtype", r"has dtype 'F7X', which is not one of: .*BF16"),
])
def test_error_corrupt_safetensors(tmp_path, how, message):
    _corrupt(tmp_path, how)
    with pytest.raises(SafetensorsError, match=message):
        load(tmp_path)


def test_error_cuda_without_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match=r"'cuda' was asked for, but torch sees no CUDA GPU"):
        load(write_hf(tmp_path, reference_state()), device="cuda")


# --- saving ----------------------------------------------------------------------------------------------


def test_save_round_trip_with_safetensors_library(tmp_path):
    torch.manual_seed(0)
    model = TinyLM(tie_by_object=True)
    config, generation = {"model_type": "tiny", "b": 1}, {"eos_token_id": 2}
    written = save_checkpoint(model, tmp_path, config=config, generation_config=generation, tied=TIE)
    loaded = load_file(tmp_path / "model.safetensors")
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert set(loaded) == set(expected)
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert json.loads((tmp_path / "config.json").read_text()) == {"model_type": "tiny", "b": 1}
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {"eos_token_id": 2}
    assert {p.name for p in written} == {"model.safetensors", "config.json", "generation_config.json"}
    assert not list(tmp_path.glob(".*"))  # no temporary files left


def test_save_drops_untold_aliases_with_a_warning(tmp_path):
    model = TinyLM(tie_by_object=True)
    with pytest.warns(UserWarning, match=r"not saving lm_head\.weight \(= model\.embed_tokens\.weight\)"):
        save_checkpoint(model, tmp_path, config={})
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")


def test_resave_replaces_stale_shards_and_a_crash_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    state = reference_state()
    save_checkpoint(state, tmp_path, config={}, max_shard_size=600)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    save_checkpoint(state, tmp_path, config={})  # now a single file: the shards and index go
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]

    new_state = reference_state(seed=1)
    calls = []

    def failing_write(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            Path(path).write_bytes(b"half a file")
            raise OSError("disk full")
        return write_file(tensors, path, metadata)

    monkeypatch.setattr(save_module, "write_file", failing_write)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(new_state, tmp_path, config={}, max_shard_size=600)
    monkeypatch.undo()
    assert not list(tmp_path.glob("model-*"))  # no half or new shard under a real name
    model, _ = load(tmp_path)
    assert_matches(model, state)  # the old checkpoint, intact
    save_checkpoint(new_state, tmp_path, config={}, max_shard_size=600)
    assert not list(tmp_path.glob(".*.tmp")) and not (tmp_path / "model.safetensors").exists()
    model, _ = load(tmp_path)
    assert_matches(model, new_state)


def test_writer_streams_gpu_style_tensors_and_rejects_meta(tmp_path):
    t = torch.randn(4, 6)[:, ::2]  # not contiguous
    write_file({"x": t, "y": torch.tensor(3, dtype=torch.int8)}, tmp_path / "a.safetensors")
    with SafetensorsFile(tmp_path / "a.safetensors") as f:
        assert torch.equal(f.read("x"), t) and f.read("y").item() == 3
    with pytest.raises(ValueError, match=r"'z'.*meta device"):
        write_file({"z": torch.empty(2, device="meta")}, tmp_path / "b.safetensors")


# --- memory --------------------------------------------------------------------------------------------------


def test_no_staging_for_same_dtype_and_one_chunk_otherwise(tmp_path, monkeypatch):
    write_hf(tmp_path, reference_state())
    sizes = []
    real_get = weights_module.StagingBuffer.get

    def spy(self, nbytes):
        sizes.append(nbytes)
        return real_get(self, nbytes)

    monkeypatch.setattr(weights_module.StagingBuffer, "get", spy)
    load(tmp_path, dtype=torch.float32)
    assert sizes == []  # float32 -> float32 on the CPU: read straight into the parameters
    monkeypatch.setattr(weights_module, "CHUNK_BYTES", 256)
    load(tmp_path, dtype=torch.bfloat16)
    assert sizes and max(sizes) <= 256


# VmHWM (peak RSS), not ru_maxrss: ru_maxrss survives exec, so a child would inherit pytest's peak.
_RSS_SCRIPT = textwrap.dedent("""
    import sys, torch
    from torch import nn
    from gpuformers.loading.weights import CheckpointFiles, load_weights
    def status(field):
        line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
        return int(line.split()[1]) * 1024
    n, numel = int(sys.argv[2]), int(sys.argv[3])
    with torch.device("meta"):
        model = nn.Module()
        for i in range(n):
            model.register_parameter(f"w{i}", nn.Parameter(torch.empty(numel)))
    before = status("VmRSS")
    load_weights(model, CheckpointFiles.find(sys.argv[1]), dtype=torch.float32, device="cpu", progress=False)
    assert float(model.w3[5]) == 3.0
    # CPU loads may map the file (pages come in on first touch): touch every weight before measuring.
    assert sum(float(p.sum()) for p in model.parameters()) == sum(i * numel for i in range(n))
    print(status("VmHWM") - before)
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads peak RSS from Linux /proc")
def test_peak_memory_of_a_load_is_about_the_model_size(tmp_path):
    n, numel = 25, 2_000_000  # 25 x 8 MB = 200 MB of float32
    state = {f"w{i}": torch.full((numel,), float(i)) for i in range(n)}
    write_file(state, tmp_path / "model.safetensors")
    del state
    size = n * numel * 4
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(tmp_path), str(n), str(numel)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    growth = int(out.stdout.strip())
    assert size * 0.9 < growth < size * 1.3, f"peak RSS grew {growth / 1e6:.0f} MB for a {size / 1e6:.0f} MB checkpoint"


# --- against transformers --------------------------------------------------------------------------------


def test_transformers_loads_what_we_save_and_we_load_what_it_saves(tmp_path):
    import transformers

    from tests.fixtures.checkpoints import make_checkpoint

    hf_dir, ours_dir = tmp_path / "hf", tmp_path / "ours"
    hf = make_checkpoint(hf_dir, "qwen3", tie_word_embeddings=True, max_shard_size="50KB")
    # Our loader fills a transformers model built on the meta device (the names are the checkpoint's).
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(hf.config)
    info = load_weights(skeleton, CheckpointFiles.find(hf_dir), dtype=torch.float32, device="cpu", tied=TIE,
                        progress=False)
    assert info.missing == [] and info.unexpected == []
    want = hf.state_dict()
    assert all(torch.equal(skeleton.state_dict()[k], want[k]) for k in want)

    save_checkpoint(hf, ours_dir, config=hf.config.to_dict(), tied=TIE, max_shard_size="40KB")
    assert len(list(ours_dir.glob("model-*.safetensors"))) > 1
    back = transformers.AutoModelForCausalLM.from_pretrained(ours_dir, dtype=torch.float32)
    assert all(torch.equal(back.state_dict()[k], want[k]) for k in want)


def test_transformers_loads_our_save_pretrained(tmp_path):
    import transformers

    from gpuformers import AutoModelForCausalLM
    from tests.fixtures.checkpoints import make_checkpoint

    hf = make_checkpoint(tmp_path / "hf", "llama", tie_word_embeddings=False)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, progress=False)
    ours.save_pretrained(tmp_path / "ours", max_shard_size="100KB")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32)
    want = hf.state_dict()
    assert set(back.state_dict()) == set(want)
    assert all(torch.equal(back.state_dict()[k], want[k]) for k in want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_load_to_cuda(tmp_path):
    state = reference_state()
    write_hf(tmp_path, state)
    for dtype in (torch.float32, torch.bfloat16):
        model, _ = load(tmp_path, dtype=dtype, device="cuda", tied=TIE)
        assert model.model.embed_tokens.weight.device.type == "cuda"
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert_matches(model.cpu(), {k: v for k, v in state.items() if k != "lm_head.weight"}, dtype=dtype)
