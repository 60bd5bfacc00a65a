"""GGUF checkpoints: llama.cpp's single-file format, read as a Hugging Face checkpoint of one of the families that
transformers itself loads from GGUF (llama, qwen2, qwen3, qwen3_moe, qwen2_moe, phi3, gemma2, gemma3_text).

A GGUF file holds the model config, the tokenizer and the (often quantized) weights, all under
llama.cpp's names. This module turns each of those into what the rest of gpuformers reads from an HF
folder, so `from_pretrained(path, gguf_file=...)` only has to glue them in:

    ckpt = read_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    ckpt.config                      # a config.json-style dict (model_type "llama", "qwen3_moe", "gemma2", ...)
    ckpt.generation_config           # a generation_config.json-style dict
    for name in ckpt.tensor_names():  # HF names: model.layers.0.self_attn.q_proj.weight, ...
        ckpt.load_tensor(name, torch.bfloat16, "cuda")
    tokenizer, tokenizer_config = ckpt.tokenizer_parts()

The config comes from gguf_config.py (the metadata -> config.json mapping per architecture), the tensor names and
the q/k row order from gguf_tensors.py, the tokenizer from gguf_tokenizer.py; this module opens and checks the
file and reads its tensors.

Offers: `read_gguf`, `GGUFCheckpoint`, `SUPPORTED_ARCHITECTURES`, `supported_quant_types()`.

Weights are dequantized with the `gguf` package (Q8_0, Q4_0 and Q4_1 with torch, the same numbers:
gguf_dequant.py) one tensor, and within a tensor one slab of rows, at a time, straight into the requested dtype
and device: a model is never held in float32 whole.
Where llama.cpp's layout differs from HF's, the tensor is turned back as it is read:

    llama      q/k rows of each head interleaved          -> the two rotary halves apart again
    qwen*moe   blk.N.ffn_gate_exps (experts, ff, hidden)  -> one mlp.experts.E.gate_proj per expert (rows E*ff..)
    qwen2moe   blk.N.ffn_gate_inp_shexp (hidden,)         -> mlp.shared_expert_gate.weight (1, hidden)
    gemma2/3   every RMSNorm weight stored as 1 + w       -> w (Gemma's norm multiplies by 1 + weight)
    phi3       attn_qkv, ffn_up (gate and up fused)       -> self_attn.qkv_proj, mlp.gate_up_proj as they are
"""

from __future__ import annotations

import functools
import os
import re
import zlib
from pathlib import Path

import numpy as np
import torch

from gpuformers.loading.gguf_config import (MOE_ARCHITECTURES, NORM_PLUS_ONE_ARCHITECTURES, SUPPORTED_ARCHITECTURES,
                                            GGUFConfigMixin)
from gpuformers.loading.gguf_tensors import (EXPERT_NAMES, EXTRA_LAYER_NAMES, LAYER_NAMES, NOT_PARAMETERS,
                                             ROTARY_PERMUTED, can_dequantize, hf_parameter_name, supported_quant_types,
                                             unpermute_rotary_rows)
from gpuformers.loading.gguf_dequant import dequantize_blocks
from gpuformers.loading.gguf_file import GGUFFile
from gpuformers.loading.gguf_tokenizer import tokenizer_parts

# Elements dequantized per slab (16 MiB of float32): bounds the extra memory a big tensor needs.
_SLAB_ELEMENTS = 1 << 22


@functools.lru_cache(maxsize=2)
def _parsed(path: str, fingerprint: tuple) -> GGUFFile:
    """The file's parsed header (its tensors memory-mapped, read-only), kept for the next reader of the same unchanged
    file: loading a model and then its tokenizer from one file reads it once."""
    return GGUFFile(path)


def _fingerprint(path: Path) -> tuple:
    """What tells a rewritten file from the one parsed: size, modification time, and a checksum of its first MiB
    (the metadata) and last 64 KiB (a file rewritten within the clock's granularity, at the same size)."""
    stat = path.stat()
    with open(path, "rb") as handle:
        head = handle.read(1 << 20)
        handle.seek(max(0, stat.st_size - (1 << 16)))
        tail = handle.read()
    return stat.st_size, stat.st_mtime_ns, zlib.crc32(head), zlib.crc32(tail)


