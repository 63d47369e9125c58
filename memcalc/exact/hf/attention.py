"""What Transformers' decoders share around attention, op by op, in bytes on memcalc.exact.sim.graph:
  masking_utils.py                  create_causal_mask: the packed-sequence check, and for eager a
                                    (B, 1, T, T) additive mask held through forward
  ALL_ATTENTION_FUNCTIONS           verify/hf.py's interface on meta: sdpa's training path calling the
                                    flash op that CUDA's SDPA runs (aten._scaled_dot_product_flash_attention),
                                    or the model's eager path: modeling_llama.py eager_attention_forward
                                    (repeat_kv, softmax in fp32), modeling_gpt2.py eager_attention_forward
and where the gradients reaching q, k and v copy (grad_copies), and F.dropout as CUDA runs it.
"""

from __future__ import annotations

from memcalc.errors import InputError

from .. import aten
from ..aten.operands import made
from ..base.config import StepConfig
from ..builder.layers import repeat_kv, transpose12
from ..sim.graph import Graph
from ..sim.tensors import Tensor
from . import dynamic_cache
from .trl import attention_dtype


def causal_mask(g: Graph, cfg: StepConfig, B: int, T: int, position_ids: Tensor, dtype: str) -> Tensor | None:
    """masking_utils.create_causal_mask with no attention_mask: _preprocess_mask_arguments runs
    find_packed_sequence_indices; sdpa's mask is skipped (is_causal); eager's is built in
    inputs_embeds' dtype (dtype: fp32 under autocast, whose embedding is on no list). Where the trainer hands the
    model its 2-D attention mask (GRPOTrainer: padded_causal_mask) that path instead."""
    if cfg.stack.online is not None:  # GRPOTrainer, RLOOTrainer
        return padded_causal_mask(g, cfg, B, T, dtype)
    with g.scoped("mask"):
        if not dynamic_cache.kept(cfg):  # _preprocess_mask_arguments: only without a cache
            find_packed_sequence_indices(g, B, T, position_ids)
        return None if cfg.flash else eager_mask(g, B, T, dtype)


def padded_causal_mask(g: Graph, cfg: StepConfig, B: int, T: int, dtype: str,
                       given: Tensor | None = None) -> Tensor | None:  # fmt: skip
    """create_causal_mask given a 2-D attention mask of ones (no padding: the most the step holds):
    _preprocess_mask_arguments' attention_mask.to(bool) (no packed-sequence check beside a mask); sdpa's
    _ignore_causal_mask_sdpa finds no position masked (fast_all: mask.sum() == numel) and skips the mask; eager's
    sdpa_mask ands the causal mask with padding_mask_function's padding_mask[batch_idx, kv_idx], then eager_mask's
    torch.where. The bool copy goes as create_causal_mask returns."""
    with g.scoped("mask"):
        padding = made(g, (B, T), "_to_copy", dtype="bool") if given is None else given
        if cfg.flash:
            counted = made(g, (), "sum", padding, dtype="int64")
            every = made(g, (), "eq", counted, dtype="bool")
            del counted, every, padding
            return None
        batch_arange = made(g, (B,), "arange", dtype="int64")
        head_arange = made(g, (1,), "arange", dtype="int64")
        q_arange = arange_plus(g, T)
        kv_arange = arange_plus(g, T)
        result = made(g, (), "new_ones", dtype="bool")  # and_masks(causal_mask_function, padding_mask_function)
        causal = made(g, (1, 1, T, T), "le", q_arange, kv_arange, dtype="bool")
        result = made(g, (1, 1, T, T), "bitwise_and", result, causal, dtype="bool")
        del causal
        padded = made(g, (B, 1, 1, T), "index", padding, dtype="bool")  # padding_mask[batch_idx, kv_idx]
        result = made(g, (B, 1, T, T), "bitwise_and", result, padded, dtype="bool")
        del padded, batch_arange, head_arange, q_arange, kv_arange
        zero = made(g, (), "zeros", dtype=dtype)
        low = made(g, (), "scalar_tensor", dtype=dtype)
        out = made(g, (B, 1, T, T), "where", result, zero, low, dtype=dtype)
        del low, zero, result, padding
        return out


