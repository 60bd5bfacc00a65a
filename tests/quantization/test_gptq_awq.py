"""GPTQ and AWQ checkpoints (quant_method "gptq" / "awq"): the loaded weights against the format's own arithmetic,
the logits and greedy tokens against transformers' model run on those weights, which layers stay packed in which
dtype, layers stored unquantized, saving, and the settings gpuformers refuses.

The checkpoints are made here from a tiny random llama (with biases on the attention projections): every Linear
but the LM head quantized by an independent packer written from the formats (GPTQ: input-packed qweight, v1's
zeros stored minus one per value with word borrows; AWQ: output-packed words in the [0, 2, 4, 6, 1, 3, 5, 7]
order). A last test checks our unpacking against autoawq's and gptqmodel's own code when their sources are in
/tmp/dl (not in CI).
"""

from __future__ import annotations

import ast
import json
import logging
import shutil
import tarfile
from pathlib import Path

import pytest
import torch
from torch import nn

from gpuformers.quantization import AwqConfig, GPTQConfig, quantization_config_from
from gpuformers.quantization.weight_only import WeightOnlyLinear
from tests.fixtures.checkpoints import make_checkpoint

IDS = torch.tensor([[1, 5, 9, 23, 42, 7, 64, 100]])
UNCONVERTED = "model.layers.1.mlp.down_proj"
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's order_map: value k of a word holds column 8c + AWQ_ORDER[k]

# name: (quant_method, bits, group_size, sym, desc_act, checkpoint_format, kept packed in float32)
FORMATS = {
    "gptq4-sym": ("gptq", 4, 32, True, False, "gptq", True),
    "gptq4-asym": ("gptq", 4, 32, False, False, "gptq", True),
    "gptq4-asym-v2": ("gptq", 4, 32, False, False, "gptq_v2", True),
    "gptq4-act-order": ("gptq", 4, 32, True, True, "gptq", False),
    "gptq8-sym": ("gptq", 8, 32, True, False, "gptq", True),
    "gptq8-asym": ("gptq", 8, 32, False, False, "gptq", False),
    "gptq8-channel": ("gptq", 8, -1, True, False, "gptq", True),
    "gptq2-asym": ("gptq", 2, 16, False, False, "gptq", False),
    "awq": ("awq", 4, 32, False, False, None, True),
    "awq-no-zero-point": ("awq", 4, 32, True, False, None, True),
}


# --- the independent reference packer ---------------------------------------------------------------------------


