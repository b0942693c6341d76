"""HF <-> Megatron checkpoint conversion at any layout: the code behind `scalerl convert`.

    check_hf_checkpoint(hf_dir) -> (ModelConfig, dtypes)     config, every tensor present, readable, HF's shape
    hf_to_megatron(hf_dir, out, parallelism, dtype=None)     -> OUT: a Megatron distributed checkpoint
    megatron_to_hf(ckpt, out, parallelism, dtype=None)       -> OUT: HF safetensors shards + index + config

Both directions run `parallelism.min_world_size()` spawned workers (gloo on CPU), each holding only its own shard
of the model at that layout; tensors move one at a time (HF tensors are read lazily; export gathers one full tensor
at a time and a writer keeps at most one output file of `shard_bytes` in memory). Run a large model (the 8B and
Scout presets) at a layout that splits it, e.g. `--tp 8`: then no process ever holds it whole.

Dtypes are kept tensor by tensor unless `dtype` is given: a converted checkpoint records each HF tensor's dtype and
gives it back (a bf16 model with an FP32 LM head round-trips bit-exactly), a trainer checkpoint exports the trainer's
dtypes (bf16 body, FP32 head); `config.json` names the body's dtype, and transformers and vLLM cast on load. With
tied embeddings the head is `model.embed_tokens.weight` (one tensor, no `lm_head.weight`), FP32 under a bf16 body
when the trainer ran the FP32 head (`models.output_layer.adopt_tied_embedding`).

Outputs are written under a temporary name and renamed at the end: an interrupted conversion leaves no half-written
OUT. A Megatron output is published with a checksummed manifest (`checkpoint.store.publish`)
and carries the source's config.json and tokenizer files under `hf/`, which megatron-to-hf copies back out, and the
HF tensors nothing here trains (DeepSeek-V3's multi-token-prediction layers: `carried_hf_names`) as they were stored,
in `hf/carried.safetensors`: megatron-to-hf writes them back unchanged (from the run's starting HF directory, for a
trainer's checkpoint), so HF -> Megatron -> HF gives back every tensor of the original.

megatron-core is imported only where a model is built (`models.provider`, `models.weights`, in the conversion's
workers): the eval watcher and the checks before a conversion read checkpoints through this module without it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from megatron_scalerl.checkpoint.sharded import checkpoint_model_config, load_model_weights, save_sharded
from megatron_scalerl.checkpoint.store import publish, read_rl_state, require_complete, sha256_file
from megatron_scalerl.checkpoint.unpickling import read_metadata
from megatron_scalerl.errors import UserError
from megatron_scalerl.families import FAMILIES, hf_config_dict
from megatron_scalerl.fileio import default_file_mode, fsync_tree, replace_durably
from megatron_scalerl.models.arch import check_model_layout
from megatron_scalerl.models.hf_io import INDEX_FILE, LazyHFState, has_safetensors, hf_tensor_shapes
from megatron_scalerl.models.mapping import hf_parameter_names, kept_fp32
from megatron_scalerl.models.tokenizer import GENERATION_CONFIG, TOKENIZER_FILES, ensure_generation_config
from megatron_scalerl.platform.distributed import initialize_model_parallel
from megatron_scalerl.platform.local_workers import WorkerError, run_local_workers
from megatron_scalerl.recipe import ModelConfig, ParallelismConfig, load_run_recipe, read_hf_config
from megatron_scalerl.run.directory import RECIPE_FILE

HF_EXTRAS_DIR = "hf"  # inside a converted Megatron checkpoint: the source's config.json and tokenizer files
HF_EXTRA_FILES = ("config.json", GENERATION_CONFIG, *TOKENIZER_FILES)
CARRIED_FILE = "carried.safetensors"  # in a converted checkpoint's hf/: the HF tensors not trained (carried_hf_names)
CHECKSUMS_FILE = "checksums.sha256"  # in an HF output: `sha256sum -c checksums.sha256` format
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F32": "float32", "F16": "float16"}
HEAD = "lm_head.weight"
CONVERT_TIMEOUT_S = 3600.0  # seconds a conversion's workers get before they are stopped (`--timeout`)
EMBEDDING = "model.embed_tokens.weight"
# A body tensor of every family (`mapping.attention_rules`); not the embedding, FP32 when it is a tied FP32 head
BODY = "model.layers.0.self_attn.o_proj.weight"


# -- HF input -----------------------------------------------------------------------------------------------------

def check_hf_checkpoint(hf_dir: str | Path) -> tuple[ModelConfig, dict[str, str]]:
    """(ModelConfig, HF name -> stored dtype name) of an HF checkpoint, after checking without loading any tensor
    that every tensor the model needs is listed, its file is readable and its shape is what config.json implies."""
    hf_dir = Path(hf_dir)
    _, model_cfg = read_hf_config(hf_dir)
    state = LazyHFState(hf_dir)
    expected = hf_tensor_shapes(model_cfg)
    dtypes = {}
    for name in hf_parameter_names(model_cfg):
        if name not in state:
            raise UserError(f"{hf_dir}: no tensor {name} in the safetensors files (config.json implies it)")
        shape, dtype = state.shape_and_dtype(name)
        if shape != expected[name]:
            raise UserError(f"{hf_dir}: {name} has shape {list(shape)} but config.json implies {list(expected[name])}")
        if dtype not in _SAFETENSORS_DTYPES:
            raise UserError(f"{hf_dir}: {name} is stored as {dtype}; supported: {', '.join(_SAFETENSORS_DTYPES)}")
        dtypes[name] = _SAFETENSORS_DTYPES[dtype]
    return model_cfg, dtypes


def _model_dtypes(body: str, head: str) -> tuple[torch.dtype, bool]:
    """(params dtype, FP32 head?) of a model whose body tensors are `body` and LM head `head` (dtype names; with tied
    embeddings the head is the embedding, FP32 with the FP32 head)."""
    return DTYPES[body], head == "float32" and body != "float32"


def _build(model_cfg: ModelConfig, parallelism: ParallelismConfig, body: str, head: str) -> torch.nn.Module:
    from megatron_scalerl.models.provider import build_model  # deferred, as models.weights below: megatron-core

    params_dtype, fp32_head = _model_dtypes(body, head)
    return build_model(model_cfg, parallelism, fp32_lm_head=fp32_head, params_dtype=params_dtype)


def _head_name(model_cfg: ModelConfig) -> str:
    """The HF tensor that holds the LM head: the embedding itself when they are tied."""
    return EMBEDDING if model_cfg.tie_word_embeddings else HEAD


def carried_hf_names(names: Iterable[str], model_cfg: ModelConfig) -> list[str]:
    """Of the HF tensor names `names`, those of the checkpoint's multi-token-prediction layers (DeepSeek-V3's
    `num_nextn_predict_layers` layers past the last decoder layer, `model.layers.{i}.*`, as DeepSeek releases them):
    not trained here, carried through every conversion unchanged (`_carried_tensors`)."""
    first = model_cfg.num_layers
    prefixes = tuple(f"model.layers.{i}." for i in range(first, first + model_cfg.num_nextn_predict_layers))
    return [name for name in names if name.startswith(prefixes)] if prefixes else []


def _carried_tensors(source: Path | None, model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The carried tensors (`carried_hf_names`), as stored, where `source` keeps them: a converted checkpoint's `hf/`
    (its CARRIED_FILE) or an HF checkpoint directory (the one a trainer's run started from); none elsewhere."""
    if source is None or not model_cfg.num_nextn_predict_layers:
        return {}
    if (source / CARRIED_FILE).is_file():
        return load_file(source / CARRIED_FILE)
    if not has_safetensors(source):
        return {}
    state = LazyHFState(source)
    return {name: state[name] for name in carried_hf_names(state, model_cfg)}


