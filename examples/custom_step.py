"""Your own model and step, measured by memcalc: a Llama-3-8B written from scratch in plain PyTorch.

    memcalc verify --step examples/custom_step.py:build --model llama3-8b --tricks fp32 --seq 2048 \
        --stack torch --optimizer-impl loop

memcalc calls build(device, seq_len, micro_batch) under the device (meta: nothing is allocated, the
full 8B model is measured on a laptop), runs one warm-up step and measures the next: model state,
what forward saves for backward, each phase's peak. Beside it, memcalc's prediction for the stack.

Set CUSTOM_STEP_LAYERS to build fewer layers (tests do).
"""

import os

import torch
import torch.nn.functional as F
from torch import nn

LAYERS = int(os.environ.get("CUSTOM_STEP_LAYERS", "32"))
HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, THETA = 4096, 32, 8, 14336, 128256, 500000.0  # Llama 3 8B


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = HIDDEN // HEADS
        self.attn_norm, self.ffn_norm = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)
        self.wq = nn.Linear(HIDDEN, HEADS * self.head_dim, bias=False)
        self.wkv = nn.Linear(HIDDEN, 2 * KV_HEADS * self.head_dim, bias=False)
        self.wo = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.w13 = nn.Linear(HIDDEN, 2 * FFN, bias=False)  # gate and up in one matmul
        self.w2 = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(b, s, HEADS, self.head_dim)
        k, v = self.wkv(h).view(b, s, 2, KV_HEADS, self.head_dim).unbind(2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=True)  # fmt: skip
        x = x + self.wo(y.transpose(1, 2).reshape(b, s, HIDDEN))
        gate, up = self.w13(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


def rotate(x, cos, sin):
    """RoPE on the halves of each head (Su et al. 2021, as Hugging Face's Llama does it)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Llama(nn.Module):
    def __init__(self, seq_len):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(HIDDEN)
        self.out = nn.Linear(HIDDEN, VOCAB, bias=False)
        head_dim = HIDDEN // HEADS
        freqs = THETA ** -(torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs).repeat(1, 2)[None, :, None, :]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        return self.out(self.norm(x))


def build(device, seq_len, micro_batch):
    """What memcalc verify --step calls: (model, optimizer, loss), loss() one forward to the scalar loss."""
    model = Llama(seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=False)
    idx = torch.randint(0, VOCAB, (micro_batch, seq_len), device=device)
    targets = torch.randint(0, VOCAB, (micro_batch, seq_len), device=device)

    def loss():
        logits = model(idx)
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))

    return model, optimizer, loss
