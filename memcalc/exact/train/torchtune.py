"""torchtune's single-device training loop in bytes (pytorch/torchtune @ v0.6.1 recipes/full_finetune_single_device.py
and lora_finetune_single_device.py, train()), as verify/torchtune.py runs it:

    current_num_tokens = (batch["labels"] != ignore_index).sum()
    num_tokens += current_num_tokens
    current_loss = self._loss_step(batch) * current_num_tokens
    running_loss += current_loss
    current_loss.backward()
    if not optimizer_in_bwd:
        training.scale_grads(model, 1 / num_tokens)      # p.grad *= scaler, in place
        optimizer.step(); optimizer.zero_grad(set_to_none=True)
    running_loss = 0; num_tokens = 0

With optimizer_in_bwd (torchtune/training/memory.py register_optim_in_bwd_hooks) each parameter has its own optimizer,
stepped and zeroed from a post-accumulate-grad hook the moment its gradient is made, so at most one gradient lives.
"""

from __future__ import annotations

from .. import aten
from ..aten.operands import made
from ..sim.graph import Graph, layer_of
from ..sim.tensors import Tensor
from ..torchtune.model import TTModel, loss_step
from .optimizers import library_optimizer


class TorchtuneRecipe:
    """The recipe's train() step over the model's own bf16 parameters (no master), its optimizer (cfg.optimizer,
    cfg.impl), one per parameter under optimizer_in_bwd."""

    def __init__(self, g: Graph, m: TTModel):
        self.g, self.model, self.params = g, m, m.params
        cfg = m.cfg
        self.in_backward = cfg.stack.in_backward
        if self.in_backward:  # {p: config.instantiate(cfg_optimizer, [p]) for p in model.parameters()}
            self.optimizers = {id(p): library_optimizer(g, [p], cfg.optimizer, cfg.impl, cfg.device)
                               for p in self.params}
        else:
            self.optimizer = library_optimizer(g, self.params, cfg.optimizer, cfg.impl, cfg.device)
        # self.ignore_labels_cache = torch.full((cfg.batch_size, 1), ignore_index, device=self._device)
        self.ignore_cache = g.empty((cfg.micro_batch, 1), "int64", "full", kind="state")
        self.num_tokens: Tensor | None = None
        self.current_num_tokens: Tensor | None = None
        self.running_loss: Tensor | None = None
        m.loop = self

    @property
    def unified_bytes(self) -> int:
        """What the optimizers hold in unified memory (bitsandbytes' paged state)."""
        optimizers = self.optimizers.values() if self.in_backward else [self.optimizer]
        return sum(getattr(o, "unified_bytes", 0) for o in optimizers)

    def forward(self, idx: Tensor, labels: Tensor) -> Tensor:
        g = self.g
        B, T = labels.shape
        with g.scoped("loss"):
            ne = made(g, (B, T), "ne", labels, dtype="bool")
            self.current_num_tokens = made(g, (), "sum", ne, dtype="int64")
            del ne
            if self.num_tokens is None:  # 0 + tensor: a new one; later micro-batches add in place
                self.num_tokens = made(g, (), "add", self.current_num_tokens, dtype="int64")
            else:
                g.kernel("add_", (self.num_tokens, self.current_num_tokens), (self.num_tokens,))
        loss = loss_step(g, self.model, idx, labels, self.ignore_cache)
        with g.scoped("loss"):
            current_loss = aten.mul(g, loss, self.current_num_tokens)  # MulBackward0 saves the count
            del loss
            if self.running_loss is None:
                self.running_loss = made(g, (), "add", current_loss)  # running_loss (0) += current_loss
            else:
                g.kernel("add_", (self.running_loss, current_loss), (self.running_loss,))
        return current_loss

    def backward(self, loss: Tensor) -> None:
        g = self.g
        if self.in_backward:
            g.post_accumulate = self.step_in_backward
        try:
            g.backward(loss)
        finally:
            g.post_accumulate = None

    def step_in_backward(self, p: Tensor) -> None:
        """register_optim_in_bwd_hooks' optim_step(param): optim_dict[param].step(), then .zero_grad()."""
        outer = self.g.layer, self.g.stage
        self.g.stage = "optimizer"
        self.optimizers[id(p)].step()
        p.grad = None
        self.g.layer, self.g.stage = outer

    def update(self) -> None:
        g = self.g
        g.stage = "optimizer"
        if not self.in_backward:
            scaler = made(g, (), "mul", made(g, (), "reciprocal", self.num_tokens))  # 1 / num_tokens
            for p in self.params:  # training.scale_grads: p.grad *= scaler
                if p.grad is not None:
                    g.layer = layer_of(p.name)
                    g.kernel("mul_", (p.grad, scaler), (p.grad,))
            del scaler
            g.layer = None
            self.optimizer.step()
            for p in self.params:  # optimizer.zero_grad(set_to_none=True)
                p.grad = None
        self.running_loss = self.num_tokens = None  # running_loss = 0; num_tokens = 0
        g.layer, g.stage = None, "forward"