def _copy_hf_extras(source: Path, target: Path) -> list[str]:
    """Copy config.json and tokenizer files from `source` (if there) into `target`; the names copied."""
    target.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in HF_EXTRA_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
            copied.append(name)
    return copied


# -- HF -> Megatron -------------------------------------------------------------------------------------------------

def _hf_to_megatron_worker(rank: int, model_cfg_json: str, hf_dir: str, parallelism_json: str, body: str, head: str,
                           hf_dtypes: dict[str, str], out: str) -> None:
    from megatron.core import parallel_state as ps

    from megatron_scalerl.models.weights import load_hf_state  # deferred: megatron-core (module docstring)

    model_cfg = ModelConfig.model_validate_json(model_cfg_json)
    p = ParallelismConfig.model_validate_json(parallelism_json)
    initialize_model_parallel(p.tp, p.pp, p.ep, p.expert_tp_size)
    try:
        gpt = _build(model_cfg, p, body, head)
        load_hf_state(gpt, LazyHFState(Path(hf_dir)), model_cfg)

        def write(tmp: Path) -> None:
            save_sharded({"model": gpt.sharded_state_dict()}, tmp, in_place=True)
            if rank == 0:
                _copy_hf_extras(Path(hf_dir), tmp / HF_EXTRAS_DIR)
                carried = _carried_tensors(Path(hf_dir), model_cfg)
                if carried:
                    save_file(carried, tmp / HF_EXTRAS_DIR / CARRIED_FILE, metadata={"format": "pt"})

        rl_state = {"model": model_cfg.model_dump(mode="json"), "converted_from": str(Path(hf_dir).resolve()),
                    "layout": p.label, "hf_dtypes": hf_dtypes}
        publish(Path(out), write, rl_state, {"iteration": 0, "kind": "converted from HF"})
    finally:
        ps.destroy_model_parallel()


