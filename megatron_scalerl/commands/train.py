"""`scalerl train`: a whole run on one machine (`launch/local.py` runs it).

    scalerl train --recipe scalerl --model tiny_moe --tokenizer DIR [--run-dir runs/NAME] [--set k=v ...]
    scalerl train --run-dir runs/NAME --resume
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_scalerl.errors import UserError
from megatron_scalerl.launch.local import run_local, start_run
from megatron_scalerl.launch.roles import tokenizer_source
from megatron_scalerl.recipe import load_recipe, load_run_recipe
from megatron_scalerl.run.directory import RECIPE_FILE


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", help="preset name or recipe YAML (not with --resume: the run's own is used)")
    parser.add_argument("--model", dest="model_preset", help="model preset, or hf:DIR")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--run-dir", type=Path, help="run directory (default: runs/<recipe name>)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer directory (default: trainer.init_from's)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --run-dir")
    parser.set_defaults(func=_train)


def _train(args: argparse.Namespace) -> int:
    if args.resume:
        if args.run_dir is None:
            raise UserError(f"--resume needs --run-dir of an existing run (with its {RECIPE_FILE})")
        if args.recipe or args.model_preset or args.overrides:
            raise UserError("--resume continues the run's own recipe.yaml: drop --recipe, --model and --set")
        return run_local(args.run_dir, load_run_recipe(args.run_dir, RECIPE_FILE), resume=True)
    if not args.recipe:
        raise UserError("give --recipe (a preset name or YAML file), or --resume with --run-dir")
    recipe = load_recipe(args.recipe, args.overrides, args.model_preset)
    return start_run(args.run_dir or Path("runs") / recipe.name, recipe, tokenizer_source(recipe, args.tokenizer))
