"""memcalc verify --fsdp N --tp N: per-rank memory checked on PyTorch's own distributed engine.

Three ways to run the same measurement (verify/dist_measure.py) of one rank:
  meta      one process plays one rank of an N-rank job: PyTorch's fake process group (collectives
            that move nothing) and FakeTensorMode on "cpu" (nothing allocated), N up to thousands.
            FSDP2 refuses parameters on the meta device at its first forward, so fake tensors it is.
  cpu-gloo  N real CPU processes (torch.multiprocessing, gloo), a small model: the fake process
            group's numbers are those of real collectives.
  cuda      real NCCL collectives: under torchrun each process measures its own rank; otherwise one
            process per visible GPU is started here.
The prediction side is memcalc.verification.distributed (torch-free); this module only measures and compares.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from memcalc.errors import InputError
from memcalc.memory.estimate import Setup
from memcalc.model.params import n_params
from memcalc.model.shape import Model
from memcalc.model.tricks import Tricks
from memcalc.model.layout import Layout
from memcalc.verification.dist_results import DistResult, model_label
from memcalc.verification.dist_tensors import rank_coords
from memcalc.verification.distributed import (BACKENDS, check_dist, compare, default_ranks, dist_matrix, padded_vocab,
                                              predictions)  # fmt: skip

from .dist_measure import measure_fsdp2, measure_rank


def verify_distributed(model: Model, setup: Setup, tricks: Tricks, layout: Layout, device: str = "meta",
                       ranks: tuple[int, ...] | None = None) -> DistResult:  # fmt: skip
    """Measure the given ranks (default: the first and the last on meta, every rank on gloo and
    cuda) and compare each with memcalc's prediction. The model is built at its own shape
    (model.shape; with --params N the shape's own parameters, not N), its vocabulary padded to a
    multiple of tp."""
    check_dist(model.shape, setup, tricks, layout, device)
    if not setup.stack.finetune.trains_all:  # PEFT's model under FSDP2 (the fsdp2 stack: memcalc.engine.job)
        from .fsdp2_lora import verify_fsdp2_lora

        return verify_fsdp2_lora(model, setup, tricks, layout)
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 6):
        raise InputError(f"distributed verify needs torch >= 2.6 (FSDP2's fully_shard), found {torch.__version__}")
    ranks = default_ranks(layout, device) if ranks is None else tuple(ranks)
    for r in ranks:
        rank_coords(layout, r)  # one line for a rank outside the world
    shape = padded_vocab(model.shape, layout.tp)
    start = time.perf_counter()
    engine = setup.stack.engine
    if device == "meta":
        measured = {r: in_thread(fake_rank, shape, setup, tricks, layout, r) for r in ranks}
    elif device == "cpu-gloo":
        measured = spawn_ranks(shape, setup, tricks, layout, "gloo")
    else:
        measured = cuda_ranks(shape, setup, tricks, layout)
    seconds = time.perf_counter() - start
    checks = tuple(compare(predictions(shape, setup.seq_len, setup.micro_batch, tricks, layout, r, device, engine),
                           measured[r], layout, r) for r in ranks)  # fmt: skip
    return DistResult(shape.name, n_params(shape), setup.seq_len, setup.micro_batch, tricks, layout, device,
                      BACKENDS[device], layout.world, checks, torch.__version__, seconds,
                      notes(model.shape, shape, layout, engine))  # fmt: skip


def verify_distributed_matrix(model: Model, setup: Setup, layout: Layout, device: str = "meta",
                              on_result=None) -> list[DistResult]:  # fmt: skip
    """verify_distributed for every trick set the check runs (memcalc.verification.distributed.dist_matrix);
    on_result gets each result as soon as it is measured (--save)."""
    results = []
    for tricks in dist_matrix(model.shape, setup, layout, device):
        results.append(verify_distributed(model, setup, tricks, layout, device))
        if on_result is not None:
            on_result(results[-1])
    return results


def notes(given, built, layout: Layout, engine: str = "none") -> tuple[str, ...]:
    if engine == "fsdp2":
        reshard = {None: "torchtitan's default", True: "always", False: "never"}[layout.reshard_after_forward]
        units = "[token table, final norm]" if built.tied_embeddings else "token table, [final norm, lm_head]"
        first = (f"{model_label(built)}: FSDP2 as torchtitan applies it over dp {layout.dp} (fp32 parameters, "
                 "MixedPrecisionPolicy(param_dtype=the precision's, reduce_dtype=fp32), "
                 f"units: {units}, each block, root; reshard after forward: {reshard})"
                 f"{f', DTensor TP {layout.tp}' if layout.tp > 1 else ''}; torch.optim.AdamW(fused=True); "
                 "zero_grad(set_to_none) at each step's start")  # fmt: skip
    else:
        first = (f"{model_label(built)}: FSDP2 fully_shard per block + root over dp {layout.dp}, DTensor TP {layout.tp}"
                 f"{' + SP' if layout.sp else ''}; verify/recipes.py's AdamW (fp32 master, m, v of each local shard)")
    out = [
        first,
        ("saved by one block: the second block's forward, local shards, one count per storage; parameters "
         "(sharded and all-gathered) and the RoPE tables all blocks share are left out"),
    ]  # fmt: skip
    if engine == "fsdp2" and layout.tp == 1:
        out.append("peaks: live bytes on the rank (fake tensors, FSDP2's storage resizes counted), the third step: "
                   "between steps, forward (from zero_grad), backward, optimizer")  # fmt: skip
    elif engine == "fsdp2":
        out.append("peaks are checked with tp 1: DTensor TP's collectives are not replayed "
                   "(memcalc.exact.replay.fsdp2)")
    if built.vocab != given.vocab:
        out.append(f"vocabulary padded from {given.vocab:,} to {built.vocab:,} rows, a multiple of tp {layout.tp} "
                   "(Megatron-LM pads to 128·tp): each TP rank holds ⌈V/t⌉ rows, as memcalc charges")  # fmt: skip
    return tuple(out)


# ---- meta: the fake process group -----------------------------------------------------------------


def in_thread(fn, *args):
    """Run fn in a new thread. DTensor caches sharding decisions per thread, keyed by a mesh that
    compares equal to the next rank's (same shape, names and thread): the cached specs would carry
    the last process group's names. A fresh thread starts with an empty cache."""
    import threading

    out: list = []

    def run():
        try:
            out.append((True, fn(*args)))
        except BaseException as e:  # re-raised in the caller's thread
            out.append((False, e))

    t = threading.Thread(target=run, name="memcalc-fake-rank")
    t.start()
    t.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


def fake_rank(shape, setup: Setup, tricks: Tricks, layout: Layout, rank: int) -> dict[str, int]:
    """One rank of a layout.world-rank job in this process: fake collectives, fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise InputError("a process group is already initialised in this process: the fake one cannot start")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world)
    try:
        mesh = init_device_mesh("cpu", (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
        if setup.stack.engine == "fsdp2":
            return measure_fsdp2(shape, setup.seq_len, setup.micro_batch, tricks, layout, mesh)
        return measure_rank(shape, setup.seq_len, setup.micro_batch, tricks, layout, mesh, "cpu", FakeTensorMode())
    finally:
        dist.destroy_process_group()


# ---- real processes: gloo on CPU, NCCL on GPUs ------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world: int, port: int, backend: str, job: tuple, queue) -> None:
    """One spawned rank: join the group, measure, send (rank, bytes) home; an error goes home as
    one line and is raised again, so that torch.multiprocessing stops the other ranks."""
    import warnings

    warnings.filterwarnings("ignore", message="DTensor random operators")  # init_weights on a CPU mesh
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    shape, setup, tricks, layout = job
    torch.set_num_threads(1)
    try:
        device = "cpu"
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = f"cuda:{rank}"
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(minutes=5))
        mesh = init_device_mesh("cuda" if backend == "nccl" else "cpu", (layout.dp, layout.tp),
                                mesh_dim_names=("dp", "tp"))  # fmt: skip
        queue.put((rank, measure_rank(shape, setup.seq_len, setup.micro_batch, tricks, layout, mesh, device)))
    except Exception as e:
        queue.put((rank, f"{type(e).__name__}: {e}".splitlines()[0][:300]))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(shape, setup: Setup, tricks: Tricks, layout: Layout, backend: str) -> dict[int, dict[str, int]]:
    """layout.world processes on this machine; each measures its own rank."""
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    job = (shape, setup, tricks, layout)
    try:
        mp.start_processes(worker, args=(layout.world, free_port(), backend, job, queue), nprocs=layout.world,
                           join=True, start_method="spawn")  # fmt: skip
    except (mp.ProcessRaisedException, mp.ProcessExitedException):
        pass  # the failing rank's line is in the queue
    out: dict[int, dict[str, int]] = {}
    while not queue.empty():
        rank, result = queue.get()
        if isinstance(result, str):
            raise RuntimeError(f"{backend} rank {rank} failed: {result}")
        out[rank] = result
    if len(out) != layout.world:
        raise RuntimeError(f"{backend}: {layout.world - len(out)} of {layout.world} ranks ended without a result")
    return out


def cuda_ranks(shape, setup: Setup, tricks: Tricks, layout: Layout) -> dict[int, dict[str, int]]:
    """Under torchrun: this process's rank, gathered from all. Otherwise one process per GPU here."""
    if not torch.cuda.is_available():
        raise InputError("device cuda: no CUDA device is visible")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return torchrun_ranks(shape, setup, tricks, layout)
    if torch.cuda.device_count() < layout.world:
        raise InputError(f"device cuda: {layout.world} ranks need {layout.world} GPUs, "
                         f"{torch.cuda.device_count()} visible (or start under torchrun)")  # fmt: skip
    return spawn_ranks(shape, setup, tricks, layout, "nccl")


def torchrun_ranks(shape, setup: Setup, tricks: Tricks, layout: Layout) -> dict[int, dict[str, int]]:
    """torchrun --nproc-per-node N -m memcalc verify ...: every process measures its rank, all gather."""
    world = int(os.environ["WORLD_SIZE"])
    if world != layout.world:
        raise InputError(f"torchrun started {world} processes, the layout needs {layout.world}")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("nccl")
    try:
        mesh = init_device_mesh("cuda", (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
        mine = measure_rank(shape, setup.seq_len, setup.micro_batch, tricks, layout, mesh, f"cuda:{local_rank}")
        everyone: list = [None] * world
        dist.all_gather_object(everyone, (dist.get_rank(), mine))
        return dict(everyone)
    finally:
        if own:
            dist.destroy_process_group()


# ---- FSDP2 + pipeline parallel: one stage's rank --------------------------------------------------


def verify_pipeline(model: Model, setup: Setup, tricks: Tricks, layout: Layout, stage: int) -> DistResult:
    """--fsdp D --pp P --stack fsdp2: stage `stage`'s rank 0 of its FSDP2 group, measured on the fake process
    group (verify/dist_pipeline.py) against the fsdp2 engine's stage (memcalc.verification.pipeline)."""
    from memcalc.parallel.pipeline import layers_per_stage
    from memcalc.verification.pipeline import check_pipeline, stage_check

    check_pipeline(model.shape, setup, tricks, layout, stage)
    check_dist(model.shape, replace(setup, grad_accum=1), tricks, replace(layout, pp=1), "meta")  # the rest as FSDP2 alone
    layers = layers_per_stage(layout, model.shape.n_layers, "fsdp2")
    start = time.perf_counter()
    measured = in_thread(fake_stage, model.shape, setup, tricks, layout, layers, stage)
    seconds = time.perf_counter() - start
    check = stage_check(model.shape, setup, tricks, layout, stage, measured)
    built = model.shape
    reshard = {None: "torchtitan's default (never under PP)", True: "always", False: "never"}[layout.reshard_after_forward]
    notes = (
        (f"{model_label(built)}: pipeline {layout.pp} stages of {', '.join(map(str, layers))} layers (torchtitan's "
         f"split), stage {stage} checked ({layers[stage]} layers{', the token table' if stage == 0 else ''}"
         f"{', the final norm and lm_head' if stage == layout.pp - 1 else ''}); FSDP2 over dp {layout.dp} as torchtitan "
         f"applies it to the stage's part (reshard after forward: {reshard}); torch.optim.AdamW(fused=True)"),
        (f"1F1B over {setup.grad_accum} micro-batches of {setup.micro_batch} (torch.distributed.pipelining's "
         "Schedule1F1B order and PipelineStage's buffers and FSDP2 calls, driven in this process: the fake group "
         "cannot run the stage's P2P start-up vote); measured: the step after a warm-up one, its peak split by part "
         "in a third"),
    )  # fmt: skip
    return DistResult(built.name, n_params(built), setup.seq_len, setup.micro_batch, tricks, layout, "meta",
                      BACKENDS["meta"], layout.world, (check,), torch.__version__, seconds, notes)  # fmt: skip


def fake_stage(shape, setup: Setup, tricks: Tricks, layout: Layout, layers, stage: int) -> dict[str, object]:
    """Rank 0 of stage `stage`'s FSDP2 group, on a fake group of dp ranks."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .dist_pipeline import measure_fsdp2_pp

    if dist.is_initialized():
        raise InputError("a process group is already initialised in this process: the fake one cannot start")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=layout.dp)
    try:
        mesh = init_device_mesh("cpu", (layout.dp, 1), mesh_dim_names=("dp", "tp"))
        return measure_fsdp2_pp(shape, setup.seq_len, setup.micro_batch, setup.grad_accum, tricks, layout, layers,
                                stage, mesh)  # fmt: skip
    finally:
        dist.destroy_process_group()