def decoder_mask(g: Graph, cfg: StepConfig, B: int, T: int, position_ids: Tensor, dtype: str,
                 given: Tensor | None = None) -> Tensor | None:  # fmt: skip
    """MistralModel.forward, Phi3Model.forward: mask_function = create_sliding_window_causal_mask where
    config.sliding_window is set (every layer, the shape's window), else create_causal_mask (Llama's). given: the
    caller's bool attention mask (PPO's forward), which .to(bool) leaves as it is."""
    window = cfg.shape.sliding_window
    if given is not None:
        return padded_causal_mask(g, cfg, B, T, dtype, given)
    if window and cfg.stack.online is not None:
        raise InputError(f"--rl {cfg.stack.rl} on a sliding-window model: create_sliding_window_causal_mask beside "
                         "the 2-D attention mask the trainer hands the model is not replayed")  # fmt: skip
    if not window:
        return causal_mask(g, cfg, B, T, position_ids, dtype)
    return sliding_window_causal_mask(g, cfg, B, T, position_ids, dtype, window)


def find_packed_sequence_indices(g: Graph, B: int, T: int, position_ids: Tensor) -> None:
    """position_ids[:, :1] - 1; torch.diff with it prepended (a cat, then a sub); != 1; cumsum; and
    (packed[:, -1] == 0).all(): not packed, so None. (position_ids expanded to B rows: a view.)"""
    first_dummy_value = made(g, (B, 1), "sub", position_ids, dtype="int64")
    prepended = made(g, (B, T + 1), "cat", first_dummy_value, position_ids, dtype="int64")
    position_diff = made(g, (B, T), "sub", prepended, dtype="int64")
    del prepended
    ne = made(g, (B, T), "ne", position_diff, dtype="bool")
    packed_sequence_mask = made(g, (B, T), "cumsum", ne, dtype="int64")
    del ne
    eq = made(g, (B,), "eq", packed_sequence_mask, dtype="bool")
    every = made(g, (), "all", eq, dtype="bool")
    del eq, every
    del first_dummy_value, position_diff, packed_sequence_mask


def eager_mask(g: Graph, B: int, T: int, dtype: str) -> Tensor:
    """eager_mask: sdpa_mask's bool (1, 1, T, T) from index aranges (kv_idx <= q_idx), expanded to
    (B, 1, T, T) (a view), then torch.where(mask, 0, finfo.min): (B, 1, T, T) in the model's dtype."""
    mask = sdpa_mask(g, B, T)
    zero = made(g, (), "zeros", dtype=dtype)
    low = made(g, (), "scalar_tensor", dtype=dtype)
    out = made(g, (B, 1, T, T), "where", mask, zero, low, dtype=dtype)
    del low, zero, mask
    return out


def sdpa_mask(g: Graph, B: int, T: int) -> Tensor:
    batch_arange = made(g, (B,), "arange", dtype="int64")
    head_arange = made(g, (1,), "arange", dtype="int64")
    q_arange = arange_plus(g, T)  # torch.arange(q_length) + q_offset
    kv_arange = arange_plus(g, T)
    mask = made(g, (1, 1, T, T), "le", q_arange, kv_arange, dtype="bool")
    del batch_arange, head_arange, q_arange, kv_arange
    return g.view(mask, (B, 1, T, T))  # .expand(batch_size, -1, q_length, kv_length)


def sliding_window_causal_mask(g: Graph, cfg: StepConfig, B: int, T: int, position_ids: Tensor, dtype: str,
                               window: int) -> Tensor | None:  # fmt: skip
    """masking_utils.create_sliding_window_causal_mask with no attention_mask: _preprocess_mask_arguments'
    packed-sequence check; sdpa's mask skipped while kv_length < sliding_window (_ignore_causal_mask_sdpa:
    is_causal then masks the same keys), else sdpa_mask's bool (B, 1, T, T); eager's additive (B, 1, T, T)
    from sliding_window_causal_mask_function, in inputs_embeds' dtype."""
    with g.scoped("mask"):
        if not dynamic_cache.kept(cfg):  # _preprocess_mask_arguments: only without a cache
            find_packed_sequence_indices(g, B, T, position_ids)
        if cfg.flash:
            return None if T < window else sliding_window_mask(g, B, T, window)
        mask = sliding_window_mask(g, B, T, window)
        zero = made(g, (), "zeros", dtype=dtype)
        low = made(g, (), "scalar_tensor", dtype=dtype)
        out = made(g, (B, 1, T, T), "where", mask, zero, low, dtype=dtype)  # eager_mask's torch.where
        del low, zero, mask
        return out


