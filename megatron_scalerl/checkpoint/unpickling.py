"""A Megatron checkpoint's `.metadata` read without running what the file says.

torch's distributed-checkpoint reader unpickles `.metadata` with `pickle.load`, so a checkpoint made elsewhere could
run any code on `--resume`, `scalerl convert megatron-to-hf` or `scalerl eval`. Here it is unpickled by
`MetadataUnpickler`, which builds only the classes torch and megatron-core write into that file (`METADATA_GLOBALS`,
and torch's dtypes, layouts and memory formats); any other global it names is refused before anything is built:

    read_metadata(checkpoint)    the checkpoint's metadata (torch's `Metadata`), or CheckpointError naming the file
    CheckpointReader(checkpoint) torch's FileSystemReader reading `.metadata` that way (once: later calls reuse it)

What the rest of a checkpoint holds is read elsewhere: tensors by torch (`torch.load(weights_only=True)`), objects and
`common.pt` by `checkpoint.load_strategies` (weights only as well). Needs no megatron-core.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader, Metadata
from torch.distributed.checkpoint.metadata import StorageMeta

from megatron_scalerl.checkpoint.store import CheckpointError

METADATA_FILE = ".metadata"  # torch's `filesystem._metadata_fn`

# (module, name) of every global a torch_dist `.metadata` of ours refers to (trainer and converted checkpoints,
# dense and MoE; listed from their files), plus OrderedDict, which older torch writers used for the state dict.
METADATA_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    # `Metadata.all_local_plans`: the plans each rank saved with
    *(("torch.distributed.checkpoint.planner", name) for name in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # how a torch.layout is pickled: its name looked up among torch's
    ("collections", "OrderedDict"),
})
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)


def allowed_global(module: str, name: str) -> bool:
    """Whether `.metadata` may refer to `module.name`: one of METADATA_GLOBALS, or a dtype, layout or memory format
    of torch (`torch.bfloat16`)."""
    if (module, name) in METADATA_GLOBALS:
        return True
    return module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS)


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles `file` (the `.metadata` at `path`, named in errors), building no global but those `allowed_global`
    accepts: a pickle naming another one (os.system, builtins.eval, a class of some package) raises CheckpointError
    before that global is even imported."""

    def __init__(self, file, path: Path):  # noqa: ANN001
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> object:
        if not allowed_global(module, name):
            raise CheckpointError(
                f"{self.path}: refused: it asks to build {module}.{name}, which torch's checkpoint metadata never "
                "holds: a file naming it can run code (nothing of it was run); only torch's own metadata classes "
                "are read from a checkpoint")
        return super().find_class(module, name)


def read_metadata(checkpoint: str | Path) -> Metadata:
    """The metadata of Megatron (torch_dist) checkpoint directory `checkpoint`, unpickled by MetadataUnpickler.
    CheckpointError naming the file when it names a global outside the allow-list, is no pickle, or holds no
    torch `Metadata`."""
    path = Path(checkpoint) / METADATA_FILE
    try:
        with open(path, "rb") as handle:
            metadata = MetadataUnpickler(handle, path).load()
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing: not a Megatron distributed checkpoint") from None
    except Exception as exc:  # a garbled pickle raises many types (UnpicklingError, EOFError, ValueError, ...)
        raise CheckpointError(f"{path}: unreadable checkpoint metadata ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not torch's checkpoint Metadata")
    return metadata


class CheckpointReader(FileSystemReader):
    """torch's FileSystemReader of checkpoint directory `path` whose `.metadata` is read by `read_metadata` (once:
    torch and megatron-core ask for it several times per load). It takes no `rank` argument, so torch never falls
    back to per-rank metadata files (`__<rank>.metadata`, which megatron-core does not write)."""

    def __init__(self, path: str | Path):
        super().__init__(path)
        self._metadata: Metadata | None = None

    def read_metadata(self) -> Metadata:
        if self._metadata is None:
            metadata = read_metadata(Path(self.path))
            if getattr(metadata, "storage_meta", None) is None:  # as torch's own read_metadata does
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            self._metadata = metadata
        return self._metadata
