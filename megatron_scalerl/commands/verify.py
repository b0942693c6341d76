"""`scalerl verify logits`: do our Megatron model and Hugging Face transformers give the same logits?

    scalerl verify logits --hf DIR [--megatron CKPT] [--tp N --pp N --ep N --expert-tp N] [--seq-len N]

With `--hf` alone it builds our Megatron model from the HF weights through the mapping at the given layout (worker
processes on gloo are spawned here, one command for any layout), runs it and HF on the same random tokens, and
prints one JSON object on its last line (`max_abs_diff`, fp32 logits). Exit 0 when max_abs_diff <= --tolerance.
With `--megatron RUN/checkpoints/iter_NNNNNNN` our model's weights come from that trainer checkpoint instead (at any
layout: checkpoints reshard on load), e.g. after converting it to HF, or for the checkpoint a run started from.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from megatron_scalerl.checkpoint.sharded import require_model_config
from megatron_scalerl.checkpoint.store import require_complete
from megatron_scalerl.commands.parsing import command_group
from megatron_scalerl.errors import UserError
from megatron_scalerl.families import attention_chunk
from megatron_scalerl.models.arch import check_model_layout
from megatron_scalerl.models.hf_io import LazyHFState
from megatron_scalerl.platform.distributed import check_layout
from megatron_scalerl.recipe import read_hf_config
from megatron_scalerl.verify.parity import hf_reference, run_layouts, trainer_layout


def register(parser: argparse.ArgumentParser) -> None:
    vsub = command_group(parser, "WHAT")
    logits = vsub.add_parser("logits", help="compare Megatron and HF logits on the same tokens (fp32)")
    logits.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + safetensors)")
    logits.add_argument("--megatron", help="Megatron checkpoint to load instead of converting --hf")
    add_layout_arguments(logits)
    logits.add_argument("--seq-len", type=int, help="tokens per sequence (default: attention chunk + 16, or 64)")
    logits.add_argument("--batch", type=int, help="sequences (default: the data-parallel size, at least 2)")
    logits.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    logits.add_argument("--tolerance", type=float, default=1e-4, help="largest accepted |logit difference|")
    logits.add_argument("--timeout", type=float, default=1800.0, help="seconds before the workers are stopped")
    logits.set_defaults(func=_verify_logits)


def add_layout_arguments(parser: argparse.ArgumentParser, whose: str = "") -> None:
    """--tp / --pp / --ep / --expert-tp of the worker processes a command spawns (read with `layout_from_arguments`)."""
    parser.add_argument("--tp", type=int, default=1, help=f"tensor-parallel size{whose}")
    parser.add_argument("--pp", type=int, default=1, help=f"pipeline-parallel size{whose}")
    parser.add_argument("--ep", type=int, default=1, help=f"expert-parallel size{whose} (MoE)")
    parser.add_argument("--expert-tp", type=int, help="expert tensor-parallel size (default: --tp)")


def layout_from_arguments(args: argparse.Namespace):
    """The `parity.trainer_layout` of `add_layout_arguments`' options, each checked to be >= 1."""
    _positive(args, "tp", "pp", "ep", "expert_tp")

    return trainer_layout(tp=args.tp, pp=args.pp, ep=args.ep, expert_tp=args.expert_tp)


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')}: must be >= 1, got {value}")


def _verify_logits(args: argparse.Namespace) -> int:
    _positive(args, "seq_len", "batch")
    report = logits_check(args.hf, args.megatron, layout_from_arguments(args), seq_len=args.seq_len,
                          batch=args.batch, seed=args.seed, tolerance=args.tolerance, timeout_s=args.timeout)
    print(json.dumps(report))
    return 0 if report["ok"] else 1


def logits_check(hf_dir: str, megatron: str | None, layout, *, seq_len: int | None = None, batch: int | None = None,
                 seed: int = 0, tolerance: float = 1e-4, timeout_s: float = 1800.0,
                 megatron_hashed: bool = False) -> dict:
    """Our model at `layout` (weights from `hf_dir`, or from the Megatron checkpoint `megatron`) against HF
    transformers on `hf_dir`, fp32, on the same random tokens [batch, seq_len]: the report `scalerl verify logits`
    prints (`max_abs_diff`, losses, `ok` when max_abs_diff <= tolerance). `megatron_hashed`: the caller has just
    checked `megatron`'s files against their SHA-256 (only their sizes are checked again)."""


    _, model_cfg = read_hf_config(hf_dir)
    LazyHFState(Path(hf_dir))  # fail early, in this process, on missing weights
    if megatron:
        _check_checkpoint_matches(Path(megatron), model_cfg, hf_dir, checksums=not megatron_hashed)
    check_model_layout(model_cfg, layout)
    world_size = layout.min_world_size()
    dp = check_layout(world_size, tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.expert_tp_size)
    batch = batch or max(2, dp)
    if batch % dp:
        raise UserError(f"--batch: {batch} does not split over {dp} data-parallel ranks")
    chunk = attention_chunk(model_cfg)
    seq_len = seq_len or (chunk + 16 if chunk else 64)
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, model_cfg.vocab_size, (batch, seq_len), generator=generator)
    labels = torch.randint(0, model_cfg.vocab_size, (batch, seq_len), generator=generator)

    print(f"verify logits: {hf_dir} at {layout.label} on {world_size} process(es), batch {batch} x {seq_len} tokens",
          file=sys.stderr)
    reference = hf_reference(hf_dir, input_ids, labels, with_grad=False)
    (ours,) = run_layouts(model_cfg, hf_dir, [layout], input_ids, labels, with_grad=False,
                          world_size=world_size, timeout_s=timeout_s, megatron_ckpt=megatron)
    diff = (ours.logits - reference.logits).abs().max().item()
    return {
        "hf": str(hf_dir),
        "megatron": megatron,
        "layout": layout.label,
        "world_size": world_size,
        "batch": batch,
        "seq_len": seq_len,
        "max_abs_diff": diff,
        "max_abs_logit": reference.logits.abs().max().item(),
        "loss_hf": reference.loss,
        "loss_megatron": ours.loss,
        "tolerance": tolerance,
        "ok": diff <= tolerance,
    }


def _check_checkpoint_matches(path: Path, hf_model_cfg, hf_dir: str, *, checksums: bool) -> None:
    """A Megatron checkpoint of the same architecture as the HF directory, complete per its manifest."""

    require_complete(path, checksums=checksums, name=f"--megatron {path}")  # once, here, not on every worker
    require_model_config(path, hf_model_cfg, f"{hf_dir}/config.json")
