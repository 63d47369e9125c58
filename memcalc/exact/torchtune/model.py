"""torchtune's TransformerDecoder as its recipes build and call it, op by op in bytes (pytorch/torchtune @ v0.6.1:
torchtune/modules/transformer.py, torchtune/models/llama*/_component_builders.py and _model_builders.py,
torchtune/modules/loss/ce_chunked_output_loss.py, recipes/lora_finetune_single_device.py and
full_finetune_single_device.py _loss_step).

The recipes build the model under training.set_default_dtype(dtype): every weight, LoRA's adapters too, in the
config's dtype (bf16), no autocast and no master copy; the rotary tables are fp32 (rope_init's .float()).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memcalc.errors import InputError
from memcalc.model.finetune import HEAD, missing_targets
from memcalc.model.shape import ModelShape

from .. import aten
from ..aten.operands import made
from ..base.config import StepConfig
from ..hf.lora import dropout
from ..sim.graph import Graph
from ..sim.tensors import Tensor
from . import nf4
from .modules import layer, linear, rms_norm

# the builders each preset is (torchtune/models/<family>/_model_builders.py): max_seq_len, which sizes the rotary
# cache, and whether the LoRA builder makes one RoPE module per layer (lora_llama2_self_attention and
# lora_llama3_self_attention build their own; lora_llama3_1 and lora_llama3_2 share one, as the plain builders do)
BUILDERS = {
    "llama2-7b": ("llama2_7b", 4096, True), "llama2-13b": ("llama2_13b", 4096, True),
    "llama2-70b": ("llama2_70b", 4096, True), "llama3-8b": ("llama3_8b", 8192, True),
    "llama3-70b": ("llama3_70b", 8192, True), "llama3.1-8b": ("llama3_1_8b", 131072, False),
    "llama3.1-70b": ("llama3_1_70b", 131072, False), "llama3.1-405b": ("llama3_1_405b", 131072, False),
    "llama3.2-1b": ("llama3_2_1b", 131072, False), "llama3.2-3b": ("llama3_2_3b", 131072, False),
}  # fmt: skip
# Transformers' projection names (memcalc.model.finetune.PROJECTIONS) as torchtune's modules name them
NAMES = {"q_proj": "attn.q_proj", "k_proj": "attn.k_proj", "v_proj": "attn.v_proj", "o_proj": "attn.output_proj",
         "gate_proj": "mlp.w1", "down_proj": "mlp.w2", "up_proj": "mlp.w3"}  # fmt: skip
CHUNKS = 8  # CEWithChunkedOutputLoss(num_output_chunks=8); the recipe sets model.num_output_chunks to it
IGNORE_INDEX = -100


@dataclass
class TTModel:
    cfg: StepConfig
    p: dict[str, Tensor]  # the parameters by name (an NF4 weight: its quantized_data)
    buffers: list[Tensor]
    rope_cache: Tensor  # the (max_seq_len, head_dim / 2, 2) fp32 cache every layer reads (the first layer's)
    params: list[Tensor] = field(default_factory=list)  # those that train, in parameters() order
    quant: dict = field(default_factory=dict)  # QLoRA: each NF4 projection's NF4Weight, by module name
    held: list[Tensor] = field(default_factory=list)  # the NF4 weights' inner tensors besides quantized_data
    autocast: None = None  # no autocast: the recipes train the model in its dtype
    loop: object = None  # the recipe's training loop (memcalc.exact.train.torchtune), which calls the loss step


def builder(shape: ModelShape) -> tuple[str, int, bool]:
    """The torchtune builder of this preset (its component builder takes the sizes, --layers and the like
    changed too), or a one-line refusal."""
    if preset_of(shape) not in BUILDERS:
        raise InputError(finetune_not_replayed(None, shape))
    return BUILDERS[preset_of(shape)]


def preset_of(shape: ModelShape) -> str:
    """The preset a shape was made from: its name, less the mark of sizes changed (memcalc.model.shape)."""
    return shape.name.removesuffix(" (modified)")


def finetune_not_replayed(finetune, shape: ModelShape) -> str | None:
    """Why the torchtune replay cannot run this job, or None: its Llama builders, LoRA (lora_attn_modules,
    apply_lora_to_mlp) or QLoRA (quantize_base: torchao's NF4), not frozen parts of a full fine-tune."""
    if preset_of(shape) not in BUILDERS:
        return (f"--stack torchtune replays torchtune's Llama builders ({', '.join(BUILDERS)}), not "
                f"{shape.name}")  # fmt: skip
    if finetune.freeze or finetune.frozen_blocks:
        return "--freeze: torchtune's full fine-tuning recipe trains every weight (--stack hf freezes parts)"
    missing = missing_targets("llama", finetune)  # its Llama builders' blocks: q, k, v, output_proj, w1, w2, w3
    if missing:
        return missing
    if finetune.quantize not in ("", "nf4"):
        return f"--quantize {finetune.quantize}: torchtune's QLoRA is torchao's NF4 (nf4), no other"
    return None


def modules(shape: ModelShape) -> list[tuple[str, tuple[int, int]]]:
    """One block's linear modules in registration order (MultiHeadAttention's q, k, v, output_proj; FeedForward's
    w1, w2, w3), (out, in) each."""
    h, f = shape.hidden, shape.ffn
    return [("attn.q_proj", (shape.q_dim, h)), ("attn.k_proj", (shape.kv_dim, h)), ("attn.v_proj", (shape.kv_dim, h)),
            ("attn.output_proj", (h, shape.q_dim)), ("mlp.w1", (f, h)), ("mlp.w2", (h, f)),
            ("mlp.w3", (f, h))]  # fmt: skip


def params(shape: ModelShape, lora_rank: int, targets: tuple[str, ...]) -> list[tuple[str, tuple]]:
    """named_parameters(): tok_embeddings, each layer's attn and mlp linears (a LoRALinear's weight, lora_a,
    lora_b), sa_norm and mlp_norm scales, then norm and the untied output (TiedLinear holds none)."""
    wrapped = {NAMES[t] for t in targets if t in NAMES} if lora_rank else set()
    out = [("tok_embeddings.weight", (shape.vocab, shape.hidden))]
    for i in range(shape.n_layers):
        n = f"layers.{i}."
        for name, (rows, cols) in modules(shape):
            out.append((n + name + ".weight", (rows, cols)))
            if name in wrapped:
                out += [(n + name + ".lora_a.weight", (lora_rank, cols)),
                        (n + name + ".lora_b.weight", (rows, lora_rank))]
        out += [(n + "sa_norm.scale", (shape.hidden,)), (n + "mlp_norm.scale", (shape.hidden,))]
    out.append(("norm.scale", (shape.hidden,)))
    if shape.tied_embeddings:
        return out
    out.append(("output.weight", (shape.vocab, shape.hidden)))
    if lora_rank and HEAD in targets:  # apply_lora_to_output: LoRALinear(embed_dim, vocab_size)
        out += [("output.lora_a.weight", (lora_rank, shape.hidden)), ("output.lora_b.weight", (shape.vocab, lora_rank))]
    return out


def trains(name: str, lora: bool) -> bool:
    """LoRA: set_trainable_params(model, get_adapter_params(model)), the adapters alone; else every weight."""
    return ".lora_" in name if lora else True


def build(g: Graph, cfg: StepConfig) -> TTModel:
    """The model on the device in the config's dtype; QLoRA's projections as NF4Tensors (every block linear:
    FrozenNF4Linear or LoRALinear(quantize_base=True)); the rotary buffers theta and cache, one module shared by
    the layers or one per layer (BUILDERS)."""
    s, ft = cfg.shape, cfg.finetune
    _, max_seq_len, per_layer = builder(s)
    dtype = cfg.precision
    p, quant, held = {}, {}, []
    for name, shape in params(s, ft.lora_rank, ft.targets):
        module = name.removesuffix(".weight")
        if ft.quantize and ".lora_" not in name and module.rpartition("layers.")[2].partition(".")[2] in \
                dict(modules(s)):  # fmt: skip
            quant[module] = nf4.to_nf4(g, name, shape, dtype)
            held += [quant[module].scalers, quant[module].factor, quant[module].mean, quant[module].code]
            p[name] = quant[module].data
        elif trains(name, ft.lora):
            p[name] = g.param(shape, dtype, name)
        else:
            p[name] = g.empty(shape, dtype, "param " + name, kind="param")
            p[name].name = name
    ropes = s.n_layers if ft.lora and per_layer else 1
    buffers = []
    for _ in range(ropes):  # theta (head_dim / 2) and cache (max_seq_len, head_dim / 2, 2), fp32
        buffers += [g.empty((s.head_dim // 2,), "fp32", "buffer theta", kind="buffer"),
                    g.empty((max_seq_len, s.head_dim // 2, 2), "fp32", "buffer cache", kind="buffer")]  # fmt: skip
    trained = [t for t in p.values() if t.requires_grad]
    return TTModel(cfg, p, buffers, buffers[1], trained, quant, held)


def decoder(g: Graph, m: TTModel, tokens: Tensor) -> Tensor | list[Tensor]:
    """TransformerDecoder.forward(tokens): the embedding, the layers (each wrapped in checkpoint_wrapper under
    enable_activation_checkpointing: set_activation_checkpointing's non-reentrant checkpoint of
    TransformerSelfAttentionLayer), then unembed."""
    with g.scoped("embedding"):
        h = aten.embedding(g, m.p["tok_embeddings.weight"], tokens)
    for i in range(m.cfg.shape.n_layers):
        g.layer = i
        if m.cfg.recompute == "full":
            h = g.checkpoint(lambda x, i=i: layer(g, m, i, x), h)
        else:
            h = layer(g, m, i, h)
    g.layer = None
    return unembed(g, m, h)


def unembed(g: Graph, m: TTModel, h: Tensor) -> Tensor | list[Tensor]:
    """TransformerDecoder.unembed: norm; with num_output_chunks, [output(chunk) for chunk in h.chunk(n, dim=1)]
    (chunk_head: each chunk of a batch of more than one row is not contiguous), else
    output(h).float()."""
    h = rms_norm(g, h, m.p["norm.scale"], "final norm")
    head = m.p.get("output.weight") or m.p["tok_embeddings.weight"]  # TiedLinear: F.linear(x, tok_embeddings.weight)
    B, T, H = h.shape
    with g.scoped("logits"):
        if m.cfg.stack.loss != "chunked":
            return aten.to(g, linear(g, m, "output", h) if "output.weight" in m.p else aten.linear(g, h, head, None),
                           "fp32")  # fmt: skip
        chunks = []
        for chunk in aten.split(g, h, chunk_widths(T), 1):  # last_hidden_state.chunk(n, dim=1): views
            chunks.append(lora_head(g, m, chunk, T) if "output.lora_a.weight" in m.p else chunk_head(g, chunk, head, T))
            del chunk
        del h
        return chunks


def lora_head(g: Graph, m: TTModel, chunk: Tensor, T: int) -> Tensor:
    """LoRALinear.forward on a chunk (apply_lora_to_output): out = F.linear(x, weight); lora_a(dropout(x)), each
    product folded as at::matmul folds a chunk's (chunk_head); alpha / rank * lora_b(...); out + lora_out."""
    out = chunk_head(g, chunk, m.p["output.weight"], T)
    dropped = dropout(g, chunk, m.cfg.finetune.lora_dropout)  # nn.Identity at 0: the strided chunk itself
    down = chunk_head(g, dropped, m.p["output.lora_a.weight"], T) if dropped is chunk else \
        aten.linear(g, dropped, m.p["output.lora_a.weight"], None)  # fmt: skip
    del dropped
    lora_out = aten.mul_scalar(g, aten.linear(g, down, m.p["output.lora_b.weight"], None))
    del down
    return aten.add(g, out, lora_out)


def chunk_head(g: Graph, chunk: Tensor, head: Tensor, T: int) -> Tensor:
    """output(chunk), F.linear's matmul(chunk, w.t()), on a chunk of the sequence: its rows are strided (stride T·H
    over a batch of width-w chunks) unless the chunk is the whole sequence. at::matmul's should_fold folds a
    trained weight's product to 2-D (reshape: a copy of the chunk where more than one row is strided, then mm);
    with the weight frozen (LoRA) it folds only rows that view flat, else bmm(chunk, w.t().expand(B, in, out))."""
    B, width = chunk.shape[0], chunk.shape[1]
    if width == T:
        return aten.linear(g, chunk, head, None)
    if head.requires_grad:
        return aten.linear(g, aten.reshape_copy(g, chunk, chunk.shape) if B > 1 else chunk, head, None)
    wt = aten.t(g, head)
    return aten.bmm(g, chunk, aten.expand(g, wt, (B,) + wt.shape))


def chunk_widths(T: int) -> list[int]:
    """torch.chunk(T, 8) along the sequence: ceil(T / 8) each, the last the rest."""
    each = -(-int(T) // CHUNKS)
    return [min(each, int(T) - k) for k in range(0, int(T), each)]


def loss_step(g: Graph, m: TTModel, tokens: Tensor, labels: Tensor, ignore_cache: Tensor) -> Tensor:
    """The recipes' _loss_step: logits = model(tokens); labels = torch.hstack((labels[..., 1:],
    ignore_labels_cache[:B])); a list goes to CEWithChunkedOutputLoss, a tensor is flattened (views) for
    CrossEntropyLoss; del logits."""
    logits = decoder(g, m, tokens)
    B, T = labels.shape
    with g.scoped("loss"):
        shifted = made(g, (B, T), "cat", labels, ignore_cache, dtype="int64")  # hstack
        if isinstance(logits, list):
            loss = chunked_ce(g, logits, shifted)
        else:
            flat = aten.view(g, logits, (B * T, logits.shape[-1]))
            loss = aten.nll_loss(g, aten.log_softmax(g, flat), g.view(shifted, (B * T,)))  # F.cross_entropy, mean
            del flat
    del logits, shifted
    return loss


def add_(g: Graph, a: Tensor, b: Tensor) -> Tensor:
    """a += b on a tensor (add_, AddBackward0 on a's rebased history): no bytes; the gradient goes to both."""
    node = g.begin("add_", [a, b], lambda gs: [gs[0], gs[0]])
    g.kernel("add_", (a, b), (a,))
    g.end(node, [a])
    return a


def chunked_ce(g: Graph, logits: list[Tensor], labels: Tensor) -> Tensor:
    """CEWithChunkedOutputLoss.forward: total_elements = (labels != ignore_index).sum(); the labels chunked and
    reshaped (a copy each where a batch of several rows makes the chunk strided), the logits chunks viewed 2-D;
    per chunk F.cross_entropy(logits.float(), labels, reduction="sum") (the fp32 copy dies once log_softmax has
    saved its result); total_loss = 0.0 + each; total_loss / total_elements."""
    B, T = labels.shape
    ne = made(g, (B, T), "ne", labels, dtype="bool")
    total_elements = made(g, (), "sum", ne, dtype="int64")
    del ne
    targets = [g.view(labels, (B * w,)) if B == 1 else made(g, (B * w,), "clone", labels, dtype="int64")
               for w in chunk_widths(T)]  # fmt: skip
    flat = [aten.view(g, x, (x.shape[0] * x.shape[1], x.shape[2])) for x in logits]
    total_loss = None
    for logits_chunk, labels_chunk in zip(flat, targets):
        upcast = aten.to(g, logits_chunk, "fp32")
        ce = aten.nll_loss(g, aten.log_softmax(g, upcast), labels_chunk)
        del upcast
        total_loss = aten.add_scalar(g, ce) if total_loss is None else add_(g, total_loss, ce)  # 0.0 + ce, then +=
        del ce
    out = aten.div_tensor(g, total_loss, total_elements)
    del flat, targets, total_loss, total_elements
    return out
