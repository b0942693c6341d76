"""`scalerl convert`: HF <-> Megatron checkpoints at any layout (the code is `models/convert.py`).

    scalerl convert hf-to-megatron --hf DIR --out DIR [--tp N --pp N --ep N --expert-tp N] [--dtype D] [--verify]
    scalerl convert megatron-to-hf --megatron DIR --out DIR [--tp N --pp N --ep N --expert-tp N] [--dtype D] [--verify]

The conversion runs on tp x pp x ep-sized worker groups (each process holds only its shard). `--verify` re-reads the
output's checksums and runs `scalerl verify logits` on the result (the Megatron checkpoint against the HF directory,
fp32). Prints one JSON object on its last line. Bad input: one line naming the file or tensor, exit 2, no output.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from megatron_scalerl.checkpoint.store import CheckpointStore
from megatron_scalerl.commands.parsing import command_group
from megatron_scalerl.commands.verify import add_layout_arguments, layout_from_arguments, logits_check
from megatron_scalerl.errors import UserError
from megatron_scalerl.models.convert import CONVERT_TIMEOUT_S, hf_to_megatron, megatron_to_hf, verify_hf_checksums


def register(parser: argparse.ArgumentParser) -> None:
    csub = command_group(parser, "DIRECTION")
    to_megatron = csub.add_parser("hf-to-megatron", help="HF safetensors -> Megatron distributed checkpoint")
    to_megatron.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + safetensors)")
    to_hf = csub.add_parser("megatron-to-hf", help="Megatron checkpoint (converted or RUN/checkpoints/iter_N) -> HF")
    to_hf.add_argument("--megatron", required=True, help="Megatron checkpoint directory")
    to_hf.add_argument("--shard-size", type=float, default=2048.0, help="largest safetensors file, MiB")
    for parser in (to_megatron, to_hf):
        parser.add_argument("--out", required=True, help="output directory (must not exist)")
        add_layout_arguments(parser, " of the conversion workers")
        parser.add_argument("--dtype", choices=["bfloat16", "float32", "float16"],
                            help="cast every tensor (default: keep each tensor's dtype, e.g. an FP32 LM head)")
        parser.add_argument("--verify", action="store_true", help="re-check checksums and logits against HF")
        parser.add_argument("--timeout", type=float, default=CONVERT_TIMEOUT_S, help="seconds before the workers are stopped")
    to_megatron.set_defaults(func=_hf_to_megatron)
    to_hf.set_defaults(func=_megatron_to_hf)


def _hf_to_megatron(args: argparse.Namespace) -> int:
    layout = layout_from_arguments(args)
    start = time.monotonic()
    out = hf_to_megatron(args.hf, args.out, layout, dtype=args.dtype, timeout_s=args.timeout)

    def verify() -> dict:
        return {"checksums_ok": not CheckpointStore.problems(out),
                "logits": logits_check(args.hf, str(out), layout, timeout_s=args.timeout, megatron_hashed=True)}

    return _finish(out, start, verify if args.verify else None)


def _megatron_to_hf(args: argparse.Namespace) -> int:
    if args.shard_size <= 0:
        raise UserError(f"--shard-size: must be > 0 MiB, got {args.shard_size}")
    layout = layout_from_arguments(args)
    start = time.monotonic()
    out = megatron_to_hf(args.megatron, args.out, layout, dtype=args.dtype,
                         shard_bytes=int(args.shard_size * 2**20), timeout_s=args.timeout)

    def verify() -> dict:  # (megatron_to_hf checked the source against its SHA-256 before converting)
        return {"checksums_ok": not verify_hf_checksums(Path(out)),
                "logits": logits_check(str(out), args.megatron, layout, timeout_s=args.timeout,
                                       megatron_hashed=True)}

    return _finish(out, start, verify if args.verify else None)


def _finish(out: Path, start: float, verify: Callable[[], dict] | None) -> int:
    """Print the report (conversion `seconds`; with `verify`, its results and `verify_seconds`); exit status."""
    report: dict = {"out": str(out), "seconds": round(time.monotonic() - start, 2)}
    if verify is not None:
        began = time.monotonic()
        report.update(verify())
        report["verify_seconds"] = round(time.monotonic() - began, 2)
    ok = report.get("checksums_ok", True) and report.get("logits", {}).get("ok", True)
    report["ok"] = ok
    print(json.dumps(report))
    if not ok:
        print("error: verification failed (see the JSON report)", file=sys.stderr)
    return 0 if ok else 1
