"""torchtune's single-device recipes on meta or CPU tensors, as memcalc.exact.torchtune replays them (torchtune 0.6.1).

    with training.set_default_dtype(torch.bfloat16), device:
        model = llama3_1(...) or lora_llama3_1(..., quantize_base=QLoRA)     # the builder of the preset
    set_trainable_params(model, get_adapter_params(model))                  # LoRA: the adapters alone
    set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})   # with ckpt
    model.set_num_output_chunks(loss_fn.num_output_chunks)                   # CEWithChunkedOutputLoss

then TorchtuneRecipe runs train()'s lines (recipes/full_finetune_single_device.py, lora_finetune_single_device.py).
torchtune 0.6.1 imports torchao.dtypes.nf4tensor, which torchao 0.18 moved to
torchao/quantization/quantize_/workflows/nf4/nf4_tensor.py (the same NF4Tensor): torchtune() aliases the old name.
On meta, Llama3ScaledRoPE.rope_init returns before building its cache (freqs.is_meta): the harness builds theta and
the cache as rope_init does on a device. SDPA is called as CUDA runs it in 16 bits with no mask: its flash kernel.
"""

from __future__ import annotations

import importlib
import sys
import types

import torch
from torch import nn

from memcalc.errors import InputError
from memcalc.exact.torchtune.model import CHUNKS, IGNORE_INDEX, NAMES, builder
from memcalc.model.finetune import HEAD
from memcalc.model.shape import ModelShape
from memcalc.model.stacks import Stack
from memcalc.model.tricks import Tricks

from .recipes import fused_on_meta, library_optimizer


def torchtune():
    """The installed torchtune (with torchao's NF4Tensor under the name it imports), or a one-line error."""
    if "torchao.dtypes.nf4tensor" not in sys.modules:
        try:
            importlib.import_module("torchao.dtypes.nf4tensor")
        except ImportError:
            sys.modules["torchao.dtypes.nf4tensor"] = importlib.import_module(
                "torchao.quantization.quantize_.workflows.nf4.nf4_tensor")  # fmt: skip
    try:
        import torchtune as lib
    except ImportError:
        raise InputError("--stack torchtune is measured with torchtune: pip install torchtune==0.6.1") from None
    try:
        importlib.import_module("torchtune.training.quantization")
    except ImportError:  # its QAT quantizers import torchao names 0.18 dropped; no recipe here quantizes so
        stub = types.ModuleType("torchtune.training.quantization")
        stub.get_quantizer_mode = lambda quantizer: None  # the one name torchtune/training/__init__.py imports
        sys.modules["torchtune.training.quantization"] = stub
    return lib


def build_torchtune(shape: ModelShape, tricks: Tricks, stack: Stack, device: str = "meta") -> nn.Module:
    """The preset's builder at the shape's sizes, LoRA'd as the stack's fine-tuning says, on the device in bf16."""
    torchtune()
    from torchtune import modules, training
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    name, max_seq_len, _ = builder(shape)
    family = name.rsplit("_", 1)[0]  # llama3_1_8b -> llama3_1
    builders = importlib.import_module(f"torchtune.models.{family}._component_builders")
    ft = stack.finetune
    common = dict(vocab_size=shape.vocab, num_layers=shape.n_layers, num_heads=shape.n_heads,
                  num_kv_heads=shape.n_kv_heads, embed_dim=shape.hidden, max_seq_len=max_seq_len,
                  intermediate_dim=shape.ffn)  # fmt: skip
    if family == "llama3_2":
        common["tie_word_embeddings"] = shape.tied_embeddings
    with training.set_default_dtype(torch.bfloat16), torch.device(device):
        if ft.lora:
            attn = [NAMES[t].split(".")[1] for t in ft.targets if NAMES.get(t, "").startswith("attn.")]
            mlp = any(NAMES.get(t, "").startswith("mlp.") for t in ft.targets)
            model = getattr(builders, f"lora_{family}")(
                lora_attn_modules=attn, apply_lora_to_mlp=mlp, apply_lora_to_output=HEAD in ft.targets,
                lora_rank=ft.lora_rank,
                lora_alpha=ft.lora_alpha, lora_dropout=ft.lora_dropout, quantize_base=bool(ft.quantize), **common)
        else:
            model = getattr(builders, family)(**common)
    if device == "meta":
        build_rope_caches(model)
    if ft.lora:
        set_trainable_params(model, get_adapter_params(model))
    if tricks.recompute == "full":
        training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
    if stack.loss == "chunked":
        model.set_num_output_chunks(CHUNKS)
    for m in model.modules():
        if isinstance(m, modules.MultiHeadAttention):
            m._attention_call = flash_attention_call
    model.torchtune = True
    return model


