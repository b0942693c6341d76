"""The disk transport, both ends in one class: every bucket a safetensors file on a filesystem the trainer and the
generators both mount (`directory`/SYNC/bucket-NNNNN.safetensors, written atomically; each sync's files are removed
at the sender's next sync), for generators the trainer cannot reach over a process group. The sender writes
(`transport.WeightTransport`'s `listen`, `open`, `send`); every worker reads (`join`, `receive`), waiting up to the
timeout for each file.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from safetensors.torch import load_file, save_file
from torch import Tensor

from megatron_scalerl.weight_sync.protocol import SYNC_TIMEOUT_S, Bucket, describe_header

DISK_POLL_S = 0.05


class DiskTransport:
    """Each bucket as a safetensors file (one uint8 tensor `packed`, the header in the file's metadata) under the
    sender's own `directory`, one folder per sync."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else None
        self.timeout_s = SYNC_TIMEOUT_S
        self.current = ""  # the sync whose files the sender wrote last

    def listen(self, address: str) -> dict:
        assert self.directory is not None, "a disk sender needs its directory"
        self.directory.mkdir(parents=True, exist_ok=True)
        return {"transport": "disk", "directory": str(self.directory)}

    def open(self, world_size: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    def path(self, sync: str, index: int) -> Path:
        return self.directory / sync / f"bucket-{index:05d}.safetensors"

    def send(self, bucket: Bucket, sync: str) -> None:
        if sync != self.current:  # the previous sync's files were read (its update was applied or abandoned)
            self._remove_syncs()
            self.current = sync
        path = self.path(sync, bucket.index)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        save_file({"packed": bucket.packed.cpu()}, str(partial), metadata={"header": json.dumps(bucket.header())})
        partial.replace(path)

    def join(self, endpoint: dict, rank: int, world_size: int, timeout_s: float) -> None:
        self.directory, self.timeout_s = Path(endpoint["directory"]), timeout_s

    def receive(self, header: dict, sync: str) -> Tensor:
        path = self.path(sync, header["index"])
        deadline = time.monotonic() + self.timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path}: not written within {self.timeout_s:g} s ({describe_header(header)})")
            time.sleep(DISK_POLL_S)
        packed = load_file(str(path))["packed"]
        if packed.numel() != header["nbytes"]:
            raise ValueError(f"{path}: {packed.numel()} bytes, the plan says {header['nbytes']}")
        return packed

    def _remove_syncs(self) -> None:
        for old in self.directory.iterdir() if self.directory.exists() else ():
            shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        if self.current:
            self._remove_syncs()
            self.current = ""