def _quantize(weight, bits, group_size, sym, desc_act, seed):
    """weight (out, in) -> integers q (out, in), zeros (G, out), float16 scales (G, out), g_idx (in,), and the
    reference weight (q - zero) * scale in float32. Act-order groups columns in a random order; asymmetric groups
    get one zero of 0 (row 0 of group 0 made non-negative), the case where v1's minus one borrows."""
    out_features, in_features = weight.shape
    maxq = 2 ** bits - 1
    size = in_features if group_size == -1 else group_size
    order = torch.randperm(in_features, generator=torch.Generator().manual_seed(seed)) if desc_act \
        else torch.arange(in_features)
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[order] = (torch.arange(in_features) // size).to(torch.int32)
    weight = weight.clone()
    if not sym:
        weight[0, g_idx == 0] = weight[0, g_idx == 0].abs()
    groups = int(g_idx.max()) + 1
    scales = torch.empty(groups, out_features, dtype=torch.float16)
    zeros = torch.empty(groups, out_features, dtype=torch.int64)
    for g in range(groups):
        part = weight[:, g_idx == g]
        if sym:
            scales[g] = (part.abs().amax(1) * 2 / maxq).clamp(min=1e-6)
            zeros[g] = 2 ** (bits - 1)
        else:
            low, high = part.amin(1).clamp(max=0), part.amax(1).clamp(min=0)
            scales[g] = ((high - low) / maxq).clamp(min=1e-6)
            zeros[g] = torch.round(-low / scales[g].float()).clamp(0, maxq).long()
    s, z = scales.float()[g_idx.long()].t(), zeros[g_idx.long()].t()  # (out, in)
    q = (torch.round(weight / s) + z).clamp(0, maxq).long()
    return q, zeros, scales, g_idx, (q - z).float() * s


def _words(values, bits):
    """Pack each run of 32 / bits rows of `values` (int64, >= 0) into one unsigned 32-bit word, value k of the run
    at bits [k * bits, (k + 1) * bits): (rows, cols) -> (rows * bits / 32, cols), int64 in [0, 2^32)."""
    per_word = 32 // bits
    runs = values.reshape(-1, per_word, values.shape[1])
    return sum(runs[:, k] << (bits * k) for k in range(per_word))


def _int32(words):
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _pack_gptq(q, zeros, bits, checkpoint_format):
    qweight = _int32(_words(q.t(), bits))  # packed along the input
    packed_zeros = _words(zeros.t(), bits).t()  # packed along the output
    if checkpoint_format == "gptq":  # v1: minus one per value, on the whole word (gptqmodel's v2 -> v1)
        packed_zeros = (packed_zeros - _words(torch.ones(32 // bits, 1, dtype=torch.int64), bits)) % 2 ** 32
    return qweight, _int32(packed_zeros)


def _pack_awq(q, zeros):
    def pack(values):  # (rows, out) -> (rows, out / 8), output columns interleaved
        blocks = values.reshape(values.shape[0], -1, 8)[:, :, AWQ_ORDER]
        return _int32(sum(blocks[:, :, k] << (4 * k) for k in range(8)))

    return pack(q.t()), pack(zeros)


def _write(source, hf, folder, fmt, skip=(), seed=0, change=None):
    """Copy checkpoint `source` to `folder` in format `fmt` (FORMATS); returns hf's state dict with the reference
    weights. `skip`: layers stored unquantized; change(config, tensors) edits the result before it is written."""
    from safetensors.torch import save_file

    method, bits, group_size, sym, desc_act, checkpoint_format, _ = FORMATS[fmt]
    folder.mkdir()
    for path in source.iterdir():
        if path.suffix == ".json":
            shutil.copy(path, folder / path.name)
    tensors, reference = {}, {}
    for index, (name, value) in enumerate(hf.state_dict().items()):
        module = name.rpartition(".")[0]
        quantized = (isinstance(hf.get_submodule(module), nn.Linear) and module != "lm_head" and module not in skip)
        if quantized and name.endswith(".weight"):
            q, zeros, scales, g_idx, reference[name] = _quantize(value, bits, group_size, sym, desc_act, seed + index)
            if method == "gptq":
                qweight, qzeros = _pack_gptq(q, zeros, bits, checkpoint_format)
                tensors[f"{module}.g_idx"] = g_idx
            else:
                qweight, qzeros = _pack_awq(q, zeros)
            tensors.update({f"{module}.qweight": qweight, f"{module}.qzeros": qzeros, f"{module}.scales": scales})
        elif quantized:  # a bias, stored in float16 as GPTQ / AWQ tools do
            tensors[name] = value.half()
            reference[name] = value.half().float()
        else:
            tensors[name] = reference[name] = value.clone()
    config = json.loads((folder / "config.json").read_text())
    if method == "gptq":
        config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                                         "desc_act": desc_act, "sym": sym, "checkpoint_format": checkpoint_format,
                                         "damp_percent": 0.01, "true_sequential": True, "dataset": None}
    else:
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                         "zero_point": not sym, "version": "gemm",
                                         "modules_to_not_convert": list(skip) or None}
    if change is not None:
        change(config["quantization_config"], tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return reference


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(float folder, transformers model, {format: (folder, reference state dict)})."""
    root = tmp_path_factory.mktemp("gptq_awq")
    hf = make_checkpoint(root / "float", "llama", attention_bias=True, tie_word_embeddings=False)
    made = {fmt: (root / fmt, _write(root / "float", hf, root / fmt, fmt)) for fmt in FORMATS}
    return root / "float", hf, made


def _load(folder, **kwargs):
    from gpuformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=kwargs.pop("dtype", torch.float32), progress=False,
                                                **kwargs)


def _weight(module):
    return module.dequantize() if isinstance(module, WeightOnlyLinear) else module.weight


def _reference_model(hf, state):
    import copy

    model = copy.deepcopy(hf)
    model.load_state_dict(state)
    return model


def _quantized_names(reference, hf):
    return [name.removesuffix(".weight") for name in reference
            if name.endswith("_proj.weight") and not torch.equal(reference[name], hf.state_dict()[name])]


# --- weights and parity -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_weights_equal_the_reference_and_stay_packed_where_exact(checkpoints, fmt):
    _, hf, made = checkpoints
    folder, reference = made[fmt]
    model = _load(folder)
    names = _quantized_names(reference, hf)
    assert len(names) == 14  # 7 projections x 2 layers, all quantized
    for name in names:
        layer = model.get_submodule(name)
        assert torch.equal(_weight(layer), reference[f"{name}.weight"]), name
        assert isinstance(layer, WeightOnlyLinear) is FORMATS[fmt][-1], (name, type(layer))
        if layer.bias is not None:
            assert torch.equal(layer.bias, reference[f"{name}.bias"])
    assert type(model.lm_head) is nn.Linear and torch.equal(model.lm_head.weight, hf.lm_head.weight)
    packed = FORMATS[fmt][-1]
    assert (model.quantization_config is not None) is packed
    if packed:
        assert model.quantization_config.quant_method == "weight_only"
        assert model.quantization_config.bits == FORMATS[fmt][1]


@pytest.mark.parametrize("fmt", ["gptq4-sym", "gptq4-act-order", "gptq8-asym", "awq"])
def test_logits_and_greedy_tokens_equal_transformers_on_the_reference_weights(checkpoints, fmt):
    _, hf, made = checkpoints
    folder, reference = made[fmt]
    theirs = _reference_model(hf, reference)
    ours = _load(folder)
    with torch.no_grad():
        assert (ours(IDS).logits - theirs(IDS).logits).abs().max().item() < 1e-4
    assert (ours.generate(IDS, max_new_tokens=6, do_sample=False).tolist()
            == theirs.generate(IDS, max_new_tokens=6, do_sample=False).tolist())
    # and the quantization is really there
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(reference[q_proj], hf.state_dict()[q_proj])


def test_float16_keeps_symmetric_gptq_packed_and_bit_equal(checkpoints):
    _, hf, made = checkpoints
    folder, reference = made["gptq4-sym"]
    model = _load(folder, dtype=torch.float16)
    for name in _quantized_names(reference, hf):
        layer = model.get_submodule(name)
        assert isinstance(layer, WeightOnlyLinear), name
        assert torch.equal(layer.dequantize(), reference[f"{name}.weight"].half()), name


@pytest.mark.parametrize("fmt, dtype", [("awq", torch.float16), ("gptq4-sym", torch.bfloat16)])
def test_layers_a_16_bit_dtype_cannot_hold_are_dequantized_with_a_warning(checkpoints, fmt, dtype, caplog):
    """AWQ's asymmetric zeros (8 - z) * scale mostly round in float16 (a small layer's may all fit: checked per
    layer); float16 scales round in bfloat16. Dequantized: the float32 product rounded once."""
    _, hf, made = checkpoints
    folder, reference = made[fmt]
    with caplog.at_level(logging.WARNING, logger="gpuformers.quantization.gptq_awq"):
        model = _load(folder, dtype=dtype)
    assert ("zero points that torch.float16" if fmt == "awq" else "float16 scales that torch.bfloat16") in caplog.text
    names = _quantized_names(reference, hf)
    dense = [name for name in names if type(model.get_submodule(name)) is nn.Linear]
    for name in names:
        assert torch.equal(_weight(model.get_submodule(name)), reference[f"{name}.weight"].to(dtype)), name
    assert len(dense) >= (10 if fmt == "awq" else len(names))
    config = model.quantization_config
    assert config is None if len(dense) == len(names) else set(dense) <= set(config.skip_modules)


def test_dequantize_true_gives_a_plain_model(checkpoints, caplog):
    _, _, made = checkpoints
    folder, reference = made["gptq4-sym"]
    with caplog.at_level(logging.WARNING, logger="gpuformers.quantization.gptq_awq"):
        model = _load(folder, quantization_config=GPTQConfig(bits=4, dequantize=True))
    assert not caplog.text  # asked for: no warning
    assert model.quantization_config is None and "quantization_config" not in model.config.extra
    assert not any(isinstance(m, WeightOnlyLinear) for m in model.modules())
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, reference["model.layers.0.mlp.up_proj.weight"])


def test_saving_a_packed_model_reloads_the_same_model(checkpoints, tmp_path):
    _, _, made = checkpoints
    model = _load(made["awq"][0])
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "weight_only" and saved["bits"] == 4 and saved["group_size"] == 32
    again = _load(tmp_path / "saved")
    with torch.no_grad():
        assert torch.equal(again(IDS).logits, model(IDS).logits)


# --- layers stored unquantized ----------------------------------------------------------------------------------


def test_modules_to_not_convert_and_the_lm_head_are_read_unquantized(checkpoints, tmp_path):
    source, hf, _ = checkpoints
    folder = tmp_path / "awq-skip"
    reference = _write(source, hf, folder, "awq", skip=(UNCONVERTED,))
    model = _load(folder)
    assert type(model.get_submodule(UNCONVERTED)) is nn.Linear
    assert torch.equal(model.get_submodule(UNCONVERTED).weight, hf.get_submodule(UNCONVERTED).weight)
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)
    theirs = _reference_model(hf, reference)
    with torch.no_grad():
        assert (model(IDS).logits - theirs(IDS).logits).abs().max().item() < 1e-4
    # saved with the dense layers named, so that reloading does not quantize them
    assert UNCONVERTED in model.quantization_config.skip_modules


def test_an_unlisted_layer_stored_unquantized_is_read_as_it_is(checkpoints, tmp_path):
    """gptqmodel's "-:" dynamic exclusions and modules_in_block_to_quantize leave layers in float, unlisted."""
    source, hf, _ = checkpoints

    def exclude(config, tensors):
        config["dynamic"] = {"-:.*layers\\.1\\.mlp\\.down_proj": {}}

    folder = tmp_path / "gptq-dynamic"
    _write(source, hf, folder, "gptq4-sym", skip=(UNCONVERTED,), change=exclude)
    model = _load(folder)
    assert torch.equal(model.get_submodule(UNCONVERTED).weight, hf.get_submodule(UNCONVERTED).weight)


def test_a_zero_bias_for_a_layer_without_bias_is_accepted(checkpoints, tmp_path):
    """Older AutoGPTQ saved a zero bias for every quantized layer; a non-zero one is an error."""
    source, hf, _ = checkpoints

    def zero_bias(config, tensors):
        tensors["model.layers.0.mlp.up_proj.bias"] = torch.zeros(96, dtype=torch.float16)

    _write(source, hf, tmp_path / "zero", "gptq4-sym", change=zero_bias)
    assert _load(tmp_path / "zero").model.layers[0].mlp.up_proj.bias is None

    def one_bias(config, tensors):
        tensors["model.layers.0.mlp.up_proj.bias"] = torch.ones(96, dtype=torch.float16)

    _write(source, hf, tmp_path / "one", "gptq4-sym", change=one_bias)
    with pytest.raises(KeyError, match="up_proj.bias"):
        _load(tmp_path / "one")


def test_gptq_without_g_idx_uses_consecutive_groups(checkpoints, tmp_path):
    source, hf, _ = checkpoints

    def drop_g_idx(config, tensors):
        for key in [k for k in tensors if k.endswith(".g_idx")]:
            del tensors[key]

    reference = _write(source, hf, tmp_path / "no-g-idx", "gptq4-asym", change=drop_g_idx)
    model = _load(tmp_path / "no-g-idx")
    assert torch.equal(model.model.layers[1].mlp.down_proj.dequantize(), reference[f"{UNCONVERTED}.weight"])
    _write(source, hf, tmp_path / "act-order", "gptq4-act-order", change=drop_g_idx)
    with pytest.raises(ValueError, match="g_idx is missing"):
        _load(tmp_path / "act-order")


# --- refusals and errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("data, error, match", [
    ({"quant_method": "gptq", "bits": 3}, NotImplementedError, "bits=3"),
    ({"quant_method": "gptq", "bits": 5}, ValueError, "bits=5"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, ValueError, "group_size=0"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, NotImplementedError, "format='marlin'"),
    ({"quant_method": "gptq", "bits": 4, "pack_dtype": "int16"}, NotImplementedError, "pack_dtype='int16'"),
    ({"quant_method": "gptq", "bits": 4, "dynamic": {"+:.*down.*": {"bits": 8}}}, NotImplementedError, "dynamic="),
    ({"quant_method": "gptq"}, ValueError, "'bits'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, NotImplementedError, "version='gemv'"),
    ({"quant_method": "awq", "bits": 8, "version": "gemm"}, NotImplementedError, "bits=8"),
])
def test_unsupported_configs_name_the_field(data, error, match):
    with pytest.raises(error, match=match):
        quantization_config_from(data)


def test_configs_read_transformers_fields():
    gptq = quantization_config_from({"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": True,
                                     "sym": False, "format": "gptq", "checkpoint_format": "gptq_v2",
                                     "tokenizer": None, "use_exllama": True, "exllama_config": {"version": 1},
                                     "dynamic": {"-:.*visual.*": {}}, "lm_head": False})
    assert isinstance(gptq, GPTQConfig) and (gptq.bits, gptq.group_size, gptq.format) == (8, -1, "gptq_v2")
    assert gptq.desc_act and not gptq.sym and gptq.skip_modules == ["lm_head"]
    awq = quantization_config_from({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                    "version": "GEMM", "modules_to_not_convert": ["visual"], "backend": "autoawq"})
    assert isinstance(awq, AwqConfig) and awq.format == "gemm" and awq.skip_modules == ["lm_head", "visual"]
    import transformers  # its config objects are accepted too

    theirs = quantization_config_from(transformers.GPTQConfig(bits=8, group_size=64, desc_act=True))
    assert isinstance(theirs, GPTQConfig) and (theirs.bits, theirs.group_size, theirs.desc_act) == (8, 64, True)
    assert quantization_config_from(transformers.AwqConfig(zero_point=False)).zero_point is False


def test_quantizing_a_float_checkpoint_is_refused(checkpoints):
    with pytest.raises(NotImplementedError, match="calibration"):
        _load(checkpoints[0], quantization_config=AwqConfig())


def test_a_config_that_does_not_match_the_tensors_names_both(checkpoints, tmp_path):
    source, hf, _ = checkpoints

    def claim_64(config, tensors):
        config["group_size"] = 64

    _write(source, hf, tmp_path / "gs", "gptq4-sym", change=claim_64)
    with pytest.raises(ValueError, match=r"down_proj.g_idx .*group_size=64"):
        _load(tmp_path / "gs")

    def claim_8_bits(config, tensors):
        config["bits"] = 8

    _write(source, hf, tmp_path / "bits", "awq", change=claim_8_bits)
    with pytest.raises(NotImplementedError, match="bits=8"):
        _load(tmp_path / "bits")


def test_a_missing_tensor_is_named(checkpoints, tmp_path):
    source, hf, _ = checkpoints

    def drop(config, tensors):
        del tensors["model.layers.0.self_attn.k_proj.qzeros"]

    _write(source, hf, tmp_path / "missing", "awq", change=drop)
    with pytest.raises(ValueError, match="k_proj.qzeros"):
        _load(tmp_path / "missing")


# --- against the reference implementations (local only) ---------------------------------------------------------

DOWNLOADS = Path("/tmp/dl")


def _functions(archive: str, member: str, names: list[str], namespace: dict) -> dict:
    """Load top-level functions `names` of a Python file inside a downloaded sdist, without importing its package."""
    with tarfile.open(DOWNLOADS / archive) as tar:
        source = tar.extractfile(member).read().decode()
    tree = ast.parse(source)
    wanted = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    exec(compile(ast.Module(body=wanted, type_ignores=[]), member, "exec"), namespace)
    return namespace


@pytest.mark.skipif(not (DOWNLOADS / "autoawq-0.2.9.tar.gz").is_file()
                    or not (DOWNLOADS / "gptqmodel-7.7.0.tar.gz").is_file(),
                    reason="the autoawq / gptqmodel sources are not in /tmp/dl")
def test_unpacking_agrees_with_autoawq_and_gptqmodel(checkpoints):
    from safetensors.torch import load_file

    from gpuformers.quantization.gptq_awq import dequantize_packed, unpack_awq, unpack_gptq

    _, _, made = checkpoints
    awq = _functions("autoawq-0.2.9.tar.gz", "autoawq-0.2.9/awq/utils/packing_utils.py",
                     ["unpack_awq", "reverse_awq_order", "dequantize_gemm"],
                     {"torch": torch, "AWQ_REVERSE_ORDER": [0, 4, 1, 5, 2, 6, 3, 7]})
    gptq = _functions("gptqmodel-7.7.0.tar.gz", "gptqmodel-7.7.0/gptqmodel/utils/model_dequant.py",
                      ["unpack_rows", "unpack_cols", "pack_cols", "_shift_gptq_qzeros", "_correct_gptq_v1_qzeros"],
                      {"torch": torch, "PLANAR_BITS": (5, 6, 7)})
    for fmt in ("awq", "awq-no-zero-point", "gptq4-sym", "gptq4-asym-v2", "gptq4-act-order", "gptq8-sym",
                "gptq8-channel"):
        tensors = load_file(str(made[fmt][0] / "model.safetensors"))
        prefix = "model.layers.0.mlp.down_proj"  # 96 -> 64
        qweight, qzeros, scales = (tensors[f"{prefix}.{part}"] for part in ("qweight", "qzeros", "scales"))
        if fmt.startswith("awq"):
            q, zeros = unpack_awq(qweight, qzeros)
            ours = dequantize_packed(q, zeros, scales, torch.arange(96) // 32, torch.float16)
            theirs = awq["dequantize_gemm"](qweight, qzeros, scales, 4, 32).t()  # float16 arithmetic, one rounding
        else:
            bits, checkpoint_format = FORMATS[fmt][1], FORMATS[fmt][5]
            q, zeros = unpack_gptq(qweight, qzeros, bits, 96, 64, checkpoint_format)
            ours = dequantize_packed(q, zeros, scales, tensors[f"{prefix}.g_idx"], torch.float32)
            their_zeros = qzeros if checkpoint_format == "gptq_v2" else gptq["_correct_gptq_v1_qzeros"](qzeros, bits)
            g_idx = tensors[f"{prefix}.g_idx"].long()
            their_q, their_z = gptq["unpack_rows"](qweight, bits), gptq["unpack_cols"](their_zeros, bits)
            theirs = ((their_q.float() - their_z.float()[g_idx]) * scales.float()[g_idx]).t()
        assert torch.equal(ours, theirs), fmt


def test_int4_over_an_odd_number_of_inputs_is_dequantized_not_repacked():
    """WeightOnlyLinear packs int4 two per byte along the inputs: a layer with an odd count (and an odd group size
    dividing it) must take the dequantized path, not fail inside the repack."""
    from gpuformers.quantization.packed import layout_reason

    assert "odd" in layout_reason(4, 3, 9)
    assert layout_reason(8, 3, 9) is None and layout_reason(4, 4, 8) is None
