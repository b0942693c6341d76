"""`scalerl convert`: HF <-> Megatron checkpoints at any layout (the code is `models/convert.py`).

    scalerl convert hf-to-megatron --hf DIR --out DIR [--tp N --pp N --ep N] [--dtype D] [--verify]
    scalerl convert megatron-to-hf --megatron DIR --out DIR [--tp N --pp N --ep N] [--dtype D] [--verify]

The conversion runs on tp x pp x ep-sized worker groups (each process holds only its shard). `--verify` re-reads the
output's checksums and runs `scalerl verify logits` on the result (the Megatron checkpoint against the HF directory,
fp32). Prints one JSON object on its last line. Bad input: one line naming the file or tensor, exit 2, no output.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from megatron_scalerl.errors import UserError


def register(sub: argparse._SubParsersAction) -> None:
    convert = sub.add_parser("convert", help="convert checkpoints between HF and Megatron layouts")
    csub = convert.add_subparsers(dest="convert_command", metavar="DIRECTION", parser_class=type(convert))
    csub.required = True
    to_megatron = csub.add_parser("hf-to-megatron", help="HF safetensors -> Megatron distributed checkpoint")
    to_megatron.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + safetensors)")
    to_hf = csub.add_parser("megatron-to-hf", help="Megatron checkpoint (converted or RUN/checkpoints/iter_N) -> HF")
    to_hf.add_argument("--megatron", required=True, help="Megatron checkpoint directory")
    to_hf.add_argument("--shard-size", type=float, default=2048.0, help="largest safetensors file, MiB")
    for parser in (to_megatron, to_hf):
        parser.add_argument("--out", required=True, help="output directory (must not exist)")
        parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the conversion workers")
        parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the conversion workers")
        parser.add_argument("--ep", type=int, default=1, help="expert-parallel size of the conversion workers (MoE)")
        parser.add_argument("--dtype", choices=["bfloat16", "float32", "float16"],
                            help="cast every tensor (default: keep each tensor's dtype, e.g. an FP32 LM head)")
        parser.add_argument("--verify", action="store_true", help="re-check checksums and logits against HF")
        parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before the workers are stopped")
    to_megatron.set_defaults(func=_hf_to_megatron)
    to_hf.set_defaults(func=_megatron_to_hf)


def _layout(args: argparse.Namespace):
    from megatron_scalerl.recipe import ParallelismConfig

    for name in ("tp", "pp", "ep"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name}: must be >= 1, got {getattr(args, name)}")
    return ParallelismConfig(tp=args.tp, pp=args.pp, ep=args.ep, sequence_parallel=args.tp > 1)


def _hf_to_megatron(args: argparse.Namespace) -> int:
    from megatron_scalerl.checkpoint.store import CheckpointStore
    from megatron_scalerl.models.convert import hf_to_megatron

    start = time.monotonic()
    out = hf_to_megatron(args.hf, args.out, _layout(args), dtype=args.dtype, timeout_s=args.timeout)
    report = {"out": str(out), "seconds": round(time.monotonic() - start, 2)}
    if args.verify:
        problems = CheckpointStore.problems(out)
        report["checksums_ok"] = not problems
        report["logits"] = _logits(args.hf, str(out), args)
    return _finish(report)


def _megatron_to_hf(args: argparse.Namespace) -> int:
    from megatron_scalerl.models.convert import megatron_to_hf, verify_hf_checksums

    if args.shard_size <= 0:
        raise UserError(f"--shard-size: must be > 0 MiB, got {args.shard_size}")
    start = time.monotonic()
    out = megatron_to_hf(args.megatron, args.out, _layout(args), dtype=args.dtype,
                         shard_bytes=int(args.shard_size * 2**20), timeout_s=args.timeout)
    report = {"out": str(out), "seconds": round(time.monotonic() - start, 2)}
    if args.verify:
        report["checksums_ok"] = not verify_hf_checksums(Path(out))
        report["logits"] = _logits(str(out), args.megatron, args)
    return _finish(report)


def _logits(hf_dir: str, megatron: str, args: argparse.Namespace) -> dict:
    """`scalerl verify logits --hf hf_dir --megatron megatron` at the conversion's layout."""
    from megatron_scalerl.verify.cli import logits_check
    from megatron_scalerl.verify.parity import trainer_layout

    return logits_check(hf_dir, megatron, trainer_layout(tp=args.tp, pp=args.pp, ep=args.ep),
                        timeout_s=args.timeout)


def _finish(report: dict) -> int:
    ok = report.get("checksums_ok", True) and report.get("logits", {}).get("ok", True)
    report["ok"] = ok
    print(json.dumps(report))
    if not ok:
        print("error: verification failed (see the JSON report)", file=sys.stderr)
    return 0 if ok else 1
