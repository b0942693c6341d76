"""Small file helpers shared by every tool: atomic writes and a YAML loader that reads `1e-6` as a float.

Every file in a run directory is written through `atomic_write_*` (temp file in the same folder, fsync, rename, fsync
of the folder), so a crash leaves either the old content or the new one, never a torn file. A rename lives in its
folder's entries, which reach the disk on their own schedule: `fsync_dir` makes a rename (or a new file) durable, and
`replace_durably` is the rename + folder fsync that every publication by rename in the package goes through (whole
directories too, their contents fsynced first with `fsync_tree`).
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import yaml

from megatron_scalerl.errors import UserError


def default_file_mode() -> int:
    """The mode open() gives a new file under this process's umask now (0o644 under the usual 022). Files that
    libraries create through private temporary files (mkstemp, safetensors) get 0600 and are set to this. The umask
    is read from /proc/self/status (setting it to read it would change it for every thread meanwhile)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Umask:"):
            return 0o666 & ~int(line.split()[1], 8)
    raise RuntimeError("/proc/self/status has no Umask line (Linux 4.7 or later is needed)")


class _Loader(yaml.SafeLoader):
    """SafeLoader whose float rule also accepts `1e-6` (YAML 1.1 wants `1.0e-6` and would return a string)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def parse_yaml(text: str, source: str) -> Any:
    """Parse YAML text; `source` (a file name or `--set ...`) is named in the error."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader derives from SafeLoader
    except yaml.YAMLError as exc:
        detail = " ".join(str(exc).split())
        raise UserError(f"{source}: invalid YAML: {detail}") from None


def load_yaml(path: str | os.PathLike) -> Any:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise UserError(f"{path}: cannot read: {exc.strerror}") from None
    return parse_yaml(text, str(path))


def dump_yaml(data: Any) -> str:
    """Block-style YAML that keeps key order."""
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True, width=120)


def json_safe(value: Any) -> Any:
    """`value` with tensors/numpy scalars as Python numbers and NaN/inf as null (JSON has no such numbers)."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:  # 0-dim tensors and numpy scalars
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush folder `path`'s entries to disk: after it, the files renamed into it, created or removed there stay so
    through a crash (fsync of a file covers its content, not its name). A filesystem that cannot fsync a folder
    (EINVAL or ENOTSUP: some network and FUSE ones) has no stronger promise to give, and is left at that."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    """Flush the content of file `path`, written by this process or another one, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file and folder under `root` (itself included): before a directory is renamed into place, so that
    what the rename publishes is on disk whole."""
    for folder, _, files in os.walk(root):
        for name in files:
            fsync_file(os.path.join(folder, name))
        fsync_dir(folder)


def replace_durably(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """`os.replace(src, dst)`, then fsync of the folder(s) involved, so that the rename survives a crash. `src` (a
    file or a directory) must already be on disk itself (`atomic_write_bytes` fsyncs its file, `fsync_tree` a
    directory)."""
    os.replace(src, dst)
    fsync_dir(Path(dst).parent)
    if Path(src).parent != Path(dst).parent:
        fsync_dir(Path(src).parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, mode: int | None = None) -> None:
    """Write `data` to `path` via a temp file in the same folder + fsync + rename + fsync of the folder; the file has
    `mode` (default: `default_file_mode()`) from its creation on (0o600: never readable by others, not even while it
    is written)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, default_file_mode() if mode is None else mode)  # mkstemp makes 0600
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        replace_durably(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")
