"""LoRA adapters in the PEFT format (config.py, layers.py, lora_model.py, dora.py, embedding.py, modules_to_save.py,
peft_model.py, multi_adapter.py, adapter_state.py, and integration.py for the adapter methods on the model itself):
the `peft` library's names, config file and weight keys, without peft.

Each target linear layer (an nn.Linear, or for QLoRA a quantized one: bitsandbytes 4-bit / 8-bit,
WeightOnlyLinear) is wrapped in a LoraLinear that adds a low-rank update to its output:

    x ──> base_layer (frozen W, b) ───────────────────────────────────────> + ──> y
    └──> lora_dropout ──> lora_A (r, in) ──> lora_B (out, r) ──> * scaling ─┘

    scaling = lora_alpha / r        (lora_alpha / sqrt(r) with use_rslora)

With use_dora=True (DoRA, dora.py) a plain nn.Linear target becomes a DoraLinear: the weight W + scaling * B @ A
is rescaled row by row to a trained magnitude vector, as peft's DoRA does. An nn.Embedding target becomes a
LoraEmbedding (embedding.py): y = base_layer(ids) + A^T[ids] @ B^T * scaling, saved as peft's lora_embedding_A / _B;
with ensure_weight_tying on a tied model the LM head is a TiedLoraLinear computing with the embedding's pair.
bias="all" / "lora_only" train every bias / the targets' biases in place and save them under their own names.

The wrapper nests like peft's: PeftModel.base_model is a LoraModel, LoraModel.model is the user's model. So a
LoRA parameter's name is `base_model.model.<module>.lora_A.weight`, which is the key peft writes to
adapter_model.safetensors (peft drops its adapter name, "default", from the saved key; we have one adapter and
never put it in). An adapter saved here loads in peft and the other way round; adapter_config.json carries the
fields peft reads. PeftModel passes forward, generate and any attribute it lacks to the model, so generate(),
generate_batch() and the Trainer take it as they take the model. prepare_model_for_kbit_training readies a
quantized model for QLoRA as peft's does; adapters trained over quantized layers are the same files.

modules_to_save (e.g. ["lm_head", "embed_tokens"], matched as peft matches them) wraps each named module in a
ModulesToSaveWrapper: the module stays frozen as `original_module`, and a trainable full copy, `modules_to_save`,
runs in its place. The copy is saved under the module's own name (`base_model.model.lm_head.weight`, peft's key)
and is what merge_and_unload() and unload() leave in the model. On a model whose head is tied to its embeddings,
each copy trains apart (peft warns), unless ensure_weight_tying=True makes the head's copy the embedding's.

Not here yet (each raises NotImplementedError naming it): DoRA over quantized layers or embeddings, nested
modules_to_save, several adapters active at once, rank/alpha patterns and the other peft extras.

Offers: LoraConfig, LoraLayer, LoraLinear, DoraLinear, LoraEmbedding, TiedLoraLinear, ModulesToSaveWrapper, LoraModel,
PeftModel (alias PeftModelForCausalLM), get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict,
prepare_model_for_kbit_training.
"""

from gpuformers.lora.config import LoraConfig
from gpuformers.lora.dora import DoraLinear
from gpuformers.lora.embedding import LoraEmbedding, TiedLoraLinear
from gpuformers.lora.layers import LoraLayer, LoraLinear
from gpuformers.lora.lora_model import LoraModel
from gpuformers.lora.modules_to_save import ModulesToSaveWrapper
from gpuformers.lora.peft_model import (
    PeftModel,
    PeftModelForCausalLM,
    get_peft_model,
    get_peft_model_state_dict,
    prepare_model_for_kbit_training,
    set_peft_model_state_dict,
)

__all__ = ["DoraLinear", "LoraConfig", "LoraEmbedding", "LoraLayer", "LoraLinear", "LoraModel", "ModulesToSaveWrapper",
           "PeftModel", "PeftModelForCausalLM", "TiedLoraLinear", "get_peft_model", "get_peft_model_state_dict",
           "prepare_model_for_kbit_training", "set_peft_model_state_dict"]
