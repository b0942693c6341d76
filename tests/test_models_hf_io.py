"""Reading an HF checkpoint's sharded safetensors (`LazyHFState`): the index's file names stay inside the checkpoint
directory; one that leads out (absolute, `..`, a link to elsewhere) is refused, naming the index and the entry."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megatron_scalerl.errors import UserError
from megatron_scalerl.models.hf_io import INDEX_FILE, LazyHFState

WEIGHT = torch.arange(6, dtype=torch.float32).reshape(2, 3)


def _checkpoint(directory: Path, files: dict[str, str]) -> Path:
    """`directory` with an index mapping each tensor name of `files` to its file name (as written)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": files}))
    return directory


def test_shards_inside_the_directory_are_read(tmp_path):
    hf = _checkpoint(tmp_path / "hf", {"w": "model-00001-of-00001.safetensors"})
    save_file({"w": WEIGHT}, hf / "model-00001-of-00001.safetensors")
    state = LazyHFState(hf)
    assert list(state) == ["w"] and torch.equal(state["w"], WEIGHT)


@pytest.mark.parametrize("name", ["../outside.safetensors", "sub/../../outside.safetensors", "absolute"])
def test_an_index_entry_leading_out_of_the_directory_is_refused(tmp_path, name):
    save_file({"w": WEIGHT}, tmp_path / "outside.safetensors")
    if name == "absolute":
        name = str(tmp_path / "outside.safetensors")
    hf = _checkpoint(tmp_path / "hf", {"model.embed_tokens.weight": name})
    with pytest.raises(UserError) as refused:
        LazyHFState(hf)
    assert str(refused.value).startswith(f"{hf / INDEX_FILE}: weight_map entry 'model.embed_tokens.weight' names "
                                         f"{name!r}, outside {hf}: refused")


def test_a_link_from_the_directory_to_elsewhere_is_refused(tmp_path):
    save_file({"w": WEIGHT}, tmp_path / "secret.safetensors")
    hf = _checkpoint(tmp_path / "hf", {"w": "model.safetensors"})
    (hf / "model.safetensors").symlink_to(tmp_path / "secret.safetensors")
    with pytest.raises(UserError, match=r"weight_map entry 'w' names 'model.safetensors', a link to .*secret"
                                        r"\.safetensors, outside .*hf: refused") as refused:
        LazyHFState(hf)
    assert str(refused.value).startswith(str(hf / INDEX_FILE))


def test_the_hub_caches_links_from_a_snapshot_into_its_blobs_are_read(tmp_path):
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    save_file({"w": WEIGHT}, repo / "blobs" / "0123abcd")
    snapshot = _checkpoint(repo / "snapshots" / "rev1", {"w": "model-00001-of-00001.safetensors"})
    (snapshot / "model-00001-of-00001.safetensors").symlink_to("../../blobs/0123abcd")
    assert torch.equal(LazyHFState(snapshot)["w"], WEIGHT)
    (repo / "elsewhere").mkdir()  # within the repo's cache folder, but not its blobs: refused
    save_file({"w": WEIGHT}, repo / "elsewhere" / "x")
    (snapshot / "model-00001-of-00001.safetensors").unlink()
    (snapshot / "model-00001-of-00001.safetensors").symlink_to("../../elsewhere/x")
    with pytest.raises(UserError, match="a link to .*elsewhere/x, outside"):
        LazyHFState(snapshot)
