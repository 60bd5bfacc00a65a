"""Pre-quantized mixture-of-experts checkpoints (tiny Qwen3-MoE with 4 experts, Mixtral with 8): fine-grained FP8,
GPTQ, AWQ and compressed-tensors (pack-quantized w4a16, float-quantized FP8) with per-expert keys, a router the
checkpoint quantizes too, transformers' fused FP8 layout, the fused MoE kernel with quantized experts, and what is
refused.

The checkpoints are written here from transformers' per-expert save of a random model: FP8 and GPTQ / AWQ by
independent packers (test_gptq_awq.py's for GPTQ / AWQ), compressed-tensors by the compressed-tensors package on a
module tree of the checkpoint's Linears (as llm-compressor saw them, the router a Linear). The reference is
transformers 5.24 loading the same folder where it can (FP8 with FineGrainedFP8Config(dequantize=True),
compressed-tensors with CompressedTensorsConfig(dequantize=True)); where it cannot (GPTQ / AWQ need optimum or
gptqmodel; a compressed-tensors router stored quantized makes its loader raise; its CPU load of fused FP8 experts
leaves their scales unused) the reference is transformers' model loaded from a float checkpoint of the weights the
writer dequantized itself.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.fixtures.checkpoints import hf_config
from tests.models.parity import count_fused_moe_calls

# The Triton interpreter has to be on before triton is first imported (as in test_fp8.py); if an earlier test module
# imported triton without it, the kernel test skips.
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

IDS = torch.tensor([[1, 5, 9, 23, 42, 7, 64, 100]])
FAMILIES = {  # hidden 64, experts of 32 rows: FP8 blocks of 16 x 16 divide every projection
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=32, mlp_only_layers=[1]),  # layer 1 dense
    "mixtral": dict(num_local_experts=8, intermediate_size=32),  # 8 rows: a router GPTQ can pack
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48),  # q/k/v biases
}
# The routers, and Qwen2-MoE's one-row shared-expert gate, which quantizers leave unquantized too
ROUTER = re.compile(r".*\.((mlp|block_sparse_moe)\.gate|shared_expert_gate)\.weight$")
IGNORE_ROUTER = ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$", "re:.*shared_expert_gate$"]
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


# --- writers ----------------------------------------------------------------------------------------------------


def _float_checkpoint(root: Path, model_type: str):
    """transformers' per-expert save of a tiny random model (routers spread so that tokens pick different experts):
    (folder, its tensors)."""
    import transformers
    from safetensors.torch import load_file

    torch.manual_seed(0)
    config = hf_config(model_type, num_experts_per_tok=2, tie_word_embeddings=False, **FAMILIES[model_type])
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 0.5)
    folder = root / f"{model_type}-float"
    model.save_pretrained(folder)
    return folder, load_file(str(folder / "model.safetensors"))


def _quantized(state: dict, router: bool) -> list[str]:
    """The Linear weights a quantizer converts: all but the LM head's, and the routers' only when `router`."""
    return [name for name, value in state.items() if value.dim() == 2 and name.endswith(".weight")
            and "embed_tokens" not in name and name != "lm_head.weight" and (router or not ROUTER.match(name))]


def _write(source: Path, folder: Path, tensors: dict, quantization_config: dict | None) -> Path:
    from safetensors.torch import save_file

    folder.mkdir()
    for path in source.iterdir():
        if path.suffix == ".json":
            shutil.copy(path, folder / path.name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def _fp8_quantize(weight: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight (out, in) -> float8 weight, float32 scales per block (partial blocks too), the dequantized weight."""
    rows, cols = weight.shape
    bm, bn = block
    scales = torch.empty(math.ceil(rows / bm), math.ceil(cols / bn))
    quantized = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    reference = torch.empty(rows, cols)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            at = slice(i * bm, (i + 1) * bm), slice(j * bn, (j + 1) * bn)
            scales[i, j] = weight[at].abs().amax().clamp(min=1e-12) / FP8_MAX
            quantized[at] = (weight[at] / scales[i, j]).clamp(-FP8_MAX, FP8_MAX)
            reference[at] = quantized[at].float() * scales[i, j]
    return quantized, scales, reference


