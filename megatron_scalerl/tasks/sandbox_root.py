"""What a Python interpreter needs to run in an empty root: the bwrap options that bind its files read-only.

`interpreter_binds(python)` asks the interpreter where its standard library and shared library are, asks `ldd` which
shared libraries it and its extension modules load, and returns `--ro-bind` options for those files and directories
(the loader's cache too), each at its own path, with `--symlink` options for the host's symlinks on the way (/lib ->
usr/lib on merged-/usr systems). Nothing else of the host is bound: tasks/sandbox.py builds the rest of the root.
Raises OSError or subprocess.SubprocessError when the interpreter cannot be asked.
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}  # the environment of every sandboxed process


@functools.cache
def interpreter_binds(python: str) -> tuple[str, ...]:
    """bwrap options that make the interpreter `python` run in an empty root: its executable, standard library and
    shared library, the directories of the libraries it and its extension modules load (from `ldd`) and the
    loader's cache, each read-only at its own path, with the host's symlinks on the way (/lib -> usr/lib)."""
    query = ("import sys, sysconfig; c = sysconfig.get_config_var; "
             "print(sysconfig.get_path('stdlib')); print(sysconfig.get_path('platstdlib')); "
             "print(c('LIBDIR') or ''); print(c('LDLIBRARY') or '')")
    info = subprocess.run([python, "-I", "-S", "-c", query], capture_output=True, text=True, timeout=30, check=True,
                          env=ENV).stdout.splitlines()
    stdlib, platstdlib, libdir, ldlibrary = (info + ["", "", "", ""])[:4]
    files = [python, stdlib, platstdlib, os.path.join(libdir, ldlibrary) if libdir and ldlibrary else "",
             "/etc/ld.so.cache"]
    extensions = sorted(str(p) for p in Path(platstdlib, "lib-dynload").glob("*.so"))
    for library in _shared_libraries([python, *extensions]):
        files.append(os.path.dirname(library))
    ops: dict[str, tuple[str, ...]] = {}
    for path in files:
        if path and os.path.exists(path):
            _expose(os.path.abspath(path), ops)
    return tuple(word for op in ops.values() for word in op)


def _shared_libraries(binaries: list[str]) -> list[str]:
    """The paths of the shared libraries `ldd` finds for `binaries` (the loader included)."""
    try:
        listing = subprocess.run(["ldd", *binaries], capture_output=True, text=True, timeout=60, env=ENV).stdout
    except (OSError, subprocess.SubprocessError):
        return []  # a static interpreter, or no ldd: nothing more to bind
    libraries = set()
    for line in listing.splitlines():
        words = line.replace("=>", " ").split()
        paths = [w for w in words if w.startswith("/")]
        if paths:
            libraries.add(paths[0])
    return sorted(libraries)


def _expose(path: str, ops: dict[str, tuple[str, ...]], depth: int = 0) -> None:
    """Add to `ops` (keyed by the path inside) what makes the host's `path` resolve to the same file inside: bwrap
    `--symlink` for each symlink on the way, `--ro-bind` of the real path."""
    if depth > 40:
        raise OSError(f"too many symlinks on the way to {path}")
    current = "/"
    parts = Path(path).parts[1:]
    for i, part in enumerate(parts):
        current = os.path.join(current, part)
        if os.path.islink(current):
            target = os.readlink(current)
            ops.setdefault(current, ("--symlink", target, current))
            resolved = os.path.normpath(os.path.join(os.path.dirname(current), target))
            _expose(os.path.join(resolved, *parts[i + 1:]), ops, depth + 1)
            return
    ops.setdefault(path, ("--ro-bind", path, path))