def hf_to_megatron(hf_dir: str | Path, out: str | Path, parallelism: ParallelismConfig, *, dtype: str | None = None,
                   timeout_s: float = CONVERT_TIMEOUT_S) -> Path:
    """Convert an HF checkpoint into a Megatron distributed checkpoint at `out` (loadable at any layout, e.g. as
    `trainer.init_from`), converting at `parallelism` on its `min_world_size()` processes."""
    hf_dir, out = Path(hf_dir), Path(out)
    _refuse_existing(out)
    model_cfg, dtypes = check_hf_checkpoint(hf_dir)
    check_model_layout(model_cfg, parallelism)
    body = dtype or dtypes[BODY]
    head = dtype or dtypes[_head_name(model_cfg)]
    hf_dtypes = {name: stored if kept_fp32(name) else dtype or stored for name, stored in dtypes.items()}
    _run(_hf_to_megatron_worker, parallelism, model_cfg.model_dump_json(), str(hf_dir),
         parallelism.model_dump_json(), body, head, hf_dtypes, str(out), timeout_s=timeout_s)
    return out


# -- Megatron -> HF -------------------------------------------------------------------------------------------------

def megatron_dtypes(ckpt: Path, model_cfg: ModelConfig) -> tuple[str, str]:
    """(body, head) dtype names of a Megatron checkpoint, from its metadata (no tensor is read): the body's is the
    dtype of most of the decoder's elements (CPU layers keep their norms in FP32 under a bf16 body). The metadata is
    unpickled through the allow-list of `checkpoint.unpickling`."""
    metadata = read_metadata(ckpt).state_dict_metadata

    def dtype_of(meta) -> str:  # noqa: ANN001
        return str(meta.properties.dtype).removeprefix("torch.")

    head_key = "embedding.word_embeddings.weight" if model_cfg.tie_word_embeddings else "output_layer.weight"
    if not hasattr(metadata.get(head_key), "properties"):
        raise UserError(f"{ckpt}: no tensor {head_key} in the checkpoint metadata")
    elements: dict[str, int] = {}  # the decoder's tensors (keys depend on the layers' kinds): elements per dtype
    for key, meta in metadata.items():
        if key.startswith("decoder.") and hasattr(meta, "properties"):
            elements[dtype_of(meta)] = elements.get(dtype_of(meta), 0) + meta.size.numel()
    if not elements:
        raise UserError(f"{ckpt}: no decoder tensor in the checkpoint metadata")
    return max(elements, key=elements.__getitem__), dtype_of(metadata[head_key])