def write_fp8(source: Path, state: dict, folder: Path, router: bool = False, block=(16, 16), **config):
    """Fine-grained FP8 with per-expert keys (Qwen/Qwen3-30B-A3B-FP8's layout): (folder, dequantized tensors)."""
    tensors, reference = dict(state), dict(state)
    for name in _quantized(state, router):
        tensors[name], tensors[f"{name}_scale_inv"], reference[name] = _fp8_quantize(state[name], list(block))
    return _write(source, folder, tensors, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                            "weight_block_size": list(block), **config}), reference


def write_gptq_awq(source: Path, state: dict, folder: Path, method: str, router: bool = False):
    """4-bit GPTQ (v1, symmetric) or AWQ (gemm, zero points), groups of 16: (folder, dequantized tensors)."""
    from tests.quantization.test_gptq_awq import _pack_awq, _pack_gptq
    from tests.quantization.test_gptq_awq import _quantize as quantize_groups

    tensors, reference = dict(state), dict(state)
    for index, name in enumerate(_quantized(state, router)):
        module = name.removesuffix(".weight")
        q, zeros, scales, g_idx, reference[name] = quantize_groups(state[name], 4, 16, method == "gptq", False, index)
        if method == "gptq":
            qweight, qzeros = _pack_gptq(q, zeros, 4, "gptq")
            tensors[f"{module}.g_idx"] = g_idx
        else:
            qweight, qzeros = _pack_awq(q, zeros)
        del tensors[name]
        tensors.update({f"{module}.qweight": qweight, f"{module}.qzeros": qzeros, f"{module}.scales": scales})
    config = ({"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": False, "sym": True,
               "checkpoint_format": "gptq"} if method == "gptq" else
              {"quant_method": "awq", "bits": 4, "group_size": 16, "zero_point": True, "version": "gemm"})
    return _write(source, folder, tensors, config), reference


def _linear_tree(state: dict, router: bool) -> nn.Module:
    """The checkpoint's tensors as modules: an nn.Linear for each Linear weight (the routers too when `router`: the
    quantizer's model had them as Linears), plain parameters for the rest."""
    root = nn.Module()
    linears = set(_quantized(state, router=True)) | {"lm_head.weight"}
    for name, value in state.items():
        *path, leaf = name.split(".")
        parent = root
        for part in path[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        module = name.rpartition(".")[0]
        if name in linears:
            bias = state.get(f"{module}.bias")
            linear = nn.Linear(value.shape[1], value.shape[0], bias=bias is not None)
            linear.weight.data = value.clone()
            if bias is not None:
                linear.bias.data = bias.clone()
            parent.add_module(path[-1], linear)
        elif f"{module}.weight" not in linears:  # a Linear's bias goes with its weight
            if not hasattr(parent, path[-1]):
                parent.add_module(path[-1], nn.Module())
            getattr(parent, path[-1]).register_parameter(leaf, nn.Parameter(value.clone(), requires_grad=False))
    return root


def write_compressed(source: Path, state: dict, folder: Path, weights, ignore: list[str]) -> tuple[Path, dict]:
    """Compressed by the compressed-tensors package (llm-compressor's save): (folder, dequantized tensors)."""
    from tests.quantization.test_compressed_tensors import compress_in_place

    tree = _linear_tree(state, router=True)
    compressor = compress_in_place(tree, weights, ignore)
    tensors = {name: value.detach() for name, value in tree.state_dict().items()}
    compressor.decompress_model(tree)  # the package's own dequantization: the reference weights
    reference = {name: value.detach().float() for name, value in tree.state_dict().items()}
    _write(source, folder, tensors, None)
    compressor.update_config(folder)
    return folder, reference


def write_fused_fp8(per_expert: Path, folder: Path, model_type: str, requantize: dict | None = None) -> Path:
    """transformers' fused FP8 experts (FP8Experts' parameters, as its save_pretrained(save_original_format=False)
    names them; Mixtral's router as mlp.gate) from a per-expert FP8 checkpoint: its FP8 values and scales, stacked.
    `requantize`: the float tensors to quantize the fused experts afresh from, in the checkpoint's blocks, which
    then run across the gate and up rows."""
    from safetensors.torch import load_file

    state = load_file(str(per_expert / "model.safetensors"))
    config = json.loads((per_expert / "config.json").read_text())["quantization_config"]
    gate, up, down = ("w1", "w3", "w2") if model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    moe = "block_sparse_moe" if model_type == "mixtral" else "mlp"
    tensors = {name.replace("block_sparse_moe.gate.", "mlp.gate."): value for name, value in state.items()
               if ".experts." not in name}
    layers = {int(m.group(1)) for k in state if (m := re.match(rf"model\.layers\.(\d+)\.{moe}\.experts", k))}
    for layer in sorted(layers):
        experts = f"model.layers.{layer}.{moe}.experts"
        count = len({k.split(".")[5] for k in state if k.startswith(experts + ".")})
        for fused, projections in (("gate_up_proj", (gate, up)), ("down_proj", (down,))):
            fused = f"model.layers.{layer}.mlp.experts.{fused}"
            if requantize is None:
                for suffix, fused_suffix in (("weight", ""), ("weight_scale_inv", "_scale_inv")):
                    tensors[fused + fused_suffix] = torch.stack([torch.cat(
                        [state[f"{experts}.{e}.{p}.{suffix}"] for p in projections]) for e in range(count)])
            else:
                parts = [_fp8_quantize(torch.cat([requantize[f"{experts}.{e}.{p}.weight"] for p in projections]),
                                       config["weight_block_size"]) for e in range(count)]
                tensors[fused] = torch.stack([part[0] for part in parts])
                tensors[f"{fused}_scale_inv"] = torch.stack([part[1] for part in parts])
    return _write(per_expert, folder, tensors, config)


# --- fixtures and helpers ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def floats(tmp_path_factory):
    """model_type -> (float folder, its tensors)."""
    root = tmp_path_factory.mktemp("moe-quant")
    return {model_type: _float_checkpoint(root, model_type) for model_type in FAMILIES}


def _ours(folder, **kwargs):
    from gpuformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=kwargs.pop("dtype", torch.float32), progress=False,
                                                **kwargs)