def build_rope_caches(model: nn.Module) -> None:
    """Llama3ScaledRoPE.rope_init on meta: theta (dim / 2, fp32) and build_rope_cache(max_seq_len)."""
    for m in model.modules():
        if hasattr(m, "is_cache_built") and not m.is_cache_built:
            m.register_buffer("theta", torch.empty(m.dim // 2, dtype=torch.float32, device="meta"), persistent=False)
            m.build_rope_cache(m.max_seq_len)
            m.is_cache_built = True


def flash_attention_call(q, k, v, mask, dropout_p: float, is_causal: bool) -> torch.Tensor:
    """attention_utils._sdpa_or_flex_attention's call with no mask: F.scaled_dot_product_attention(is_causal=True),
    whose CUDA backend for 16-bit q, k, v is the flash kernel, this op."""
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False)[0]


def device_tensors(model: nn.Module) -> list[torch.Tensor]:
    """What the model holds on its device: plain parameters and buffers, and each NF4Tensor's inner tensors (its
    wrapper reports the dequantised size but holds nothing)."""
    out = []
    for p in model.parameters():
        if hasattr(p, "quantized_data"):
            out += [p.quantized_data, p.quantized_scalers, p.quantization_factor, p.scaler_mean, p.nf4]
        else:
            out.append(p)
    return out + list(model.buffers())


class TorchtuneRecipe:
    """train()'s step: tokens count, _loss_step times the count, running_loss, backward; then scale_grads, the
    optimizer's step and zero_grad, or the per-parameter optimizers stepped in backward (optimizer_in_bwd)."""

    def __init__(self, model: nn.Module, optimizer: str, stack: Stack):
        from torchtune.modules.loss import CEWithChunkedOutputLoss
        from torchtune.training import register_optim_in_bwd_hooks

        self.model, self.stack = model, stack
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.loss_fn = CEWithChunkedOutputLoss(CHUNKS) if stack.loss == "chunked" else nn.CrossEntropyLoss()
        self.in_backward = stack.in_backward
        if self.in_backward:
            optim_dict = {p: library_optimizer([p], optimizer, stack.impl) for p in self.params}
            register_optim_in_bwd_hooks(model, optim_dict)
        else:
            self.optimizer = library_optimizer(self.params, optimizer, stack.impl)
        device = self.params[0].device
        self.on_meta = stack.impl == "fused" and device.type == "meta"  # torch.optim's fused check (recipes.py)
        self.ignore_labels_cache = None  # the recipe's setup makes it at cfg.batch_size: here at the first batch's
        self.device = device
        self.running_loss, self.num_tokens = 0, 0
        self.current_num_tokens = None
        self.skipped = 0

    def loss_step(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """_loss_step(batch)."""
        logits = self.model(tokens)
        if self.ignore_labels_cache is None:  # before the measured step, as the recipe's setup is
            self.ignore_labels_cache = torch.full((labels.shape[0], 1), IGNORE_INDEX, device=self.device)
        labels = torch.hstack((labels[..., 1:], self.ignore_labels_cache[: labels.shape[0]]))
        if not isinstance(logits, list):
            labels = labels.reshape(-1)
            logits = logits.reshape(-1, logits.size(-1))
        loss = self.loss_fn(logits, labels)
        del logits
        return loss

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.current_num_tokens = (labels != IGNORE_INDEX).sum()
        self.num_tokens += self.current_num_tokens
        current_loss = self.loss_step(tokens, labels) * self.current_num_tokens
        self.running_loss += current_loss
        return current_loss

    def backward(self, loss: torch.Tensor) -> None:
        with fused_on_meta(self.on_meta and self.in_backward):  # optimizer_in_bwd steps from backward's hooks
            loss.backward()

    def update(self) -> bool:
        if not self.in_backward:
            from torchtune.training import scale_grads

            scale_grads(self.model, 1 / self.num_tokens)
            with fused_on_meta(self.on_meta):
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.running_loss, self.num_tokens = 0, 0
        return True
