"""What decides the bytes of a simulated training step: the model, its size, the trick set, the stack."""

from __future__ import annotations

from dataclasses import dataclass

from memcalc.model.shape import ModelShape


@dataclass(frozen=True)
class Config:
    """What decides the bytes of a training step."""

    shape: ModelShape
    seq_len: int
    micro_batch: int
    precision: str  # fp32 | bf16 | fp16
    flash: bool  # attention by the flash kernel (aten._scaled_dot_product_flash_attention)
    recompute: str  # none | selective | full
    grad_accum: int = 1  # micro-batches per optimizer step
    optimizer: str = "adamw"  # adamw | sgd | adam8bit
    model: str = "reference"  # whose op sequence (memcalc.model.stacks): reference | hf
    recipe: str = "master"  # how a 16-bit precision trains: master | autocast | pure
    impl: str = "reference"  # the optimizer's implementation: reference | loop | foreach | fused
    # whose kernels and autocast lists: cuda (the prediction), or cpu to hold the simulator against a
    # measurement on CPU tensors (verify/autocast.py): CPU's flash kernel saves no RNG state
    device: str = "cuda"

    @property
    def dtype(self) -> str:
        """The parameters' and activations' dtype: the precision's name is the sim's dtype name."""
        return self.precision

    @property
    def weights_dtype(self) -> str:
        """The parameters' dtype: fp32 under autocast (torch.autocast casts them per op), else the
        precision's."""
        return "fp32" if self.recipe == "autocast" else self.precision