def _reference(source: Path, reference: dict, folder: Path):
    """transformers' model on the writer's dequantized weights (a float checkpoint of them)."""
    import transformers

    _write(source, folder, reference, None)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _assert_parity(ours, theirs) -> float:
    """Logits within 1e-4 (float32) and the same 8 greedy tokens; returns the largest logit difference."""
    with torch.no_grad():
        difference = (ours(IDS).logits - theirs(IDS).logits).abs().max().item()
    assert difference < 1e-4
    greedy = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(ours.generate(IDS, **greedy), theirs.generate(IDS, **greedy))
    return difference


def _moe(model, layer: int = 0):
    block = model.model.layers[layer]
    return block.block_sparse_moe if hasattr(block, "block_sparse_moe") else block.mlp


def _expert_kinds(model) -> set[str]:
    return {type(m).__name__ for name, m in model.named_modules() if re.search(r"\.experts\.\d+\.\w+$", name)}


# --- per-expert checkpoints against transformers ---------------------------------------------------------------


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_fp8_per_expert_equals_transformers(floats, model_type, tmp_path):
    """Qwen/Qwen3-30B-A3B-FP8's layout, the router unquantized: transformers' dequantizing load is the reference."""
    import transformers

    source, state = floats[model_type]
    folder, _ = write_fp8(source, state, tmp_path / "fp8")
    ours = _ours(folder)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=transformers.FineGrainedFP8Config(dequantize=True)).eval()
    assert _assert_parity(ours, theirs) == 0  # the same dequantized weights, the same forward
    assert _expert_kinds(ours) == {"Linear"} and ours.quantization_config is None


