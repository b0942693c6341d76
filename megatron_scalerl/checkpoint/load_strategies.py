"""megatron-core's load strategies for `dist_checkpointing.load`, made to unpickle nothing but plain data.

Left as they are, loading a torch_dist checkpoint runs `pickle.load` on its `.metadata` (torch's FileSystemReader),
`torch.load(weights_only=False)` on every object item of its `.distcp` files (torch's DefaultLoadPlanner.load_bytes:
megatron's `_extra_state` entries) and megatron-core's `torch.load` of `common.pt` (weights only by torch's default,
undone by `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`). Passed to `dist_checkpointing.load` instead (`checkpoint.sharded`):

    ShardedLoadStrategy   megatron's TorchDistLoadShardedStrategy reading through `unpickling.CheckpointReader`
                          (the `.metadata` allow-list) with `WeightsOnlyPlanner` (objects: `weights_only=True`)
    CommonLoadStrategy    `common.pt` (optimizer param groups, sharding type) with `torch.load(weights_only=True)`

Each refusal is a CheckpointError naming the file. The tensors torch reads with `torch.load(weights_only=True)`
already. megatron-core builds its reader and planner inside `TorchDistLoadShardedStrategy.load`, with no argument to
pass others, so `ShardedLoadStrategy.load` is that method (megatron-core 0.16.1) with ours put in.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME, TorchCommonLoadStrategy
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    TorchDistLoadShardedStrategy,
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict,
)
from torch.distributed import checkpoint
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import ReadItem

from megatron_scalerl.checkpoint.store import CheckpointError
from megatron_scalerl.checkpoint.unpickling import CheckpointReader, read_metadata


def _refused(path: Path, what: str, exc: pickle.UnpicklingError) -> CheckpointError:
    """The refusal of `path` (`what` it holds), whose weights-only load raised `exc`: its reason is the paragraph of
    torch's message that names what was refused (the others say how to load it anyway)."""
    paragraphs = [p.strip() for p in str(exc).split("\n\n") if p.strip()] or [type(exc).__name__]
    reason = next((p for p in paragraphs if not p.startswith(("Weights only load failed", "Check the documentation"))),
                  paragraphs[0]).splitlines()[0]
    return CheckpointError(f"{path}: refused: {what} holds more than tensors and plain values ({reason}); nothing of "
                           "it was run")


class WeightsOnlyPlanner(MCoreLoadPlanner):
    """megatron's load planner (global shape checks) whose object items are read with `torch.load(weights_only=True)`
    (torch's planner reads them with `weights_only=False`); `checkpoint_dir` names the file in a refusal."""

    def __init__(self, checkpoint_dir: Path, **kwargs):
        super().__init__(**kwargs)
        self.checkpoint_dir = checkpoint_dir

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            file = self.checkpoint_dir / self.metadata.storage_data[read_item.storage_index].relative_path
            raise _refused(file, f"object {fqn!r}", exc) from None
        if self.flatten_state_dict:  # what DefaultLoadPlanner.load_bytes does with what it loaded
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


class ShardedLoadStrategy(TorchDistLoadShardedStrategy):
    """megatron-core's torch_dist load through `CheckpointReader` and `WeightsOnlyPlanner`; its metadata queries
    through `unpickling.read_metadata`."""

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        checkpoint_dir = Path(checkpoint_dir)
        flexible_shape_sharded_tensors = [
            sh_ten for sh_ten in nested_values(sharded_state_dict)
            if isinstance(sh_ten, ShardedTensor) and not sh_ten.allow_shape_mismatch]
        allow_shape_mismatch_sharded_tensors = {
            sh_ten.key: sh_ten for sh_ten in nested_values(sharded_state_dict)
            if isinstance(sh_ten, ShardedTensor) and sh_ten.allow_shape_mismatch}
        orig_sharded_state_dict = sharded_state_dict
        sharded_state_dict, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict)
        pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, True)
        reader = CheckpointReader(checkpoint_dir)
        # read (and refused) here on every rank, not inside torch's load: torch turns a failure there into its
        # collective CheckpointException, after trying per-rank metadata files instead
        self.cached_global_metadata = reader.read_metadata()
        checkpoint.load_state_dict(pyt_state_dict, reader, planner=WeightsOnlyPlanner(
            checkpoint_dir, shapes_validation_sharded_tensors=flexible_shape_sharded_tensors,
            allow_shape_mismatch_sharded_tensors=allow_shape_mismatch_sharded_tensors))
        mcore_state_dict = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        mcore_state_dict = _replace_sharded_keys_with_state_dict_keys(mcore_state_dict, flat_mapping, rename_mapping)
        _restore_dict_types(mcore_state_dict, orig_sharded_state_dict)
        return mcore_state_dict

    def load_tensors_metadata(self, checkpoint_dir: Path, metadata: Metadata | None = None):
        if metadata is None:
            metadata = read_metadata(checkpoint_dir)
        return super().load_tensors_metadata(checkpoint_dir, metadata)

    def load_sharded_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        metadata = read_metadata(checkpoint_dir)
        objects = [ShardedObject.empty_from_unique_key(key) for key, storage in metadata.state_dict_metadata.items()
                   if isinstance(storage, BytesStorageMetadata)]
        return {**{obj.unique_key: obj for obj in objects}, **self.load_tensors_metadata(checkpoint_dir, metadata)}


class CommonLoadStrategy(TorchCommonLoadStrategy):
    """megatron-core's `common.pt` load with `torch.load(weights_only=True)`. Objects stored as files of their own
    (`load_sharded_objects`: formats before torch_dist) are not read: torch_dist keeps them in its `.distcp` files."""

    def load_common(self, checkpoint_dir: str | Path) -> StateDict:
        path = Path(checkpoint_dir) / COMMON_STATE_FNAME
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise _refused(path, "it", exc) from None
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing") from None

    def load_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: str | Path):
        raise CheckpointError(f"{checkpoint_dir}: objects stored as files of their own (a checkpoint format before "
                              "torch_dist) are not read")
