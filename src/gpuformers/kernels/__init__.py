"""Fused Triton kernels that `use_kernels=True` swaps into a model, each beside its torch reference.

Files: rms_norm.py (RMSNorm and fused residual-add + RMSNorm), swiglu.py (SiLU and SiLU-and-mul), rotary.py
(rotary embedding of q and k), attention.py (FlashAttention-style forward and backward), fused_linear_cross_entropy.py
(linear + cross-entropy without the full logits, and cross-entropy over given logits), moe.py (the mixture-of-experts
block as two grouped GEMMs), weight_only_matmul.py (int8 / int4 weight-only matmul for quantization/weight_only.py),
ops.py (each kernel as a torch.library op, `torch.ops.gpuformers.*`, which the kernel functions call under
torch.compile), mapping.py (KernelConfig, Mode, kernelize, the layer-name registry), checks.py (launcher checks and
"can Triton run here").

Importing this package does not import triton; the kernel files do, when first used (and register the ops).

Offers: KernelConfig, Mode, kernelize, kernels_available.
"""

from gpuformers.kernels.mapping import KernelConfig, Mode, kernelize, kernels_available

__all__ = ["KernelConfig", "Mode", "kernelize", "kernels_available"]