@pytest.mark.parametrize("model_type", list(FAMILIES))
@pytest.mark.parametrize("scheme", ["w4a16", "fp8"])
def test_compressed_tensors_per_expert_equals_transformers(floats, model_type, scheme, tmp_path):
    """llm-compressor's per-expert weight_packed / weight_scale (w4a16) or float8 weight / per-channel scale
    (FP8_DYNAMIC), routers in the ignore list: transformers' CompressedTensorsConfig(dequantize=True) load."""
    pytest.importorskip("compressed_tensors")
    import transformers

    source, state = floats[model_type]
    weights = (dict(num_bits=4, type="int", strategy="group", group_size=16, symmetric=True) if scheme == "w4a16"
               else "FP8_DYNAMIC")
    folder, _ = write_compressed(source, state, tmp_path / scheme, weights, IGNORE_ROUTER)
    ours = _ours(folder)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32,
        quantization_config=transformers.CompressedTensorsConfig(dequantize=True)).eval()
    assert _assert_parity(ours, theirs) == 0
    assert _expert_kinds(ours) == {"Linear"}  # int4 in float32 and FP8 are dequantized (compressed_tensors.py)


@pytest.mark.parametrize("model_type", list(FAMILIES))
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_gptq_awq_per_expert_equal_the_dequantized_model(floats, model_type, method, tmp_path):
    """Qwen/Qwen3-30B-A3B-GPTQ-Int4 / Mixtral AWQ layouts (qweight, qzeros, scales, g_idx per expert; the router
    stored as a plain weight). transformers needs optimum / gptqmodel for these, so the reference is its model on
    the writer's dequantized weights. The experts stay packed (WeightOnlyLinear), exactly."""
    source, state = floats[model_type]
    folder, reference = write_gptq_awq(source, state, tmp_path / method, method)
    ours = _ours(folder)
    _assert_parity(ours, _reference(source, reference, tmp_path / "reference"))
    assert _expert_kinds(ours) == {"WeightOnlyLinear"}
    down = "w2" if model_type == "mixtral" else "down_proj"
    name = f"model.layers.0.{'block_sparse_moe' if model_type == 'mixtral' else 'mlp'}.experts.3.{down}"
    assert torch.equal(ours.get_submodule(name).dequantize(), reference[f"{name}.weight"])


# --- a router the checkpoint quantizes ----------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["fp8", "gptq", "compressed-w8a16", "compressed-fp8"])
def test_a_quantized_router_is_dequantized_into_the_router(floats, method, tmp_path):
    """The config leaves the router in (no modules_to_not_convert / ignore entry for it), so the checkpoint stores
    it quantized, as quantizers that saw it as a Linear do. transformers 5.24 fails on these (its CPU load of a
    quantized router raises), so the reference is the writer's dequantized weights."""
    source, state = floats["mixtral"]
    folder = tmp_path / method
    if method == "fp8":
        folder, reference = write_fp8(source, state, folder, router=True)
    elif method == "gptq":
        folder, reference = write_gptq_awq(source, state, folder, "gptq", router=True)
    else:  # FP8 weights are the case that read the router's float8 values unscaled before
        pytest.importorskip("compressed_tensors")
        weights = dict(num_bits=8, type="int", strategy="channel") if method == "compressed-w8a16" else "FP8_DYNAMIC"
        folder, reference = write_compressed(source, state, folder, weights, ["lm_head"])
    ours = _ours(folder)
    _assert_parity(ours, _reference(source, reference, tmp_path / "reference"))
    router = _moe(ours).gate
    assert type(router).__name__ == "TopKRouter" and router.float32_weights  # Mixtral's router, as built
    assert torch.equal(router.weight, reference["model.layers.0.block_sparse_moe.gate.weight"])
    assert not torch.equal(router.weight, state["model.layers.0.block_sparse_moe.gate.weight"])  # really quantized


def test_fp8_scales_for_a_router_the_config_leaves_out_are_refused(floats, tmp_path):
    source, state = floats["qwen3_moe"]
    folder, _ = write_fp8(source, state, tmp_path / "fp8", router=True, modules_to_not_convert=["mlp.gate"])
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate\.weight_scale_inv.*modules_to_not_convert"):
        _ours(folder)


