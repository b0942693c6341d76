"""Atomic writes and durable renames (`fileio`): a failed write leaves the old file and no temporary one; the file is
fsynced before its rename and its folder after it; a directory published by rename has every file and folder
fsynced first."""

import ast
import errno
import os
import stat
from pathlib import Path

import pytest

from megatron_scalerl import fileio
from megatron_scalerl.fileio import atomic_write_bytes, atomic_write_json, fsync_dir, fsync_tree, replace_durably


@pytest.fixture
def fsynced(monkeypatch):
    """The (device, inode, is a folder) of each descriptor os.fsync is given, in order; fsync still runs."""
    calls, real = [], os.fsync

    def record(fd):
        info = os.fstat(fd)
        calls.append((info.st_dev, info.st_ino, stat.S_ISDIR(info.st_mode)))
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    return calls


def _id(path, *, folder=False):
    info = os.stat(path)
    return info.st_dev, info.st_ino, folder


def test_an_atomic_write_fsyncs_the_file_then_its_folder(tmp_path, fsynced):
    atomic_write_json(tmp_path / "a.json", {"x": 1})
    assert fsynced[-1] == _id(tmp_path, folder=True)  # after the rename: the new name is on disk
    assert [folder for *_, folder in fsynced] == [False, True]  # the temp file's content, before the rename
    assert (tmp_path / "a.json").read_text() == '{\n  "x": 1\n}\n'


def test_a_write_that_fails_leaves_the_old_content_and_no_temporary_file(tmp_path, monkeypatch):
    target = tmp_path / "state.json"
    atomic_write_bytes(target, b"old")

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        atomic_write_bytes(target, b"new, never complete")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_move_between_folders_fsyncs_both(tmp_path, fsynced):
    (tmp_path / "from").mkdir()
    (tmp_path / "to").mkdir()
    (tmp_path / "from" / "batch").write_bytes(b"x")
    replace_durably(tmp_path / "from" / "batch", tmp_path / "to" / "batch")
    assert fsynced == [_id(tmp_path / "to", folder=True), _id(tmp_path / "from", folder=True)]
    assert (tmp_path / "to" / "batch").read_bytes() == b"x" and not (tmp_path / "from" / "batch").exists()


def test_a_directory_is_fsynced_whole_before_it_is_published(tmp_path, fsynced):
    tmp = tmp_path / ".out.partial"
    (tmp / "sub").mkdir(parents=True)
    (tmp / "a.bin").write_bytes(b"a")
    (tmp / "sub" / "b.bin").write_bytes(b"b")
    expected = {_id(tmp / "a.bin"), _id(tmp / "sub" / "b.bin"), _id(tmp, folder=True), _id(tmp / "sub", folder=True)}
    fsync_tree(tmp)
    assert set(fsynced) == expected and len(fsynced) == 4
    replace_durably(tmp, tmp_path / "out")
    assert fsynced[-1] == _id(tmp_path, folder=True)
    assert (tmp_path / "out" / "sub" / "b.bin").read_bytes() == b"b"


def test_a_filesystem_that_cannot_fsync_a_folder_is_left_at_that_but_a_failing_disk_is_not(tmp_path, monkeypatch):
    def refuse(code):
        def fsync(fd):
            raise OSError(code, os.strerror(code))
        return fsync

    open_fds = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(os, "fsync", refuse(errno.EINVAL))
    fsync_dir(tmp_path)  # some network and FUSE filesystems: nothing more to be had
    monkeypatch.setattr(os, "fsync", refuse(errno.EIO))
    with pytest.raises(OSError) as raised:
        fsync_dir(tmp_path)
    assert raised.value.errno == errno.EIO
    assert len(os.listdir("/proc/self/fd")) == open_fds  # the folder's descriptor closed either way


def test_every_rename_in_the_package_goes_through_replace_durably():
    """No `os.replace`, `os.rename` or `Path.rename` call outside `fileio`: a rename elsewhere would publish without
    the folder fsync (`replace_durably` is the one that has it)."""
    package = Path(fileio.__file__).parent
    found = []
    for path in package.rglob("*.py"):
        if path == Path(fileio.__file__):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                    node.func.attr == "rename" or (node.func.attr == "replace" and isinstance(node.func.value, ast.Name)
                                                   and node.func.value.id == "os")):
                found.append(f"{path.relative_to(package)}:{node.lineno}")
    assert found == []


def test_new_files_get_the_umasks_mode_read_without_changing_it(tmp_path):
    """An atomic write's file gets the mode open() would give it under the umask of the moment, and reading the
    umask leaves it as it was (it is read from /proc, not set to read it)."""
    before = os.umask(0o027)
    try:
        assert fileio.default_file_mode() == 0o640
        atomic_write_bytes(tmp_path / "a", b"x")
        assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o640
        assert os.umask(0o027) == 0o027  # unchanged by the reads
    finally:
        os.umask(before)
