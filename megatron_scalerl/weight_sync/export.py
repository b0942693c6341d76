"""Streaming export of the live sharded trainer as buckets of HF-named full tensors, delivered on trainer rank 0.

    for bucket in export_buckets(trainer.model, recipe.model, bucket_mib=256, serving_dtype=torch.bfloat16,
                                 fp32_lm_head=True):   # every trainer rank iterates; only rank 0 gets buckets
        ...

Names and shapes come from `models.weights.export_hf_state` (the mapping table: TP shards and EP experts gathered,
vocabulary padding dropped). Each tensor is cast to the serving dtype (the LM head stays FP32 with `fp32_lm_head`, a
tied model's embedding too: it is the head) and packed into buckets of about `bucket_mib` MiB (a tensor larger than
that travels alone). Pipeline stages are walked in order: stage 0 exports on rank 0 itself; every later stage's
member of rank 0's pipeline group (its "courier") sends its buckets to rank 0 over the pipeline group, header then
bytes, one bucket at a time, so rank 0 never holds more than one bucket. Bucket indices count across the whole model.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import Tensor

from megatron_scalerl.models.weights import export_hf_state
from megatron_scalerl.platform.distributed import current_device
from megatron_scalerl.recipe import ModelConfig
from megatron_scalerl.weight_sync.protocol import MIB, Bucket, WeightSyncError, wire_dtype


def _cast(named: Iterator[tuple[str, Tensor]], serving_dtype: torch.dtype, fp32_lm_head: bool, tied: bool
          ) -> Iterator[tuple[str, Tensor]]:
    for name, tensor in named:
        cast = tensor.detach().to(wire_dtype(name, serving_dtype, fp32_lm_head, tied=tied))
        del tensor  # not kept alive (in the model's dtype) while the consumer works
        yield name, cast


def bucketed(named: Iterator[tuple[str, Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group tensors in order into buckets of at most `bucket_bytes` bytes (an oversized tensor gets its own) and of
    one dtype (so every tensor starts at a multiple of its element size in the packed buffer). Holds no reference
    to a bucket once the consumer asks for the next one."""
    pending: list[tuple[str, Tensor]] = []
    size = index = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if pending and (size + nbytes > bucket_bytes or tensor.dtype != pending[0][1].dtype):
            ready = Bucket.pack(index, pending)
            index, pending, size = index + 1, [], 0
            yield ready
            del ready
        pending.append((name, tensor))
        size += nbytes
    if pending:
        yield Bucket.pack(index, pending)


def _send_stage(buckets: Iterator[Bucket], group: dist.ProcessGroup, stage: int) -> None:
    """Courier of `stage` > 0: each bucket's header then bytes to pipeline rank 0; a None header ends the stage."""
    device = current_device()
    what = "the first bucket"
    try:
        for bucket in buckets:
            what = bucket.describe()
            dist.send_object_list([bucket.header()], group=group, group_dst=0, device=device)
            dist.send(bucket.packed, group=group, group_dst=0)
            del bucket
        what = "the end of its buckets"
        dist.send_object_list([None], group=group, group_dst=0, device=device)
    except (RuntimeError, dist.DistError) as exc:
        raise WeightSyncError(f"weight export: pipeline stage {stage} could not send {what} to trainer rank 0 "
                              f"(global rank {dist.get_global_rank(group, 0)}): {exc}") from exc


def _receive_stage(group: dist.ProcessGroup, stage: int, first_index: int) -> Iterator[Bucket]:
    """On rank 0: pipeline stage `stage`'s buckets, renumbered from `first_index`."""
    device = current_device()
    peer = dist.get_global_rank(group, stage)
    index = first_index
    while True:
        box: list = [None]
        try:
            dist.recv_object_list(box, group=group, group_src=stage, device=device)
            if box[0] is None:
                return
            bucket = Bucket.empty_from_header({**box[0], "index": index}, device)
            dist.recv(bucket.packed, group=group, group_src=stage)
        except (RuntimeError, dist.DistError) as exc:
            raise WeightSyncError(f"weight export: receiving bucket {index} from pipeline stage {stage} "
                                  f"(global rank {peer}) failed: {exc}") from exc
        yield bucket
        del bucket
        index += 1


def export_buckets(model_chunks: list, model_cfg: ModelConfig, *, bucket_mib: float, serving_dtype: torch.dtype,
                   fp32_lm_head: bool) -> Iterator[Bucket]:
    """The whole model as buckets on trainer rank 0 (stage by stage, each in `export_hf_state`'s order); nothing on
    other ranks.

    A collective over every trainer rank (TP/EP gathers within each stage, sends over rank 0's pipeline group):
    all ranks must iterate it to the end. Every collective is bounded by the trainer's process-group timeout
    (`cluster.collective_timeout_s`). `bucket_mib`: bucket size in MiB.
    """
    if len(model_chunks) != 1:
        raise ValueError(f"weight export supports one model chunk per rank, got {len(model_chunks)} "
                         "(virtual pipeline stages are not supported)")
    bucket_bytes = max(1, int(bucket_mib * MIB))
    stage = parallel_state.get_pipeline_model_parallel_rank()
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    group = parallel_state.get_pipeline_model_parallel_group()
    on_rank0_pipeline = dist.get_global_rank(group, 0) == 0  # my pipeline starts at global rank 0
    named = export_hf_state(model_chunks[0], model_cfg, to_first_rank=True)
    if not on_rank0_pipeline:
        for _ in named:  # take part in this stage's TP/EP gathers
            pass
        return
    own = bucketed(_cast(named, serving_dtype, fp32_lm_head, model_cfg.tie_word_embeddings), bucket_bytes)
    if stage > 0:
        _send_stage(own, group, stage)
        return
    count = 0
    for bucket in own:
        yield bucket
        del bucket  # one bucket at a time: not alive while the next is exported
        count += 1
    for later in range(1, stages):
        for bucket in _receive_stage(group, later, count):
            yield bucket
            del bucket
            count += 1