def sliding_window_mask(g: Graph, B: int, T: int, window: int) -> Tensor:
    """sdpa_mask with sliding_window_causal_mask_function (and_masks(sliding_window_overlay, causal)),
    not vmapped: the index aranges; and_mask's result = new_ones((), bool), then result & (kv_idx >
    q_idx - window) (the difference (1, 1, T, 1), then the comparison), then result & (kv_idx <= q_idx),
    each product a new (1, 1, T, T) bool; expanded to (B, 1, T, T) (a view)."""
    batch_arange = made(g, (B,), "arange", dtype="int64")
    head_arange = made(g, (1,), "arange", dtype="int64")
    q_arange = arange_plus(g, T)
    kv_arange = arange_plus(g, T)
    result = made(g, (), "new_ones", dtype="bool")
    low = made(g, (1, 1, T, 1), "sub", q_arange, dtype="int64")
    inside = made(g, (1, 1, T, T), "gt", kv_arange, low, dtype="bool")
    del low
    result = made(g, (1, 1, T, T), "bitwise_and", result, inside, dtype="bool")
    del inside
    causal = made(g, (1, 1, T, T), "le", kv_arange, q_arange, dtype="bool")
    result = made(g, (1, 1, T, T), "bitwise_and", result, causal, dtype="bool")
    del causal, batch_arange, head_arange, q_arange, kv_arange
    return g.view(result, (B, 1, T, T))  # .expand(batch_size, -1, q_length, kv_length)


def arange_plus(g: Graph, n: int) -> Tensor:
    """torch.arange(n) + offset: the sum is a new tensor, the arange dies."""
    a = made(g, (n,), "arange", dtype="int64")
    return made(g, (n,), "add", a, dtype="int64")


def attention_interface(g: Graph, cfg: StepConfig, q, k, v, causal, kwargs: tuple, contiguous_qk: bool = False):
    """ALL_ATTENTION_FUNCTIONS[config._attn_implementation]: the flash path or the model's eager
    function, the core checkpointed under selective recompute (verify/hf.py core_checkpointed, whose
    closure holds the call's kwargs, position_ids among them, until the recompute). contiguous_qk: q and
    k arrive contiguous in (B, n, T, d), RoPE's result concatenated with the part it passes (Phi-3,
    GPT-NeoX), where Llama's RoPE leaves them laid out (B, T, n, d) as the projections were."""
    if cfg.recompute == "selective":
        return g.checkpoint(lambda q, k, v, causal, kwargs=kwargs: attention_core(g, cfg, q, k, v, causal,
                                                                                  contiguous_qk),
                            q, k, v, causal)  # fmt: skip
    return attention_core(g, cfg, q, k, v, causal, contiguous_qk)


def attention_core(g: Graph, cfg: StepConfig, q, k, v, causal, contiguous_qk: bool = False):
    with g.scoped("attention core"):
        if cfg.flash and causal is not None:  # a sliding window's mask at seq >= the window
            return sdpa_masked_forward(g, q, k, v, causal, cfg.device == "cpu", contiguous_qk), None
        if math_path(cfg):
            return sdpa_math_forward(g, q, k, v, contiguous_qk), None
        if cfg.flash and attention_dtype(cfg) == "fp32" and cfg.device != "cpu":  # CUDA's flash kernel: 16 bits only
            return sdpa_efficient_forward(g, q, k, v), None
        if cfg.flash:
            return sdpa_flash_forward(g, q, k, v, cfg.device == "cpu", contiguous_qk), None
        if cfg.shape.positions != "rope":
            return gpt2_eager_attention(g, cfg, q, k, v, causal)
        return eager_attention_forward(g, cfg, q, k, v, causal, contiguous_qk)


def sdpa_flash_forward(g: Graph, q: Tensor, k: Tensor, v: Tensor, cpu: bool = False,
                       contiguous_q: bool = False) -> Tensor:  # fmt: skip
    """verify/hf.py sdpa_flash_forward: the flash op on q, k, v (GQA: k and v unrepeated), its output
    reshaped (same shape: a view) and transpose(1, 2).contiguous(): a view where the output is laid out
    (B, T, n, d), as CUDA's kernel and the meta function lay it out when q is (empty_like of q's
    transpose, flash_api.cpp mha_fwd), a copy where q is contiguous in (B, n, T, d) (contiguous_q). On
    CPU tensors (cpu): the stock sdpa path on SDPA's CPU flash kernel, whose output is laid out as q is
    (torch 2.13, measured), as CUDA's."""
    out = aten.flash_attention(g, q, k, v, cpu)
    out = aten.view(g, out, out.shape)
    if contiguous_q:
        return aten.reshape_copy(g, transpose12(g, out), (out.shape[0], out.shape[2], out.shape[1], out.shape[3]))
    return transpose12(g, out)


