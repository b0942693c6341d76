"""Checkpoints from elsewhere are read as data, never run (docs/design.md section 8, "A checkpoint from elsewhere").

A Megatron checkpoint's `.metadata` is unpickled through an allow-list of torch's metadata classes
(`checkpoint.unpickling`), its object items and `common.pt` with `torch.load(weights_only=True)`
(`checkpoint.load_strategies`); an HF directory's weights come from safetensors only (`models.hf_io`, vLLM told
`--load-format safetensors`). Every crafted file below creates a marker file when unpickled in full (as torch's
reader and planner did): it is refused with an error naming it, and the marker never appears. A real trainer
checkpoint of ours still resumes and converts through the same readers.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from megatron_scalerl.checkpoint.store import MANIFEST, CheckpointError, sha256_file
from megatron_scalerl.checkpoint.unpickling import METADATA_FILE, METADATA_GLOBALS, allowed_global, read_metadata
from megatron_scalerl.commands import main
from megatron_scalerl.errors import UserError
from megatron_scalerl.platform import run_local_workers
from tests.trainer_utils import BF16, rl_batch, run_scenarios, tiny_hf_checkpoint, tiny_recipe

CHECKPOINT = Path("checkpoints") / "iter_0000001"  # in the run directory: the one checkpoint `trained` writes


class _RunsCode:
    """Unpickling it runs a shell command that creates `marker` (what any crafted pickle could do instead)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _train_one_step(rank, run_dir, hf):
    """One step of the tiny dense model (bf16 body, FP32 head: the GPU recipe's dtypes) and its checkpoint; the
    weights saved, by HF name."""
    from megatron_scalerl.models import export_hf_state
    from megatron_scalerl.trainer.trainer import Trainer

    trainer = Trainer(run_dir, tiny_recipe(hf=hf, extra=BF16))
    trainer.train_step(rl_batch(0))
    trainer.checkpoint()
    return {name: t.clone() for name, t in export_hf_state(trainer.model[0], trainer.recipe.model)}


