"""`scalerl eval`: downstream evaluations (AIME, local benchmarks) of any endpoint, and of a run's checkpoints as
they appear.

    scalerl eval aime --endpoint URL --model NAME --dataset aime24 --samples K --out DIR [--api-key-file PATH]
                      [--recipe R] [--tokenizer DIR] [--concurrency N] [--grader-timeout S] [--verifier V]
    scalerl eval watch RUN_DIR [--every N] [--dataset aime24 ...] [--samples K] [--once]
    scalerl eval report RUN_DIR [--dataset aime24 ...]

A dataset (`--dataset`) is a shipped benchmark (aime24, aime25), the name of a local benchmark of the recipe's
`eval.benchmarks` (`aime`: --recipe's; `watch`: the run's), or a JSONL file (`--verifier code` for a code benchmark;
evaluation/harness.py `load_benchmark`). `aime` prints the summary as one JSON object on its last line. The
endpoint's API key comes from `--api-key-file PATH` or $SCALERL_API_KEY (`--api-key KEY` works but warns: `ps` shows
a command line to every user); `watch` serves each checkpoint behind a key of its own, in its server's environment.
`watch` takes what its flags leave open from SCALERL_EVAL_EVERY, SCALERL_EVAL_DATASETS, SCALERL_EVAL_SAMPLES and
SCALERL_EVAL_ONCE, then from the run's recipe (its `eval:` section; evaluation/watch.py). `report` covers every
dataset evaluated unless `--dataset` names some.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from transformers import AutoTokenizer

from megatron_scalerl.commands.parsing import command_group
from megatron_scalerl.commands.serve import add_api_key_arguments, api_key_from
from megatron_scalerl.errors import UserError
from megatron_scalerl.evaluation.harness import EvalRequest, evaluate, load_benchmark
from megatron_scalerl.evaluation.report import write_report
from megatron_scalerl.evaluation.watch import watch, watch_settings
from megatron_scalerl.models.tokenizer import has_tokenizer
from megatron_scalerl.recipe import load_recipe, load_run_recipe
from megatron_scalerl.run.directory import RECIPE_FILE


def _add_sampling(parser: argparse.ArgumentParser, samples: int | None, default: str | None = None) -> None:
    parser.add_argument("--samples", type=int, default=samples,
                        help=f"completions per problem (K; default: {default or samples})")
    add_api_key_arguments(parser, "the endpoint's API key")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    parser.add_argument("--grader-timeout", type=float, default=10.0, help="seconds per answer before it counts "
                        "as wrong")
    parser.add_argument("--verifier", help="grade with this verifier instead of each dataset's own (math for "
                        "aime24, aime25 and a JSONL file; a local benchmark's `verifier`): math, code, or "
                        "package.module:function")


def register(parser: argparse.ArgumentParser) -> None:
    esub = command_group(parser, "WHAT")
    aime = esub.add_parser("aime", help="evaluate an OpenAI-compatible endpoint on AIME or a local benchmark")
    aime.add_argument("--endpoint", required=True, help="base URL, e.g. http://host:8000")
    aime.add_argument("--model", required=True, help="the served model's name")
    aime.add_argument("--dataset", default="aime24", help="aime24, aime25, a local benchmark of --recipe's "
                      "eval.benchmarks by name, or a JSONL file with problem/answer (or tests, --verifier code)")
    aime.add_argument("--out", type=Path, required=True, help="directory for problems.jsonl and summary.json")
    aime.add_argument("--recipe", default="scalerl", help="recipe (preset, YAML, or a run's recipe.yaml) whose "
                      "local benchmarks, sampling and length control to use")
    aime.add_argument("--tokenizer", type=Path, help="tokenizer directory for the chat template and the "
                      "interruption phrase (default: --model when it is a directory)")
    _add_sampling(aime, 16)
    aime.set_defaults(func=_aime)

    watch = esub.add_parser("watch", help="evaluate every N-th checkpoint of a run as it appears")
    watch.add_argument("run_dir", type=Path)
    watch.add_argument("--every", type=int, help="evaluate checkpoints whose step is a multiple of N (default: "
                       "$SCALERL_EVAL_EVERY, else the recipe's eval.interval_steps)")
    watch.add_argument("--dataset", dest="datasets", action="append", help="as for `aime`, local benchmarks from "
                       "the run's recipe; repeatable (default: $SCALERL_EVAL_DATASETS, else the recipe's "
                       "eval.benchmarks)")
    watch.add_argument("--once", action="store_true", help="one pass over the checkpoints present, then exit "
                       "(or SCALERL_EVAL_ONCE=1)")
    watch.add_argument("--poll", type=float, default=60.0, help="seconds between looks at checkpoints/")
    watch.add_argument("--keep-exports", action="store_true", help="keep each checkpoint's HF export")
    _add_sampling(watch, None, "$SCALERL_EVAL_SAMPLES, else the recipe's eval.samples_per_problem")
    watch.set_defaults(func=_watch)

    report = esub.add_parser("report", help="table and plot of a run's evaluations beside its validation curve")
    report.add_argument("run_dir", type=Path)
    report.add_argument("--dataset", dest="datasets", action="append", help="repeatable (default: every dataset "
                        "evaluated)")
    report.set_defaults(func=_report)


def _request(args: argparse.Namespace, **fields):
    return EvalRequest(api_key=api_key_from(args, os.environ),
                       concurrency=args.concurrency, grader_timeout_s=args.grader_timeout, **fields)


def _aime(args: argparse.Namespace) -> int:
    tokenizer_dir = args.tokenizer or (Path(args.model) if has_tokenizer(Path(args.model)) else None)
    if args.tokenizer is not None and not has_tokenizer(args.tokenizer):
        raise UserError(f"--tokenizer {args.tokenizer}: no tokenizer files there")
    recipe = load_recipe(args.recipe)
    benchmark = load_benchmark(args.dataset, recipe.eval.benchmarks, args.verifier)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir)) if tokenizer_dir else None
    summary = evaluate(_request(args, samples=args.samples, endpoint=args.endpoint, model=args.model, out=args.out),
                       benchmark, recipe, tokenizer)
    k = summary["samples_per_problem"]
    print(f"{benchmark.name}: mean@{k} {summary['mean_at_k']:.3f}, pass@{k} {summary['pass_at_k'][str(k)]:.3f}, "
          f"cons@{k} {summary['cons_at_k']:.3f}, tests passed {summary['tests_passed_mean']:.3f} over "
          f"{summary['problems']} problems; {args.out}")
    print(json.dumps(summary))
    return 0


def _watch(args: argparse.Namespace) -> int:
    recipe = load_run_recipe(args.run_dir, RECIPE_FILE)
    settings = watch_settings(recipe.eval, os.environ, every=args.every, datasets=args.datasets,
                              samples=args.samples, once=args.once)
    request = _request(args, samples=settings.samples, endpoint="", model="", out=args.run_dir)
    count = watch(args.run_dir, recipe, request, settings, verifier=args.verifier, poll_s=args.poll,
                  keep_exports=args.keep_exports)
    print(f"evaluated {count} checkpoint(s) of {args.run_dir}")
    return 0


def _report(args: argparse.Namespace) -> int:
    print(write_report(args.run_dir, args.datasets), end="")
    print(f"(also {args.run_dir / 'eval' / 'report.md'} and report.png)")
    return 0