def sdpa_masked_forward(g: Graph, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, cpu: bool = False,
                        contiguous_q: bool = False) -> Tensor:  # fmt: skip
    """verify/hf.py sdpa_masked_forward: Transformers' sdpa given a mask (integrations/sdpa_attention.py:
    use_gqa_in_sdpa is False with one, so repeat_kv copies k and v to every head; is_causal False), then
    F.scaled_dot_product_attention: the bool mask made additive in q's dtype (attention.cpp
    convert_boolean_attn_mask: where(mask, 0, -inf), (B, 1, T, T)); CUDA's flash kernel takes no mask, so
    SDPA runs the memory-efficient one (sdp_utils.cpp's order: flash, efficient, math), the bias expanded to
    (B, nh, T, T) (a view) and, where T is not a multiple of 16, padded (preprocess_mask: constant_pad_nd of
    the expanded bias, then a slice). On CPU tensors SDPA's CPU flash kernel takes the additive mask. The
    efficient kernel's output is laid out (B, T, nh, d) whatever q's layout: its transpose(1, 2).contiguous()
    is a view; the CPU kernel's is laid out as q (a copy where q is contiguous, sdpa_flash_forward's)."""
    B, nh, T, _ = q.shape
    k, v = repeat_kv(g, k, nh), repeat_kv(g, v, nh)
    q, k, v = aten.autocast(g, "scaled_dot_product_attention", q, k, v)
    zero = made(g, (), "scalar_tensor", dtype=q.dtype)
    low = made(g, (), "scalar_tensor", dtype=q.dtype)
    bias = made(g, mask.shape, "where", mask, zero, low, dtype=q.dtype)
    del zero, low
    if cpu:
        out = aten.view(g, aten.flash_attention(g, q, k, v, True, bias), (B, nh, T, q.shape[3]))
        del bias
        if contiguous_q:  # (the repeated k and v, sdpa_attention_forward's locals, live until it returns)
            return aten.reshape_copy(g, transpose12(g, out), (B, T, nh, out.shape[3]))
        return transpose12(g, out)
    else:
        Tk = k.shape[2]
        full = g.view(bias, (B, nh, T, Tk))  # attn_mask.expand(B, nh, Tq, Tk)
        if Tk % 16:  # attn_mask.value() = preprocess_mask(...): the unpadded bias dies
            padded = made(g, (B, nh, T, Tk + 16 - Tk % 16), "constant_pad_nd", full, dtype=q.dtype)
            full = g.view(padded, (B, nh, T, Tk))  # padded_bias.slice(-1, 0, Tk)
            del padded, bias
        out = aten.efficient_attention(g, q, k, v, full)
        del full
    del q, k, v
    return transpose12(g, aten.view(g, out, out.shape))