def _resume(rank, run_dir, hf):
    """A trainer resuming from `run_dir`'s checkpoint: (step, weights) after the load, or the CheckpointError's
    message."""
    from megatron_scalerl.models import export_hf_state
    from megatron_scalerl.trainer.trainer import Trainer

    try:
        trainer = Trainer(run_dir, tiny_recipe(hf=hf, extra=BF16))
    except CheckpointError as exc:
        return str(exc)
    return trainer.state.step, {name: t.clone() for name, t in export_hf_state(trainer.model[0], trainer.recipe.model)}


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> str:
    """The tiny dense model's HF directory (safetensors)."""
    return tiny_hf_checkpoint(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, hf):
    """(run directory holding one trainer checkpoint started from `hf`, `hf`, the weights it saved)."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    (weights,) = run_local_workers(_train_one_step, 1, str(run_dir), hf, timeout_s=600)
    return run_dir, hf, weights


def _crafted_copy(run_dir: Path, copy: Path, craft) -> Path:
    """`run_dir` copied to `copy`, its checkpoint's files changed by `craft(checkpoint)` (which returns the files it
    wrote, relative to it) and re-hashed in the manifest, as whoever crafted it would: the checksums pass."""
    shutil.copytree(run_dir, copy)
    checkpoint = copy / CHECKPOINT
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    for rel in craft(checkpoint):
        manifest["files"][rel] = {"bytes": (checkpoint / rel).stat().st_size, "sha256": sha256_file(checkpoint / rel)}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    return copy


def _metadata_running(marker: Path):
    """A `.metadata` that is the real one plus a callable its unpickling runs (in a field torch leaves alone)."""

    def craft(checkpoint: Path) -> list[str]:
        metadata = read_metadata(checkpoint)
        metadata.planner_data = _RunsCode(marker)
        (checkpoint / METADATA_FILE).write_bytes(pickle.dumps(metadata))
        return [METADATA_FILE]

    return craft


def _object_item_running(marker: Path):
    """An object item (a layer's `_extra_state`, a BytesStorageMetadata entry) that runs code when torch.load-ed:
    appended to its `.distcp` file, the real metadata pointed at it."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    def craft(checkpoint: Path) -> list[str]:
        metadata = read_metadata(checkpoint)
        index = next(i for i in metadata.storage_data
                     if isinstance(metadata.state_dict_metadata[i.fqn], BytesStorageMetadata))
        data = checkpoint / metadata.storage_data[index].relative_path
        item = io.BytesIO()
        torch.save([_RunsCode(marker)], item)
        offset = data.stat().st_size
        with open(data, "ab") as handle:
            handle.write(item.getvalue())
        metadata.storage_data[index] = _StorageInfo(data.name, offset, len(item.getvalue()))
        (checkpoint / METADATA_FILE).write_bytes(pickle.dumps(metadata))
        return [METADATA_FILE, data.name]

    return craft


def _common_running(marker: Path):
    """A `common.pt` that is the real one plus a callable."""

    def craft(checkpoint: Path) -> list[str]:
        common = torch.load(checkpoint / "common.pt", weights_only=True)
        torch.save({**common, "hook": _RunsCode(marker)}, checkpoint / "common.pt")
        return ["common.pt"]

    return craft


@pytest.mark.multiprocess
def test_every_global_a_real_metadata_names_is_allowed_and_the_list_holds_no_more(trained):
    """The allow-list is what a real trainer checkpoint's `.metadata` names (listed while unpickling it), besides
    OrderedDict and torch's dtypes."""
    names = set()

    class Listing(pickle.Unpickler):
        def find_class(self, module, name):
            names.add((module, name))
            return super().find_class(module, name)

    with open(trained[0] / CHECKPOINT / METADATA_FILE, "rb") as handle:
        Listing(handle).load()
    assert all(allowed_global(*name) for name in names)
    dtypes = {("torch", "bfloat16"), ("torch", "float32")}
    assert names - dtypes == METADATA_GLOBALS - {("collections", "OrderedDict")}
    assert not allowed_global("torch", "load") and not allowed_global("posix", "system")


@pytest.mark.multiprocess
def test_a_real_checkpoint_resumes_and_converts_through_the_restricted_readers(trained, tmp_path):
    from megatron_scalerl.models.convert import megatron_to_hf
    from megatron_scalerl.models.hf_io import LazyHFState
    from megatron_scalerl.recipe import ParallelismConfig

    run_dir, hf, weights = trained
    (resumed,) = run_local_workers(_resume, 1, str(run_dir), hf, timeout_s=600)
    step, loaded = resumed
    assert step == 1 and loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)
    exported = LazyHFState(megatron_to_hf(run_dir / CHECKPOINT, tmp_path / "hf", ParallelismConfig()))
    assert set(exported) == weights.keys() and all(torch.equal(exported[k], weights[k]) for k in weights)


def test_a_crafted_metadata_is_refused_naming_it_and_nothing_runs(trained, tmp_path, capsys):
    marker = tmp_path / "ran"
    copy = _crafted_copy(trained[0], tmp_path / "run", _metadata_running(marker))
    metadata = copy / CHECKPOINT / METADATA_FILE
    refusal = f"{metadata}: refused: it asks to build posix.system, which torch's checkpoint metadata never holds"
    with pytest.raises(CheckpointError, match=refusal):
        read_metadata(copy / CHECKPOINT)
    out = tmp_path / "hf"
    assert main(["convert", "megatron-to-hf", "--megatron", str(copy / CHECKPOINT), "--out", str(out)]) == 2
    assert refusal in capsys.readouterr().err
    assert not marker.exists() and not out.exists()
    with open(metadata, "rb") as handle:
        pickle.load(handle)  # what torch's reader does with it
    assert marker.exists()


