"""Shared pieces of the trainer tests: a tiny recipe at a layout and a deterministic TrainBatch for it."""

import torch

from megatron_scalerl.batches.train_batch import TrainBatch
from megatron_scalerl.recipe import load_recipe

BASE = ["trainer.warmup_steps=0", "trainer.lr=1e-3", "trainer.grad_clip=0", "logging.wandb_mode=disabled"]
# The recipe's own precision is `auto` (bf16 where it is native, else fp32) with an FP32 LM head. Tests that compare
# layouts to 1e-4 train in fp32 (bf16 rounds differently when TP/PP/DP change the order of the sums); tests of the
# bf16 body beside the FP32 head (the GPU recipe) ask for bf16 on any CPU.
FP32 = ("trainer.precision=fp32",)
BF16 = ("trainer.precision=bf16",)


def tiny_hf_checkpoint(directory, model="tiny_dense", seed=0, overrides=()):
    """An HF checkpoint of the tiny model (its model section changed by `overrides`, e.g. "model.hidden_size=96")
    with random weights: the same starting weights for every layout.

    The fp32 weights are bf16-representable, so a bf16 trainer starts from exactly these weights and its first
    checkpoint still matches the HF model's logits (`scalerl verify logits`)."""
    from safetensors.torch import load_file, save_file

    from megatron_scalerl.models.hf_io import save_random_hf_model

    path = save_random_hf_model(load_recipe("scalerl", list(overrides), model_preset=model).model, directory, seed=seed)
    for file in path.glob("*.safetensors"):
        save_file({k: v.bfloat16().float() for k, v in load_file(file).items()}, file, metadata={"format": "pt"})
    return str(path)


def tiny_recipe(model="tiny_dense", *, tp=1, pp=1, ep=1, dp=1, mbs=1, hf=None, extra=()):
    """The tiny model at a layout (world = tp * pp * dp processes), initialised from the HF checkpoint `hf`, in the
    recipe's own precision unless `extra` says otherwise (e.g. `FP32`)."""
    world = tp * pp * dp
    overrides = BASE + [f"parallelism.tp={tp}", f"parallelism.pp={pp}", f"parallelism.ep={ep}",
                        f"parallelism.micro_batch_size={mbs}", f"cluster.gpus_per_node={world}",
                        f"parallelism.sequence_parallel={'true' if tp > 1 and model == 'tiny_moe' else 'false'}",
                        "rollout.prompts_per_step=4", "rollout.generations_per_prompt=4",
                        *([f"trainer.init_from={hf}"] if hf else []), *extra]
    return load_recipe("scalerl", overrides, model_preset=model)


def rl_batch(seed=0, vocab=1024, groups=4, per_group=4, max_len=40) -> TrainBatch:
    """`groups` prompts x `per_group` samples of different lengths, rewards +-1, group-baseline advantages."""
    g = torch.Generator().manual_seed(seed)
    n = groups * per_group
    lengths = torch.randint(12, max_len, (n,), generator=g)
    prompt_lengths = torch.randint(3, 8, (n,), generator=g)
    rewards = torch.where(torch.rand(n, generator=g) < 0.5, 1.0, -1.0)
    rewards[::per_group] = 1.0  # every group has a correct and an incorrect answer
    rewards[1::per_group] = -1.0
    group_ids = torch.arange(groups).repeat_interleave(per_group)
    adv = rewards - rewards.view(groups, per_group).mean(1).repeat_interleave(per_group)
    adv = adv / adv.std()
    total = int(lengths.sum())
    positions = torch.cat([torch.arange(int(L)) for L in lengths])
    completion = positions >= torch.repeat_interleave(prompt_lengths, lengths)
    return TrainBatch(
        input_ids=torch.randint(0, vocab, (total,), generator=g),
        loss_mask=completion,
        gen_logprobs=torch.where(completion, -7.0 + 0.3 * torch.randn(total, generator=g), 0.0),
        weight_versions=torch.where(completion, 0, -1),
        lengths=lengths, prompt_lengths=prompt_lengths, advantages=adv.float(), rewards=rewards,
        group_ids=group_ids, truncated=torch.zeros(n, dtype=torch.bool),
    ).validate("rl_batch", vocab)


def run_scenarios(rank, scenarios):
    """`run_local_workers` entry running several scenarios in one spawned process, so a test module pays for one
    worker start-up (megatron import, process group) instead of one per test. `scenarios`: {name: (fn, *args)};
    returns {name: fn(rank, *args)}. Each scenario builds its own model (building re-initialises megatron's
    parallel state)."""
    return {name: fn(rank, *args) for name, (fn, *args) in scenarios.items()}