class _ShardWriter:
    """Writes HF tensors into safetensors files of at most `max_bytes` each (one file's tensors in memory)."""

    def __init__(self, directory: Path, prefix: str, max_bytes: int, total: int):
        from tqdm import tqdm

        self.directory, self.prefix, self.max_bytes = directory, prefix, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str], str]] = []  # (file name, tensor names, sha256)
        self.progress = tqdm(total=total, desc=f"export {prefix}", unit="tensor", file=sys.stderr)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.progress.update()

    def flush(self) -> None:
        if not self.pending:
            return
        name = f"{self.prefix}-{len(self.files):05d}.safetensors"
        save_file(self.pending, self.directory / name, metadata={"format": "pt"})
        os.chmod(self.directory / name, default_file_mode())  # safetensors writes 0600: servers run as other users
        self.files.append((name, list(self.pending), sha256_file(self.directory / name)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[tuple[str, list[str], str]]:
        self.flush()
        self.progress.close()
        return self.files


def _megatron_to_hf_worker(rank: int, model_cfg_json: str, ckpt: str, parallelism_json: str, dtypes: tuple,
                           out_dtypes: dict[str, str] | str | None, tmp_out: str, shard_bytes: int) -> list:
    """`out_dtypes`: one dtype name for every tensor, a dtype name per HF name, or None (keep the model's)."""
    from megatron.core import parallel_state as ps

    from megatron_scalerl.models.weights import export_hf_state, exported_hf_names  # deferred: megatron-core

    model_cfg = ModelConfig.model_validate_json(model_cfg_json)
    p = ParallelismConfig.model_validate_json(parallelism_json)
    initialize_model_parallel(p.tp, p.pp, p.ep, p.expert_tp_size)
    try:
        gpt = _build(model_cfg, p, *dtypes)
        load_model_weights(Path(ckpt), gpt)
        stage = ps.get_pipeline_model_parallel_rank()
        writes = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
        total = len(exported_hf_names(gpt, model_cfg))
        writer = _ShardWriter(Path(tmp_out), f"stage{stage:03d}", shard_bytes, total) if writes else None
        for name, tensor in export_hf_state(gpt, model_cfg, to_first_rank=True):
            if writer is not None:
                # the dtype each tensor came in (a converted checkpoint's record), else --dtype but for the tensors
                # kept FP32 (written as the model holds them)
                target = out_dtypes.get(name) if isinstance(out_dtypes, dict) else (
                    None if kept_fp32(name) else out_dtypes)
                writer.add(name, tensor.to(DTYPES[target]) if target else tensor)
        return writer.close() if writer is not None else []
    finally:
        ps.destroy_model_parallel()


def hf_extras_source(ckpt: Path) -> Path | None:
    """Where a Megatron checkpoint's config.json / tokenizer files are: its own `hf/` (a converted checkpoint), else,
    for a trainer checkpoint RUN/checkpoints/iter_N, the HF directory the run started from (RUN/recipe.yaml's
    `trainer.init_from`, or that checkpoint's own `hf/` when it is a converted one)."""
    if (ckpt / HF_EXTRAS_DIR).is_dir():
        return ckpt / HF_EXTRAS_DIR
    if ckpt.parent.name != "checkpoints":
        return None
    run = load_run_recipe(ckpt.parent.parent, RECIPE_FILE, missing_ok=True)
    if run is not None and run.trainer.init_from:
        source = Path(run.trainer.init_from)
        return source / HF_EXTRAS_DIR if (source / HF_EXTRAS_DIR).is_dir() else source
    return None


def megatron_to_hf(ckpt: str | Path, out: str | Path, parallelism: ParallelismConfig, *, dtype: str | None = None,
                   shard_bytes: int = 2 << 30, timeout_s: float = CONVERT_TIMEOUT_S) -> Path:
    """Convert a Megatron checkpoint (converted, or a trainer's `RUN/checkpoints/iter_N`) into an HF directory at
    `out`: safetensors files of at most `shard_bytes` + index + config.json + tokenizer files when known +
    `checksums.sha256`; the model is loaded at `parallelism` on its `min_world_size()` processes."""
    ckpt, out = Path(ckpt), Path(out)
    _refuse_existing(out)
    require_complete(ckpt)  # every file against its SHA-256, once, here
    model_cfg = checkpoint_model_config(ckpt)
    check_model_layout(model_cfg, parallelism)
    dtypes = megatron_dtypes(ckpt, model_cfg)
    # a checkpoint converted from HF gives each tensor back in its HF dtype (the values came from there: lossless)
    out_dtypes = dtype or read_rl_state(ckpt).get("hf_dtypes")
    tmp = out.parent / f".{out.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        per_rank = _run(_megatron_to_hf_worker, parallelism, model_cfg.model_dump_json(), str(ckpt),
                        parallelism.model_dump_json(), dtypes, out_dtypes, str(tmp), shard_bytes, timeout_s=timeout_s)
        extras = hf_extras_source(ckpt)
        carried = _carried_tensors(extras, model_cfg)
        writer = _ShardWriter(tmp, "carried", shard_bytes, len(carried))
        for name, tensor in carried.items():
            writer.add(name, tensor)
        _finish_hf_dir(tmp, [f for files in per_rank for f in files] + writer.close(), model_cfg, dtype or dtypes[0],
                       extras)
        fsync_tree(tmp)
        replace_durably(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _finish_hf_dir(tmp: Path, files: list[tuple[str, list[str], str]], model_cfg: ModelConfig, body_dtype: str,
                   extras: Path | None) -> None:
    """Name the stage files model-0000i-of-0000n, write the index, config.json, tokenizer files and checksums."""
    files = sorted(files)
    count = len(files)
    weight_map, checksums = {}, []
    for index, (name, tensor_names, sha) in enumerate(files, start=1):
        final = f"model-{index:05d}-of-{count:05d}.safetensors"
        replace_durably(tmp / name, tmp / final)
        weight_map.update(dict.fromkeys(tensor_names, final))
        checksums.append(f"{sha}  {final}")
    total = sum((tmp / f).stat().st_size for f in set(weight_map.values()))
    (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                              "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    copied = _copy_hf_extras(extras, tmp) if extras is not None else []
    if "config.json" in copied:  # the source's, plus the family's keys it lacks (DeepSeek-V3's topk_method and
        # scoring_func, which vLLM reads and transformers' save_pretrained drops)
        config = {**FAMILIES[model_cfg.arch].hf_fields(model_cfg), **json.loads((tmp / "config.json").read_text())}
    else:
        config = hf_config_dict(model_cfg)
    config["torch_dtype"] = body_dtype
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    ensure_generation_config(tmp, config)  # the source's when copied; every checkpoint carries its end tokens
    (tmp / CHECKSUMS_FILE).write_text("\n".join(checksums) + "\n")


def verify_hf_checksums(hf_dir: Path) -> list[str]:
    """Files of an HF output whose sha256 differs from its `checksums.sha256` (empty: all match)."""
    bad = []
    for line in (hf_dir / CHECKSUMS_FILE).read_text().splitlines():
        sha, name = line.split("  ", 1)
        if not (hf_dir / name).is_file() or sha256_file(hf_dir / name) != sha:
            bad.append(name)
    return bad


# -- shared ---------------------------------------------------------------------------------------------------------

def _refuse_existing(out: Path) -> None:
    if out.exists():
        raise UserError(f"--out {out}: already exists (conversion never overwrites; remove it or pick another path)")


def _run(fn, parallelism: ParallelismConfig, *args, timeout_s: float) -> list:
    """`fn` on the layout's spawned workers; a worker's failure becomes one UserError line."""
    try:
        return run_local_workers(fn, parallelism.min_world_size(), *args, backend="auto", timeout_s=timeout_s)
    except WorkerError as exc:
        last = [line for line in str(exc).splitlines() if line.strip()][-1]
        raise UserError(f"conversion failed: {last.strip()}") from None
