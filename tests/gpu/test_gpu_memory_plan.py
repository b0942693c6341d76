"""The memory plan (`scalerl recipe show R --plan`, `models.memory_plan.trainer_plan` with Transformer Engine
kernels) against the measured peak of a trainer step on one GPU.

A Llama-3 of ~160M parameters (8 layers, hidden 1024, 32k vocabulary: big enough that weights, gradients, optimizer
state and activations each weigh hundreds of MiB to GiB, so fixed workspaces do not decide the figure) trains in
bf16 with the FP32 head on micro-batches of ROWS full-length sequences of SEQ tokens, with and without full
recomputation. After a warm-up step, `torch.cuda.max_memory_allocated` over one more step is the measured peak;
what stays allocated between the steps is the static part (weights, FP32 main gradients, distributed optimizer).

The plan's runtime reserve (CUDA context, NCCL buffers, allocator slack) is not allocator memory, so it is left out
of the comparison: the rest of the estimate must be within STATED_FACTOR of the peak (measured / estimated in
[1 / STATED_FACTOR**2, STATED_FACTOR]: the plan may err towards caution more than towards too little), the peak must
fit the whole estimate (reserve included: the plan's "fits" verdict is safe), and the static parts must be within
STATIC_BAND of what stays allocated between steps.
"""

from __future__ import annotations

import pytest

from tests.gpu.gpu_utils import WORKER_TIMEOUT_S, layer_backend

pytestmark = pytest.mark.gpu(gpus=1, te=True)

GIB = 2**30
ROWS, SEQ, PROMPT = 4, 2048, 64
SIZE = ("model.num_layers=8", "model.hidden_size=1024", "model.ffn_hidden_size=2816", "model.num_attention_heads=8",
        "model.num_query_groups=2", "model.head_dim=128", "model.vocab_size=32768",
        "model.max_position_embeddings=4096")
STATED_FACTOR = 1.25
STATIC_BAND = (0.95, 1.2)


def plan_recipe(recompute: str, size=SIZE, rows: int = ROWS, seq: int = SEQ):
    """The scalerl recipe of the sized-up tiny Llama-3, one micro-batch of `rows` sequences of `seq` tokens."""
    from tests.trainer_utils import tiny_recipe

    return tiny_recipe("tiny_dense", mbs=rows, extra=(*size, "cluster.trainer_nodes=1",
                                                      f"rollout.max_prompt_tokens={PROMPT}",
                                                      f"rollout.max_new_tokens={seq - PROMPT}",
                                                      f"parallelism.recompute={recompute}"))


def full_length_batch(rows: int, length: int, vocab: int):
    """One prompt's `rows` samples of `length` tokens each (PROMPT of them prompt), rewards +-1."""
    import torch

    from megatron_scalerl.batches.train_batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    total = rows * length
    completion = torch.arange(length).repeat(rows) >= PROMPT
    rewards = torch.tensor([1.0, -1.0]).repeat(rows)[:rows]
    advantages = (rewards - rewards.mean()) / rewards.std()
    return TrainBatch(
        input_ids=torch.randint(0, vocab, (total,), generator=g), loss_mask=completion,
        gen_logprobs=torch.where(completion, -7.0 + 0.3 * torch.randn(total, generator=g), 0.0),
        weight_versions=torch.where(completion, 0, -1), lengths=torch.full((rows,), length),
        prompt_lengths=torch.full((rows,), PROMPT), advantages=advantages.float(), rewards=rewards,
        group_ids=torch.zeros(rows, dtype=torch.int64), truncated=torch.zeros(rows, dtype=torch.bool),
    ).validate("full_length_batch", vocab)


def measure(rank: int, recipe, run_dir) -> dict:
    """`run_local_workers` entry: the trainer in `run_dir`, a warm-up step, then one measured step (bytes; None on a
    CPU)."""
    import time

    import torch

    from megatron_scalerl.trainer.trainer import Trainer

    cuda = torch.cuda.is_available()
    trainer = Trainer(run_dir, recipe)
    rollout = recipe.rollout
    # samples one token longer than a sequence: the model reads all but the last, so the micro-batch is exactly
    # micro_batch_size x (max_prompt_tokens + max_new_tokens), what the plan assumes
    batch = full_length_batch(recipe.parallelism.micro_batch_size,
                              rollout.max_prompt_tokens + rollout.max_new_tokens + 1, recipe.model.vocab_size)
    trainer.train_step(batch)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    between = torch.cuda.memory_allocated() if cuda else None
    start = time.perf_counter()
    metrics = trainer.train_step(batch)
    if cuda:
        torch.cuda.synchronize()
    return {"between_steps": between, "peak": torch.cuda.max_memory_allocated() if cuda else None,
            "peak_reserved": torch.cuda.max_memory_reserved() if cuda else None,
            "step_s": time.perf_counter() - start, "tokens": int(batch.lengths.sum()),
            "loss": metrics["train/loss"], "backend": layer_backend()}


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_plan_estimate_against_measured_peak(recompute, gpu_figures, tmp_path):
    from megatron_scalerl.models.memory_plan import trainer_plan
    from megatron_scalerl.platform import run_local_workers

    recipe = plan_recipe(recompute)
    plan = trainer_plan(recipe, kernels="transformer_engine")
    [measured] = run_local_workers(measure, 1, recipe, tmp_path, backend="auto", timeout_s=WORKER_TIMEOUT_S)
    reserve = plan.parts["runtime reserve"]
    estimate = plan.total_gib * GIB - reserve
    static = sum(plan.parts[k] for k in ("weights", "gradients (fp32)", "optimizer (distributed)"))
    ratio = measured["peak"] / estimate
    static_ratio = measured["between_steps"] / static
    gpu_figures.update({
        "estimated GiB": estimate / GIB, "measured peak GiB": measured["peak"] / GIB, "measured/estimated": ratio,
        "static est GiB": static / GIB, "between steps GiB": measured["between_steps"] / GIB,
        "reserved peak GiB": measured["peak_reserved"] / GIB, "plan total GiB (with reserve)": plan.total_gib,
        "tokens/s": measured["tokens"] / measured["step_s"],
        "layers": measured["backend"]["linear_qkv"].rsplit(".", 1)[-1],
    })
    assert measured["backend"]["transformer_engine"], measured["backend"]
    parts = {k: round(v / GIB, 3) for k, v in plan.parts.items()}
    assert 1 / STATED_FACTOR**2 <= ratio <= STATED_FACTOR, f"measured/estimated {ratio:.3f}; plan (GiB): {parts}"
    assert measured["peak"] <= plan.total_gib * GIB, f"the peak exceeds the whole plan; plan (GiB): {parts}"
    assert STATIC_BAND[0] <= static_ratio <= STATIC_BAND[1], \
        f"allocated between steps / static parts {static_ratio:.3f}; plan (GiB): {parts}"
