"""Read a Hugging Face checkpoint directory: config.json (through its model family: `recipe.read_hf_config`) plus
safetensors (one file or sharded with an index); build transformers' config and models of a recipe model section.

Tensors are read on demand (`LazyHFState`), so a rank loads only what its shard needs. Weights come from safetensors
only: a directory holding them pickled (`pytorch_model.bin`, which loading would unpickle, running whatever a file
from elsewhere says) is refused by `require_safetensors`, naming it and how to convert it; `load_hf_causal_lm` is
transformers' `from_pretrained` behind that check, told `use_safetensors=True`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from megatron_scalerl.errors import UserError
from megatron_scalerl.families import hf_config_dict
from megatron_scalerl.recipe import ModelConfig, read_hf_config

if TYPE_CHECKING:  # torch is imported where a tensor is made: `scalerl serve` reads config files only
    from torch import Tensor

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt")  # transformers' pytorch_model*.bin, and torch.save files


def has_safetensors(directory: str | Path) -> bool:
    """Whether HF directory `directory` holds its weights as safetensors (one file, or an index of shards)."""
    return (Path(directory) / SINGLE_FILE).is_file() or (Path(directory) / INDEX_FILE).is_file()


def require_safetensors(directory: str | Path, what: str = "") -> None:
    """UserError naming `directory` (`what`: how the user gave it, e.g. "--model ") unless it holds safetensors
    weights; one whose weights are pickled is told how to convert them where they are trusted."""
    directory = Path(directory)
    if has_safetensors(directory):
        return
    pickled = sorted(p.name for pattern in PICKLED_WEIGHTS for p in directory.glob(pattern))
    if not pickled:
        raise UserError(f"{what}{directory}: no {SINGLE_FILE} or {INDEX_FILE} (HF weights in safetensors format)")
    raise UserError(
        f"{what}{directory}: weights only in pickled files ({', '.join(pickled[:3])}), which loading would unpickle "
        "(a file from elsewhere runs code that way): refused. Convert them once, where the files are trusted: "
        "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(OUT) writes safetensors (transformers before 5: "
        "add safe_serialization=True), then use OUT")


def load_hf_causal_lm(directory: str | Path, **kwargs: Any):
    """transformers' AutoModelForCausalLM of `directory` (`kwargs`: `from_pretrained`'s, e.g. `dtype`), read from
    safetensors only: a local directory without them is refused (`require_safetensors`), and transformers is told
    `use_safetensors=True`, so a hub name does not fall back to a pickled file either."""
    from transformers import AutoModelForCausalLM

    if Path(directory).is_dir():
        require_safetensors(directory)
    return AutoModelForCausalLM.from_pretrained(str(directory), use_safetensors=True, **kwargs)


def _safe_open(path: Path):
    try:
        return safe_open(path, framework="pt")
    except Exception as exc:  # safetensors raises its own error type for truncated or garbled files
        raise UserError(f"{path}: unreadable safetensors file ({exc})") from None


def _indexed_file(directory: Path, index: Path, name: str, file: object) -> Path:
    """The path of safetensors file `file`, which `index`'s weight_map gives for tensor `name`; UserError naming both
    unless it stays inside `directory`: a relative name without `..`, which is no link to somewhere outside either.
    Only the Hugging Face hub cache's own layout links out: `<repo>/snapshots/<revision>/` holds links into
    `<repo>/blobs/`, which are accepted there."""
    where = f"{index}: weight_map entry {name!r}"
    if not isinstance(file, str) or not file:
        raise UserError(f"{where}: {file!r} is not a file name")
    if Path(file).is_absolute() or ".." in Path(file).parts:
        raise UserError(f"{where} names {file!r}, outside {directory}: refused (an index lists only files of its own "
                        "directory)")
    root = directory.resolve()
    target = (directory / file).resolve()
    inside = [root, root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [root]
    if not any(target.is_relative_to(folder) for folder in inside):
        raise UserError(f"{where} names {file!r}, a link to {target}, outside {directory}: refused (an index lists "
                        "only files of its own directory)")
    return directory / file


class LazyHFState(Mapping[str, "Tensor"]):
    """HF tensor name -> tensor, read from the directory's safetensors files when asked for."""

    def __init__(self, directory: Path):
        self.directory = directory
        index = directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise UserError(f"{index}: not a safetensors index ({exc})") from None
            files: dict[str, Path] = {}  # each file checked once, not once per tensor
            for name, file in weight_map.items():
                if not isinstance(file, str) or file not in files:
                    files[file] = _indexed_file(directory, index, name, file)
            self._file_of = {name: files[file] for name, file in weight_map.items()}
        elif (directory / SINGLE_FILE).is_file():
            with _safe_open(directory / SINGLE_FILE) as handle:
                self._file_of = {name: directory / SINGLE_FILE for name in handle.keys()}  # noqa: SIM118
        else:
            require_safetensors(directory)  # raises: neither file is there

    def _open(self, name: str):
        path = self._file_of[name]
        if not path.is_file():
            raise UserError(f"{path}: listed in the index for {name} but missing")
        return _safe_open(path)

    def __getitem__(self, name: str) -> Tensor:
        with self._open(name) as handle:
            return handle.get_tensor(name)

    def shape_and_dtype(self, name: str) -> tuple[tuple[int, ...], str]:
        """The stored shape and safetensors dtype name (e.g. 'BF16') of tensor `name`, from the file header only."""
        with self._open(name) as handle:
            view = handle.get_slice(name)
            return tuple(view.get_shape()), view.get_dtype()

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)


def read_hf_checkpoint(directory: str | Path) -> tuple[ModelConfig, LazyHFState]:
    """The model config and lazily-read weights of an HF checkpoint directory."""
    _, model_cfg = read_hf_config(directory)
    return model_cfg, LazyHFState(Path(directory))


def hf_model_config(model_cfg: ModelConfig, **extra: Any):
    """transformers' config object for `model_cfg` (`extra`: further config attributes)."""
    from transformers import AutoConfig

    config_dict = hf_config_dict(model_cfg)
    kwargs = {k: v for k, v in config_dict.items() if k not in ("model_type", "torch_dtype")}
    return AutoConfig.for_model(config_dict["model_type"], **kwargs, **extra)


def hf_tensor_shapes(model_cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for `model_cfg`, as transformers writes a checkpoint of it (built on the meta device:
    no memory); the oracle a checkpoint's stored shapes are checked against. transformers 5 holds some models' experts
    fused in memory (Qwen3-MoE's `mlp.experts.gate_up_proj`) and writes them one tensor per expert, as released
    checkpoints have them: the names are the written ones."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_model_config(model_cfg))
        state = revert_weight_conversion(model, model.state_dict())
    return {name: tuple(tensor.shape) for name, tensor in state.items()}


def save_random_hf_model(model_cfg: ModelConfig, directory: str | Path, *, seed: int, std: float = 0.02) -> Path:
    """Write an HF checkpoint of `model_cfg` with transformers' own random init (normal(0, `std`) weights), norm
    weights drawn from U(0.5, 1.5) and the checkpoint's buffers (DeepSeek-V3's routing bias, zero at init) from
    U(-0.1, 0.1), so that a norm or a bias mapped to the wrong place shows. Returns the directory."""
    import torch
    from transformers import AutoModelForCausalLM

    config = hf_model_config(model_cfg, initializer_range=std)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
        persistent = model.state_dict()
        for name, buffer in model.named_buffers():
            if name in persistent and buffer.is_floating_point():
                buffer.uniform_(-0.1, 0.1)
    model.save_pretrained(directory)
    return Path(directory)
