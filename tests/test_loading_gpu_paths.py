"""Device and loading paths taken only on CUDA, checked on the CPU with a simulated torch.cuda: which GPU "cuda" means
under torchrun, the free memory device_map="auto" plans with, and the size it plans bitsandbytes layers at."""

from __future__ import annotations

import pytest
import torch

from gpuformers.device import resolve_device
from gpuformers.loading.device_plan import available_memory, module_tree, plan_device_map, tied_groups
from gpuformers.models.config import ModelConfig
from gpuformers.models.modeling import skip_init
from gpuformers.models.registry import model_class_for

GIB = 2**30


class FakeCuda:
    """The part of torch.cuda that device.py and device_plan.py read: `count` GPUs with 80 GiB each."""

    def __init__(self, count: int, current: int = 0, free=None, reserved=None, allocated=None):
        self.count, self.current = count, current
        self.free, self.reserved, self.allocated = free or {}, reserved or {}, allocated or {}

    def is_available(self):
        return self.count > 0

    def device_count(self):
        return self.count

    def current_device(self):
        return self.current

    def mem_get_info(self, index):
        return self.free.get(index, 80 * GIB), 80 * GIB

    def memory_reserved(self, index):
        return self.reserved.get(index, 0)

    def memory_allocated(self, index):
        return self.allocated.get(index, 0)


def test_cuda_under_torchrun_is_the_process_gpu(monkeypatch):
    """A model loaded with device_map="cuda" before the Trainer calls set_device must land on cuda:LOCAL_RANK, not
    on cuda:0 in every process (8 copies of the model on GPU 0)."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert resolve_device("cuda", cuda=FakeCuda(4)) == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert resolve_device("cuda", cuda=FakeCuda(4)) == torch.device("cuda", 2)
    assert resolve_device({"": "cuda"}, cuda=FakeCuda(4)) == torch.device("cuda", 2)
    assert resolve_device("cuda:1", cuda=FakeCuda(4)) == torch.device("cuda", 1)  # an index is kept
    # set_device already called: the current device wins
    assert resolve_device("cuda", cuda=FakeCuda(4, current=3)) == torch.device("cuda", 3)
    # one GPU per process (CUDA_VISIBLE_DEVICES set per process by the launcher): its only GPU
    assert resolve_device("cuda", cuda=FakeCuda(1)) == torch.device("cuda", 0)


def test_available_memory_counts_what_the_allocator_caches_unused():
    """Memory this process's caching allocator holds but does not use (a model loaded then deleted) is free for the
    next load, though the driver reports it taken."""
    cuda = FakeCuda(2, free={0: 10 * GIB, 1: 30 * GIB}, reserved={0: 50 * GIB}, allocated={0: 20 * GIB})
    limits = available_memory(cuda)
    assert limits[0] == 40 * GIB and limits[1] == 30 * GIB and limits["cpu"] > 0


def _meta_model():
    config = ModelConfig.from_dict(dict(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=False))
    with torch.device("meta"), skip_init():
        return model_class_for(config)(config)


@pytest.mark.parametrize("settings, bytes_per_weight", [(dict(load_in_4bit=True), 0.5), (dict(load_in_8bit=True), 1)])
def test_bitsandbytes_layers_are_planned_at_their_quantized_size(settings, bytes_per_weight):
    """device_map="auto" with load_in_4bit: the layers' weights are sized as stored (4 bits), not in the model dtype,
    so a 4-bit model that fits on the GPU is planned there whole instead of being offloaded (transformers' sizes)."""
    pytest.importorskip("bitsandbytes")
    from gpuformers.quantization.config import BitsAndBytesConfig, quantize_linear_layers

    model = _meta_model()
    full = module_tree(model, torch.bfloat16, model.no_split_modules).size
    quantized = quantize_linear_layers(model, BitsAndBytesConfig(**settings), torch.bfloat16)
    weights = sum(model.get_submodule(name).weight.numel() for name in quantized)
    tree = module_tree(model, torch.bfloat16, model.no_split_modules)
    assert tree.size == full - weights * 2 + int(weights * bytes_per_weight)
    layer = next(n for n in tree.walk() if n.name == "model.layers.0")
    assert layer.size < 36864 * 2  # the layer's 36864 linear weights, at less than their bfloat16 size
    plan = plan_device_map(tree, {0: int(tree.size * 1.05), "cpu": 100 * tree.size}, strategy="auto",
                           tied=tied_groups(model))
    assert plan == {"": 0}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_4bit_model_that_fits_the_gpu_loads_there_whole(tmp_path):
    """From the checkpoint to the GPU: device_map="auto" plans the 4-bit layers at their stored size, so a GPU that
    holds the quantized model (but not its bfloat16 size) gets all of it, quantized there, with the same logits."""
    pytest.importorskip("bitsandbytes")
    from gpuformers import AutoModelForCausalLM, BitsAndBytesConfig
    from tests.fixtures.checkpoints import make_checkpoint

    make_checkpoint(tmp_path, "llama", intermediate_size=128)
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)

    def load(device_map, **kwargs):
        return AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config, dtype=torch.bfloat16,
                                                    device_map=device_map, progress=False, **kwargs)

    whole = load("cuda")
    stored = sum(t.numel() * t.element_size() for t in whole.state_dict().values())  # about 40% of bfloat16's
    planned = load("auto", max_memory={0: int(stored * 1.5), "cpu": 100 * stored})
    assert set(planned.hf_device_map.values()) == {0}, planned.hf_device_map
    assert planned.model.layers[0].mlp.up_proj.weight.device.type == "cuda"
    ids = torch.tensor([[1, 5, 9, 23, 42, 7]], device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(planned(ids).logits, whole(ids).logits)
