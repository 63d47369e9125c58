"""PEFT's DoRA (LoraConfig(use_dora=True)) on a targeted nn.Linear, op by op in bytes (peft 0.21
peft/tuners/lora/variants.py DoraLinearVariant.forward, peft/tuners/lora/dora.py DoraLinearLayer.forward).

Liu et al. 2024 (arXiv:2402.09353) eq. 5: W' = m · (W + s·BA) / ||W + s·BA||_c, the norm detached (their
sec. 4.3). PEFT computes it at every forward, from the whole matrices:
  lora_weight  lora_B(lora_A(eye(in))).T: an in x in identity in the adapters' dtype, its product (in, r)
               and (in, out), through the adapters' graph (lora_A saves the identity, lora_B the product),
               held until forward returns though only its detached copy is used
  weight       the base weight cast to the input's dtype (the adapters' fp32): a copy of the whole matrix
  weight_norm  ||weight + scaling · lora_weight|| over each row: two more (out, in) temporaries, freed
  result       (m / weight_norm - 1) · base_result + (m / weight_norm) · lora_B(lora_A(x)) · scaling,
               each product saving its operands; base_result is the base layer's output (less its bias),
               or, with lora_dropout > 0, F.linear(dropout(x), weight), which saves the fp32 weight copy
So a DoRA layer's forward briefly holds an in x in and several out x in fp32 matrices beside LoRA's own.
"""

from __future__ import annotations

from .. import aten
from ..aten.operands import made
from ..sim.graph import Graph
from ..sim.tensors import Tensor
from .attention import dropout


def dora_result(g: Graph, weight: Tensor, bias: Tensor | None, magnitude: Tensor, a: Tensor, b: Tensor,
                x: Tensor, result: Tensor, p: float) -> Tensor:  # fmt: skip
    """DoraLinearVariant.forward: result + DoRA's term, x already cast to the adapters' dtype."""
    if p > 0:  # the base result is recomputed from the dropped input
        x, base = dropout(g, x, p), None
    else:
        base = result
    return aten.add(g, result, dora_term(g, weight, bias, magnitude, a, b, x, base))


def dora_term(g: Graph, weight: Tensor, bias: Tensor | None, magnitude: Tensor, a: Tensor, b: Tensor, x: Tensor,
              base: Tensor | None) -> Tensor:  # fmt: skip
    """DoraLinearLayer.forward (see the module); its locals die as it returns."""
    lora_weight = aten.to(g, get_lora_weight(g, a, b), x.dtype)
    w = aten.to(g, weight, x.dtype)
    weight_norm = row_norm(g, w, g.view(lora_weight, lora_weight.shape))  # its .detach()
    mag_norm_scale = aten.view(g, aten.div_tensor(g, magnitude, weight_norm), (1, magnitude.shape[0]))
    lora_result = aten.linear(g, aten.linear(g, x, a, None), b, None)
    if base is not None and bias is not None:
        base = aten.sub(g, base, bias)  # base_result - bias
    elif base is None:
        base = aten.linear(g, x, w, None)
    scaled_base = aten.mul(g, aten.sub_scalar(g, mag_norm_scale), base)
    scaled_lora = aten.mul_scalar(g, aten.mul(g, mag_norm_scale, lora_result))
    return aten.add(g, scaled_base, scaled_lora)


def get_lora_weight(g: Graph, a: Tensor, b: Tensor) -> Tensor:
    """DoraLinearLayer.get_lora_weight: lora_B(lora_A(x_eye)).T, the identity a local until it returns."""
    x_eye = made(g, (a.shape[1], a.shape[1]), "eye", dtype=a.dtype)
    return aten.t(g, aten.linear(g, aten.linear(g, x_eye, a, None), b, None))


def row_norm(g: Graph, weight: Tensor, lora_weight: Tensor) -> Tensor:
    """DoraLinearLayer.get_weight_norm: ||weight + scaling · lora_weight|| over dim 1; the sum and the scaled
    copy die as it returns."""
    return aten.vector_norm_rows(g, aten.add(g, weight, aten.mul_scalar(g, lora_weight)))
