"""layers/blocks.py: a model's decoder layers are the instances of the classes it names once (decoder_layer_class,
or decoder_layer_classes), a user's subclass swapped into the stack included, which a match on class names missed;
no_split_modules is derived from them, on the class and on an instance."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpuformers.layers.blocks import checkpoint_decoder_layers, decoder_layers, uncheckpoint_decoder_layers
from gpuformers.models.config import ModelConfig
from gpuformers.models.heads import base_model_class, causal_lm_class, sequence_classification_class
from gpuformers.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from gpuformers.models.registry import MODEL_TYPES


class CountingLayer(LlamaDecoderLayer):
    """A user's layer: llama's, counting its forward calls (a recompute in the backward counts too)."""

    calls = 0

    def forward(self, *args, **kwargs):
        type(self).calls += 1
        return super().forward(*args, **kwargs)


def _tiny_llama(model_class=LlamaForCausalLM) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = ModelConfig.from_dict(dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=3, num_attention_heads=4))
    return model_class(config)


def test_a_subclass_swapped_into_the_stack_is_a_decoder_layer_and_is_checkpointed():
    model = _tiny_llama()
    model.model.layers[1] = CountingLayer(model.config, 1)
    layers = decoder_layers(model)
    assert [id(layer) for layer in layers] == [id(layer) for layer in model.model.layers]
    assert "CountingLayer" not in model.no_split_modules  # what matching type(m).__name__ missed

    CountingLayer.calls = 0
    model.train().activation_checkpointing_enable()
    assert model.is_activation_checkpointing and all(layer._checkpointed for layer in model.model.layers)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()
    assert CountingLayer.calls == 2  # the forward, and its recompute in the backward
    model.activation_checkpointing_disable()
    assert not model.is_activation_checkpointing and "forward" not in model.model.layers[1].__dict__


def test_a_model_names_its_layer_class_once():
    class CountingLlama(LlamaForCausalLM):
        decoder_layer_class = CountingLayer

    assert CountingLlama.decoder_layer_classes == (CountingLayer,)
    assert CountingLlama.no_split_modules == ("CountingLayer",)
    model = _tiny_llama(CountingLlama)
    assert model.no_split_modules == ("CountingLayer",)
    assert [type(layer) for layer in decoder_layers(model)] == [CountingLayer] * 3


def test_a_family_with_two_kinds_of_layer_names_both():
    class OtherBlock(nn.Module):
        pass

    class TwoKinds(LlamaForCausalLM):
        decoder_layer_classes = (LlamaDecoderLayer, OtherBlock)

    assert TwoKinds.no_split_modules == ("LlamaDecoderLayer", "OtherBlock")
    model = _tiny_llama(TwoKinds)
    model.model.layers.append(OtherBlock())
    assert [type(layer) for layer in decoder_layers(model)] == [LlamaDecoderLayer] * 3 + [OtherBlock]


@pytest.mark.parametrize("model_type", sorted(MODEL_TYPES))
def test_every_family_derives_no_split_modules_from_its_layer_class(model_type):
    family = causal_lm_class(model_type)
    layer = family.decoder_layer_class
    assert isinstance(layer, type) and issubclass(layer, nn.Module)
    for model_class in (family, base_model_class(family), sequence_classification_class(family)):
        assert model_class.decoder_layer_classes == (layer,)
        assert model_class.no_split_modules == (layer.__name__,)


def test_a_module_without_layer_classes_has_none():
    model = nn.Sequential(nn.Linear(2, 2))
    assert decoder_layers(model) == []
    with pytest.raises(ValueError, match="gradient_checkpointing=True but Sequential names no decoder layer class"):
        checkpoint_decoder_layers(model, "gradient_checkpointing")
    uncheckpoint_decoder_layers(model)  # nothing to undo
