"""The interleaved schedule over p·v model chunks that need not divide the layers: torchtitan splits p·v
virtual stages as it splits p (the embedding and the head a layer each), Megatron-LM needs p·v to divide L.
Llama 3.1 405B's 126 layers over PP 16 x v 2 are torchtitan's docs/performance.md run."""

import pytest

from memcalc.errors import InputError
from memcalc.memory.setup import Setup
from memcalc.model.gpus import gpu
from memcalc.model.presets import preset_model
from memcalc.model.stacks import STACKS
from memcalc.model.tricks import parse_tricks
from memcalc.model.layout import Layout
from memcalc.parallel.stage_memory import layout_memory
from memcalc.parallel.pipeline import chunk_layers, held_layers, layers_per_stage
from memcalc.parallel.search import splits


def test_torchtitans_split_of_405b_over_pp16_v2():
    lay = Layout(tp=8, pp=16, dp=4, vpp=2, sp=True)
    chunks = chunk_layers(lay, 126, "fsdp2")
    assert chunks == (3,) + (4,) * 30 + (3,)  # (126 + 2) / 32 = 4, the end chunks give one each to the embedding and head
    assert layers_per_stage(lay, 126, "fsdp2") == (7,) + (8,) * 14 + (7,)  # stage i holds chunks i and i + 16
    with pytest.raises(InputError, match="must divide the 126 layers.*--stack fsdp2"):
        chunk_layers(lay, 126, "megatron")
    with pytest.raises(InputError, match="interleaved"):
        chunk_layers(Layout(tp=8, pp=16, dp=4, vpp=2, first_layers=6), 126, "megatron")


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 4), (8, 2, 16), (3, 4, 3)])
def test_equal_chunks_hold_korthikantis_interleaved_count(p, v, m):
    """Where p·v divides L the chunks are equal and each warm-up forward holds L/(p·v) layers: Megatron-LM's
    2(p − i − 1) + (v − 1)·p + 1 chunks (at most m·v), as before uneven chunks were known."""
    n_layers = 2 * p * v
    lay = Layout(pp=p, vpp=v, dp=1)
    for stage in range(p):
        forwards = min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v)
        assert held_layers(lay, stage, m, n_layers) == forwards * n_layers // (p * v)


def test_uneven_chunks_are_held_in_the_order_the_schedule_runs_them():
    """Stage 0 of 405B at m = 16: its 32 warm-up forwards (2·15 + 16 + 1 = 47, at most m·v) are 16 on its
    first chunk (3 layers) and 16 on its second (4 layers)."""
    lay = Layout(tp=8, pp=16, dp=4, vpp=2, sp=True)
    assert held_layers(lay, 0, 16, 126, engine="fsdp2") == 16 * 3 + 16 * 4
    assert held_layers(lay, 15, 16, 126, engine="fsdp2") == 16 * 4 + 1 * 3  # 17 forwards: 16 on chunk 15, one on 31


def test_the_job_is_answered_and_searched():
    model, setup = preset_model("llama3.1-405b"), Setup(seq_len=8192, grad_accum=16, stack=STACKS["fsdp2"])
    lay = Layout(tp=8, pp=16, dp=4, vpp=2, sp=True, zero=3)
    mem = layout_memory(model, setup, gpu("h100-sxm"), parse_tricks("bf16,flash,ckpt"), lay)
    assert mem.stage_layers == (7,) + (8,) * 14 + (7,) and all(st.total_bytes > 0 for st in mem.stages)
    vpps = {lay.vpp for lay, _, _ in splits(8, 16, 1, 4, 126, 8192, 16, 8, False, "fsdp2")}
    assert vpps == {1, 2, 4}  # 128 = (126 + 2) over 32 and 64 balanced chunks; Megatron-LM's engine: none
    assert {lay.vpp for lay, _, _ in splits(8, 16, 1, 4, 126, 8192, 16, 8, False, "megatron")} == {1}


def test_sac_over_a_layout_counts_each_block_op_by_op():
    """Per-op SAC with TP, SP and PP: no textbook formula, so each block's saved bytes are memcalc.exact's on
    the TP shard (tp_layer.block_terms, verify --tp checks them on DTensor), held as 1F1B holds any layer's."""
    from memcalc.parallel.tp_layer import block_terms

    model, tricks = preset_model("llama3-8b"), parse_tricks("bf16,flash,sac")
    lay = Layout(tp=2, sp=True, pp=4, dp=2)
    setup = Setup(seq_len=8192, grad_accum=8)
    mem = layout_memory(model, setup, gpu("h100-sxm"), tricks, lay)
    first = mem.stages[0]
    per_layer = sum(t.value for t in block_terms(model.shape, 8192, 1, tricks, lay))
    assert first.layer.per_layer_bytes == per_layer and first.held == held_layers(lay, 0, 8, 32)
    assert first.layer.rebuilt_bytes > 0  # one block's recompute in its backward
    with pytest.raises(InputError, match="ckpt:N"):
        layout_memory(model, setup, gpu("h100-sxm"), parse_tricks("bf16,flash,ckpt:2"), lay)