@pytest.mark.multiprocess
def test_resuming_from_a_crafted_checkpoint_is_refused_naming_the_file_and_nothing_runs(trained, tmp_path):
    """Crafted `.metadata`, object item and `common.pt`, each in a copy of the run: the resume refuses each (one
    worker resumes all three)."""
    run_dir, hf, _ = trained
    crafts = {"metadata": _metadata_running, "object": _object_item_running, "common": _common_running}
    markers = {name: tmp_path / f"ran_{name}" for name in crafts}
    copies = {name: _crafted_copy(run_dir, tmp_path / name, craft(markers[name])) for name, craft in crafts.items()}
    (refusals,) = run_local_workers(run_scenarios, 1, {name: (_resume, str(copy), hf) for name, copy in
                                                        copies.items()}, timeout_s=600)
    assert [name for name, marker in markers.items() if marker.exists()] == []  # nothing ran
    checkpoint = {name: copy / CHECKPOINT for name, copy in copies.items()}
    assert refusals["metadata"].startswith(f"{checkpoint['metadata'] / METADATA_FILE}: refused: it asks to build "
                                           "posix.system")
    assert refusals["object"].startswith(f"{checkpoint['object']}/__0_")
    assert ".distcp: refused: object 'decoder.layers." in refusals["object"]
    assert "GLOBAL posix.system" in refusals["object"]
    assert refusals["common"].startswith(f"{checkpoint['common'] / 'common.pt'}: refused: it holds more than "
                                         "tensors and plain values")


# -- HF directories: safetensors only --------------------------------------------------------------------------------

@pytest.fixture
def bin_only(hf, tmp_path) -> Path:
    """An HF directory of the tiny model whose weights are one pickled `pytorch_model.bin` (a crafted one: loading it
    with pickle would create `tmp_path/ran`), no safetensors."""
    directory = tmp_path / "bin_only"
    shutil.copytree(hf, directory)
    for file in directory.glob("*.safetensors*"):
        file.unlink()
    torch.save({"model.embed_tokens.weight": torch.zeros(2), "hook": _RunsCode(tmp_path / "ran")},
               directory / "pytorch_model.bin")
    return directory


def _refused_hf(directory: Path, message: str) -> None:
    assert f"{directory}: weights only in pickled files (pytorch_model.bin)" in message
    assert "save_pretrained(OUT) writes safetensors" in message
    assert not (directory.parent / "ran").exists()


def test_a_bin_only_hf_directory_is_refused_by_our_loaders(bin_only):
    from megatron_scalerl.models.hf_io import load_hf_causal_lm, read_hf_checkpoint
    from megatron_scalerl.verify.parity import hf_reference

    for load in (lambda: read_hf_checkpoint(bin_only), lambda: load_hf_causal_lm(bin_only),
                 lambda: hf_reference(str(bin_only), torch.zeros(1, 4, dtype=torch.long),
                                      torch.zeros(1, 4, dtype=torch.long), with_grad=False)):
        with pytest.raises(UserError) as refused:
            load()
        _refused_hf(bin_only, str(refused.value))


def test_a_bin_only_hf_directory_is_refused_by_the_commands_that_load_one(bin_only, capsys):
    """`scalerl verify logits --hf` (transformers) and `scalerl serve --model` (vLLM) refuse it before loading
    anything; the launchers' generators (`--load-format dummy`: weights by sync) are not asked for safetensors."""
    assert main(["verify", "logits", "--hf", str(bin_only)]) == 2
    _refused_hf(bin_only, capsys.readouterr().err)
    assert main(["serve", "--model", str(bin_only), "--no-api-key"]) == 2
    refusal = capsys.readouterr().err
    assert f"--model {bin_only}: " in refusal
    _refused_hf(bin_only, refusal)


def test_vllm_servers_load_safetensors_unless_told_another_load_format(tmp_path):
    from megatron_scalerl.inference.vllm_server import VLLMServerConfig

    def load_formats(*extra: str) -> list[str]:
        """The load formats the server command gives (`--load-format F` or `--load-format=F`)."""
        cmd = VLLMServerConfig(model=str(tmp_path), port=1, extra_args=extra).command()
        return [cmd[i + 1] if arg == "--load-format" else arg.removeprefix("--load-format=")
                for i, arg in enumerate(cmd) if arg.split("=")[0] == "--load-format"]

    assert load_formats() == ["safetensors"]
    assert load_formats("--load-format", "dummy") == ["dummy"]
    assert load_formats("--load-format=dummy") == ["dummy"]