# --- transformers' fused FP8 layout -------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_fp8_fused_experts_equal_the_per_expert_checkpoint(floats, model_type, tmp_path):
    """transformers 5.24 cannot be the reference: on the CPU its dequantizing load of fused FP8 experts leaves
    gate_up_proj_scale_inv / down_proj_scale_inv unused (its logits are off by ~1). The per-expert checkpoint,
    equal to transformers' load above, is: the same FP8 values and scales, fused."""
    source, state = floats[model_type]
    per_expert, _ = write_fp8(source, state, tmp_path / "per-expert")
    fused = write_fused_fp8(per_expert, tmp_path / "fused", model_type)
    ours, info = _ours(fused, output_loading_info=True)
    assert info.unexpected == []
    expected = _ours(per_expert)
    with torch.no_grad():
        assert torch.equal(ours(IDS).logits, expected(IDS).logits)


def test_fp8_fused_experts_kept_in_fp8_take_their_scales(floats, tmp_path, monkeypatch):
    """dequantize=False: each expert an FP8Linear with its slice of the fused scales (the device check, which wants
    a GPU of compute capability >= 8.9, is lifted and the Triton FP8 matmul left out: the forward dequantizes per
    call)."""
    import gpuformers.quantization.fp8 as fp8
    from gpuformers.quantization import FineGrainedFP8Config

    monkeypatch.setattr(fp8, "check_fp8_devices", lambda model: None)
    monkeypatch.setattr(fp8, "fp8_kernel_runs_on", lambda device: False)
    source, state = floats["qwen3_moe"]
    per_expert, reference = write_fp8(source, state, tmp_path / "per-expert")
    fused = write_fused_fp8(per_expert, tmp_path / "fused", "qwen3_moe")
    ours = _ours(fused, quantization_config=FineGrainedFP8Config(dequantize=False))
    expert = _moe(ours).experts[2].up_proj
    assert isinstance(expert, fp8.FP8Linear)
    assert torch.equal(expert.dequantize(torch.float32), reference["model.layers.0.mlp.experts.2.up_proj.weight"])
    with torch.no_grad():
        assert (ours(IDS).logits - _ours(per_expert)(IDS).logits).abs().max().item() < 1e-5


def test_fp8_fused_scale_blocks_spanning_gate_and_up_are_refused(floats, tmp_path):
    """Blocks of 48 rows over gate_up_proj's 2 x 32: block 0 holds all the gate rows and 16 up rows. The same blocks
    per expert (partial ones) load."""
    source, state = floats["qwen3_moe"]
    per_expert, _ = write_fp8(source, state, tmp_path / "per-expert", block=(48, 16))
    fused = write_fused_fp8(per_expert, tmp_path / "fused", "qwen3_moe", requantize=state)
    with pytest.raises(NotImplementedError, match=r"'model\.layers\.0\.mlp\.experts\.gate_up_proj_scale_inv'.*"
                                                  r"32 is not a multiple of 48"):
        _ours(fused)
    _ours(per_expert)


# --- the fused MoE kernel -----------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="an interpreter test; on a GPU tests/kernels runs the kernel")
def test_use_kernels_fuses_dequantized_experts_and_leaves_packed_ones_to_torch(floats, tmp_path, monkeypatch):
    """Dequantized experts (FP8 here) are plain Linears: the grouped Triton GEMMs run them. Packed ones
    (WeightOnlyLinear, from GPTQ) keep the block's torch forward, with the reason logged once."""
    from gpuformers.kernels.moe import stacked_expert_weights

    calls = count_fused_moe_calls(monkeypatch)
    source, state = floats["qwen3_moe"]
    fp8_folder, _ = write_fp8(source, state, tmp_path / "fp8")
    fast, plain = _ours(fp8_folder, use_kernels=True), _ours(fp8_folder)
    with torch.no_grad():
        torch.testing.assert_close(fast(IDS).logits, plain(IDS).logits, atol=1e-4, rtol=1e-4)
    assert len(calls) == 1  # layer 0 is sparse, layer 1 dense
    gptq_folder, _ = write_gptq_awq(source, state, tmp_path / "gptq", "gptq")
    fast, plain = _ours(gptq_folder, use_kernels=True), _ours(gptq_folder)
    assert stacked_expert_weights(_moe(fast)) is None  # "experts.0.gate_proj is a WeightOnlyLinear, ..."
    with torch.no_grad():
        torch.testing.assert_close(fast(IDS).logits, plain(IDS).logits, atol=1e-4, rtol=1e-4)
    assert len(calls) == 1