def sdpa_efficient_forward(g: Graph, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """verify/hf.py sdpa_flash_forward at fp32 with one key head per query head: SDPA on CUDA refuses the flash
    kernel for fp32 (sdp_utils.cpp check_dtypes_flash_attention) and takes the memory-efficient one, causal,
    no bias; its output is laid out (B, T, nh, d) whatever q's layout, so transpose(1, 2).contiguous() is a
    view."""
    out = aten.efficient_attention(g, q, k, v, None)
    return transpose12(g, aten.view(g, out, out.shape))


def sdpa_math_forward(g: Graph, q: Tensor, k: Tensor, v: Tensor, contiguous_q: bool = False) -> Tensor:
    """verify/hf.py sdpa_flash_forward at fp32 with grouped key heads (enable_gqa): on CUDA SDPA's flash and
    cuDNN kernels refuse fp32 and the memory-efficient one grouped heads (sdp_utils.cpp), so it runs its math
    path (attention.cpp _scaled_dot_product_attention_math, as on meta): q * √scale; the causal mask
    ones(T, T).tril() made additive (where: fp32 (T, T)); k and v repeat_interleave'd to every head
    (unsqueeze, expand, clone: copies even of one key head); matmul(q, kᵀ * √scale), + the mask (a new
    (B, nh, T, T)), _safe_softmax (saves its result), matmul with v. Its locals (the scaled q, the mask, the
    repeated k and v) live until it returns; then transpose(1, 2).contiguous() copies."""
    B, nh, T, d = q.shape
    query = aten.mul_scalar(g, q)
    ones = made(g, (T, T), "ones", dtype="bool")
    tril = made(g, (T, T), "tril", ones, dtype="bool")
    del ones
    zero = made(g, (), "scalar_tensor", dtype=q.dtype)
    low = made(g, (), "scalar_tensor", dtype=q.dtype)
    mask = made(g, (T, T), "where", tril, zero, low, dtype=q.dtype)
    del tril, zero, low
    key, value = repeat_interleave(g, k, nh), repeat_interleave(g, v, nh)
    kt = aten.mul_scalar(g, aten.view(g, key, (B, nh, d, T)))  # key.transpose(-2, -1) * √scale
    attn = aten.matmul4(g, query, kt, B > 1 and not contiguous_q, False, False)
    del kt  # the temporary dies with the expression (saved by bmm where autograd records)
    attn = aten.add(g, attn, mask)
    attn = aten.safe_softmax(g, attn)
    out = aten.matmul4(g, attn, value, False, False, B > 1)  # its gradient arrives through the transpose
    del attn, query, mask, key, value
    return aten.reshape_copy(g, transpose12(g, out), (B, T, nh, d))


def repeat_interleave(g: Graph, x: Tensor, n_heads: int) -> Tensor:
    """x.repeat_interleave(n_heads // nkv, dim=-3): unsqueeze, expand, clone (contiguous), view."""
    B, nkv, T, hs = x.shape
    x5 = aten.expand(g, aten.view(g, x, (B, nkv, 1, T, hs)), (B, nkv, n_heads // nkv, T, hs))
    return aten.reshape_copy(g, x5, (B, n_heads, T, hs))


def eager_attention_forward(g: Graph, cfg: StepConfig, query, key, value, attention_mask, contiguous_qk: bool = False):
    """modeling_llama.py eager_attention_forward: repeat_kv; matmul(q, kᵀ) * scaling; + the mask;
    softmax in fp32 (dtype=torch.float32: a cast, then _softmax), cast back to q's dtype; dropout;
    matmul with v; transpose(1, 2).contiguous() (a copy). The probabilities are returned too. matmul
    copies q, and k and v unless repeat_kv copied them, where B > 1 and they are not contiguous in
    (B, n, T, d): a cache's copies are (k and v), and RoPE's concatenated results (q and k, contiguous_qk)."""
    B, groups = query.shape[0], query.shape[1] // key.shape[1]
    copied = groups > 1 and key.shape[1] > 1  # repeat_kv made contiguous copies
    copied = copied or (groups == 1 and dynamic_cache.kept(cfg))  # or attention reads the cache's contiguous copies
    k_copied = copied or (groups == 1 and contiguous_qk)
    # repeat_kv of one key head is an expand (heads at stride 0); autocast's cast of it (matmul is on
    # both lists; RoPE left k fp32 under autocast) is laid out contiguous (_to_copy with
    # preserve_format of a tensor that is not non-overlapping and dense: empty_like's suggested
    # format), so matmul views it to 3-D where it would copy the expanded view
    cast_expanded = groups > 1 and not copied and g.autocast is not None and key.dtype != g.autocast.dtype
    key_states, value_states = repeat_kv(g, key, query.shape[1]), repeat_kv(g, value, query.shape[1])
    kt = aten.view(g, key_states, key_states.shape[:2] + (key_states.shape[3], key_states.shape[2]))
    k_copies = B > 1 and not k_copied and not cast_expanded
    attn_weights = aten.mul_scalar(g, aten.matmul4(g, query, kt, B > 1 and not contiguous_qk, k_copies, False))
    del kt
    if cfg.shape.attn_softcap:  # modeling_gemma2.py eager_attention_forward: / softcap, tanh, * softcap
        attn_weights = aten.div_scalar(g, attn_weights)  # (each rebinding drops the tensor before it)
        attn_weights = aten.tanh(g, attn_weights)
        attn_weights = aten.mul_scalar(g, attn_weights)
    attn_weights = aten.add(g, attn_weights, attention_mask)
    attn_weights = aten.to(g, aten.softmax(g, aten.to(g, attn_weights, "fp32")), query.dtype)
    attn_weights = dropout(g, attn_weights, cfg.shape.dropout)
    attn_output = aten.matmul4(g, attn_weights, value_states, False, B > 1 and not copied, B > 1)
    attn_output = aten.reshape_copy(g, transpose12(g, attn_output), (B, query.shape[2], query.shape[1],
                                                                     query.shape[3]))  # fmt: skip
    del key_states, value_states
    return attn_output, attn_weights


def gpt2_eager_attention(g: Graph, cfg: StepConfig, query, key, value, attention_mask):
    """modeling_gpt2.py eager_attention_forward: matmul(q, kᵀ) * scaling; + the mask; softmax in the
    input's dtype, then .type(value.dtype); dropout (attn_pdrop); matmul with v; transpose(1, 2) (a view). q, k and v are
    strided views of c_attn's output: matmul copies them where B and the heads cannot merge (B > 1)."""
    B, strided = query.shape[0], not dynamic_cache.kept(cfg)  # a cache's copies of k and v are contiguous
    kt = aten.view(g, key, key.shape[:2] + (key.shape[3], key.shape[2]))  # key.transpose(-1, -2)
    attn_weights = aten.mul_scalar(g, aten.matmul4(g, query, kt, B > 1, B > 1 and strided, False))
    del kt
    attn_weights = aten.add(g, attn_weights, attention_mask)
    attn_weights = aten.softmax(g, attn_weights)
    attn_weights = aten.to(g, attn_weights, value.dtype)  # .type(value.dtype): under autocast fp32 to 16 bits
    attn_weights = dropout(g, attn_weights, cfg.shape.dropout)
    attn_output = aten.matmul4(g, attn_weights, value, False, B > 1 and strided, B > 1)
    return transpose12(g, attn_output), attn_weights


def grad_copies(cfg: StepConfig, masked: bool = False) -> tuple[bool, bool, bool]:
    """Whether the gradient reaching each (B, T, n, d) view of q, k, v arrives laid out so that reshaping
    it to (B, T, n·d) copies (never with one head). With RoPE (Llama, Qwen) as memcalc.exact.builder.layers'
    eager path and flash path: the same RoPE, the same layouts. GPT-2: flash's gradients arrive
    (B, T, n, d)-laid out (no copies); eager's q and v gradients arrive (B, n, T, d)-laid out (copies),
    k's through kᵀ, whose (n, d) dims merge (none). With a cache, attention runs on its copies, contiguous
    (B, n, T, d): flash's gradients come back so (CUDA's kernel and the meta function allocate them like
    their inputs; CPU's lays them out (B, T, n, d)), and reshaping them through the transpose copies (eager's
    k gradient still comes through kᵀ); the memory-efficient kernel's (fp32) are laid out (B, T, n, d) by the
    meta function (empty_permuted), where CUDA's lays them out as its inputs: one copy of v's a layer more
    there."""
    s = cfg.shape
    masked = masked or math_path(cfg)  # sdpa_math_forward repeats k and v as the masked call does
    if masked and s.positions == "rope":  # sdpa_masked_forward: k and v repeated to every head
        return s.n_heads > 1, s.n_kv_heads > 1, s.n_kv_heads > 1 and s.n_kv_heads < s.n_heads
    cached = dynamic_cache.kept(cfg) and cfg.device != "cpu"  # CPU's flash kernel lays its gradients out (B, T, n, d)
    cached = cached and not (cfg.flash and attention_dtype(cfg) == "fp32")  # sdpa_efficient_forward's, laid out
    # as the meta function lays them
    if s.positions == "rope":
        return s.n_heads > 1, s.n_kv_heads > 1, s.n_kv_heads > 1 and (not cfg.flash or cached)
    return (s.n_heads > 1 and not cfg.flash, s.n_kv_heads > 1 and cached and cfg.flash,
            s.n_kv_heads > 1 and (not cfg.flash or cached))  # fmt: skip


def math_path(cfg: StepConfig) -> bool:
    """Whether CUDA's SDPA runs its math path (sdpa_math_forward): fp32 (memcalc.exact.hf.trl.attention_dtype)
    with grouped key heads."""
    s = cfg.shape
    return cfg.flash and attention_dtype(cfg) == "fp32" and cfg.device != "cpu" and s.n_kv_heads < s.n_heads


def dropout(g: Graph, x: Tensor, p: float) -> Tensor:
    """F.dropout as CUDA runs it: the input itself at p = 0, else aten.native_dropout (a bool mask)."""
    return aten.native_dropout(g, x) if p > 0 else x