def read_gguf(path: str | os.PathLike) -> "GGUFCheckpoint":
    """Open a GGUF file and check that gpuformers can load it (architecture, quant types, tensors)."""
    return GGUFCheckpoint(path)


class GGUFCheckpoint(GGUFConfigMixin):
    """One GGUF file, memory-mapped: HF-style config, tensors under HF names, and the tokenizer."""

    def __init__(self, path: str | os.PathLike):
        try:
            import gguf  # noqa: F401  (the reader below needs its type tables, loading its dequantizers)
        except ImportError as error:
            raise ImportError(
                "Loading a GGUF file needs the `gguf` package: pip install 'gpuformers[gguf]' (or pip install gguf)"
            ) from error
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file {str(self.path)!r} does not exist (or is not a file)")
        with open(self.path, "rb") as handle:
            magic = handle.read(4)
        if magic != b"GGUF":
            raise ValueError(
                f"{str(self.path)!r} is not a GGUF file: it starts with {magic!r} instead of b'GGUF'. "
                "Pass a llama.cpp .gguf file as gguf_file, or load .safetensors checkpoints without gguf_file."
            )
        self._reader = _parsed(str(self.path.resolve()), _fingerprint(self.path))
        self._metadata = self._reader.metadata
        self.architecture = arch = self._meta("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"GGUF architecture {arch!r} ({self.path.name}) is not supported; "
                f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if (self._meta(f"{arch}.expert_count") or 0) > 0 and arch not in MOE_ARCHITECTURES:
            raise ValueError(
                f"{self.path.name} is a mixture-of-experts {arch} ({self._meta(f'{arch}.expert_count')} experts), "
                f"as llama.cpp writes Mixtral; transformers' GGUF loader does not load it and neither does gpuformers "
                f"(mixture-of-experts architecture: {', '.join(MOE_ARCHITECTURES)}; all architectures: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        self._tensors = self._map_tensor_names()
        self._check_quant_types()
        self.config = self._build_config()
        self.generation_config = self._build_generation_config()

    # ----- tensors -----

    def _map_tensor_names(self) -> dict:
        """HF name -> (ReaderTensor, llama.cpp name, expert index or None), refusing tensors this loader does not
        understand. A stacked expert tensor gives one HF name per expert, all pointing at the same ReaderTensor."""
        tensors, unknown = {}, []
        layer_names = LAYER_NAMES | EXTRA_LAYER_NAMES.get(self.architecture, {})
        for info in self._reader.tensors:
            experts = EXPERT_NAMES if self.architecture in MOE_ARCHITECTURES else {}
            match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", info.name)
            if match and match.group(2) in experts:
                for expert in range(int(info.shape[-1])):  # ggml's slowest dimension is the expert
                    module = f"mlp.experts.{expert}.{experts[match.group(2)]}"
                    tensors[f"model.layers.{match.group(1)}.{module}.weight"] = (info, info.name, expert)
                continue
            hf_name = hf_parameter_name(info.name, layer_names)
            if hf_name is not None:
                tensors[hf_name] = (info, info.name, None)
            elif not NOT_PARAMETERS.fullmatch(info.name):
                unknown.append(info.name)
        if unknown:
            shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
            raise ValueError(
                f"{self.path.name} holds tensors a {self.architecture} model has no place for: {shown}. "
                f"Only llama.cpp's {self.architecture} layout is supported."
            )
        return tensors

    def _check_quant_types(self) -> None:
        for info, gguf_name, _ in self._tensors.values():
            if not can_dequantize(int(info.tensor_type)):
                raise ValueError(
                    f"tensor {gguf_name} in {self.path.name} is stored as {info.tensor_type.name}, which the installed "
                    f"gguf package cannot dequantize; supported types: {', '.join(supported_quant_types())}. "
                    "Upgrading gguf may add it."
                )

    def tensor_names(self) -> list[str]:
        """HF parameter names in file order; lm_head.weight is absent when tied to the embedding."""
        return list(self._tensors)

    def _entry(self, hf_name: str) -> tuple:
        """(ReaderTensor, llama.cpp name, expert index or None) of an HF tensor name."""
        if hf_name not in self._tensors:
            raise KeyError(f"{hf_name!r} is not in {self.path.name}; its tensors are: {', '.join(self._tensors)}")
        return self._tensors[hf_name]

    def _info(self, hf_name: str):
        return self._entry(hf_name)[0]

    def tensor_shape(self, hf_name: str) -> tuple[int, ...]:
        """The HF (torch-order) shape of a tensor, read from the header without touching its data."""
        # ggml lists dimensions fastest-moving first; torch the other way round
        shape = tuple(int(d) for d in reversed(self._info(hf_name).shape.tolist()))
        if hf_name.endswith("mlp.shared_expert_gate.weight") and len(shape) == 1:  # llama.cpp's {hidden}
            shape = (1, *shape)  # HF's Linear(hidden, 1)
        return shape if self._entry(hf_name)[2] is None else shape[1:]  # one expert of a stacked tensor

    def quant_type(self, hf_name: str) -> str:
        """The ggml type the tensor is stored as: F32, F16, BF16, Q8_0, Q4_K, ..."""
        return self._info(hf_name).tensor_type.name

    def load_tensor(self, hf_name: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        """One tensor under its HF name, dequantized slab by slab into `dtype` on `device`."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        info, gguf_name, expert = self._entry(hf_name)
        shape = self.tensor_shape(hf_name)
        qtype = info.tensor_type
        # (rows, row_bytes) for block types, (rows, cols) for float types; one row = the fastest dimension
        data = np.asarray(info.data)
        rows = data.reshape(-1, data.shape[-1]) if data.ndim > 0 else data.reshape(1, 1)
        if expert is not None:  # (experts * expert_rows, ...): this expert's rows only
            expert_rows = rows.shape[0] // int(info.shape[-1])
            rows = rows[expert * expert_rows : (expert + 1) * expert_rows]
        cols = shape[-1] if shape else 1
        plus_one = self.architecture in NORM_PLUS_ONE_ARCHITECTURES and gguf_name.endswith("norm.weight")
        final_dtype, dtype = dtype, (torch.float32 if plus_one else dtype)  # subtract before rounding
        out = torch.empty((rows.shape[0], cols), dtype=dtype, device=device)
        step = max(1, _SLAB_ELEMENTS // cols)
        for start in range(0, rows.shape[0], step):
            chunk = np.array(rows[start : start + step])  # copy: the mmap is read-only
            if qtype == GGMLQuantizationType.F16:
                values = torch.from_numpy(chunk.view(np.float16))
            elif qtype == GGMLQuantizationType.BF16:
                values = torch.from_numpy(chunk.view(np.int16)).view(torch.bfloat16)
            else:  # Q8_0 / Q4_0 / Q4_1 with torch (gguf_dequant.py), the other types with the gguf package
                values = dequantize_blocks(chunk, qtype.name)
                if values is None:
                    values = torch.from_numpy(np.ascontiguousarray(dequantize(chunk, qtype), dtype=np.float32))
            out[start : start + step] = values.reshape(-1, cols).to(dtype)
        self._reader.release(rows)
        out = out.reshape(shape)
        if plus_one:
            return (out - 1.0).to(final_dtype)
        if self.architecture not in ROTARY_PERMUTED:
            return out
        if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            out = unpermute_rotary_rows(out, self.config["num_attention_heads"])
        elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            out = unpermute_rotary_rows(out, self.config["num_key_value_heads"])
        return out

    def tokenizer_parts(self):
        """`(tokenizers.Tokenizer, tokenizer_config dict)` rebuilt from the tokenizer.* metadata
        (loading/gguf_tokenizer.py says how)."""
        return tokenizer_parts(self._meta, self.path.name, self.config["max_position_embeddings"])
