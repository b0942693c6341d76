"""Build the model and optimizer of a trainer rank from a recipe: parallel groups, model chunks (DDP), optimizer.

Parallelism is applied here and only here: megatron-core's TP/PP/EP groups from `recipe.parallelism`, the model
shard for this rank's pipeline stage, bf16 via megatron's `Float16Module` when `trainer.precision` resolves to bf16
(`platform.precision`; the FP32 head keeps FP32 weights), megatron DDP with the distributed optimizer (AdamW with
the recipe's betas, eps, weight decay and grad clipping).
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_scalerl.checkpoint.sharded import load_model_weights, require_model_config
from megatron_scalerl.checkpoint.store import MANIFEST, require_complete
from megatron_scalerl.models import build_model, load_hf_state, read_hf_checkpoint
from megatron_scalerl.models.weights import EXPERT_BIAS, unwrap_model
from megatron_scalerl.platform import initialize_model_parallel
from megatron_scalerl.platform.megatron_optimizer import prepare_optimizer
from megatron_scalerl.platform.precision import trainer_dtype
from megatron_scalerl.recipe import Recipe, require_init_from_matches


def head_weight(chunk: torch.nn.Module) -> torch.Tensor:
    """This rank's LM-head weight [vocab / tp, hidden] (the embedding when embeddings are tied)."""
    gpt = unwrap_model(chunk)
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def emit_hidden_states(gpt: torch.nn.Module) -> None:
    """Training fuses the LM head into the chunked log-prob op (trainer/logprobs.py): the last stage's output layer
    returns its input, so GPTModel returns hidden states [b, s(/tp), h] instead of [b, s, vocab/tp] logits
    (`models.output_layer.OutputLayer.returns_hidden`). The head's parameters stay where they are (names, sharding,
    optimizer, checkpoints unchanged)."""
    if getattr(gpt, "output_layer", None) is not None:
        gpt.output_layer.returns_hidden = True


def expert_weights_apart(gpt: torch.nn.Module) -> None:
    """Mark every routed expert's weights as expert-parallel (megatron's `allreduce=False`) at any EP.

    megatron-core marks them only when EP > 1; then DDP reduces their gradients over the expert data-parallel group
    and the optimizer gives them an optimizer of their own, chained after the dense one. At EP 1 the expert
    data-parallel group is the data-parallel group, so marking them changes no gradient, but it gives the optimizer
    the same [dense, expert] structure at every EP: optimizer checkpoints then load at any EP (an EP1 checkpoint
    otherwise has one optimizer's state where EP2 expects two).
    """
    for module in gpt.modules():
        if getattr(module, "is_expert", False):
            for param in module.parameters(recurse=False):
                param.allreduce = False


def load_initial_weights(gpt: torch.nn.Module, recipe: Recipe) -> None:
    """Collective. The weights `trainer.init_from` names into `gpt` (this rank's shard): an HF checkpoint directory,
    or a Megatron checkpoint (from `scalerl convert hf-to-megatron`, or another run's `checkpoints/iter_N`), written
    at any layout; the checkpoint must be of the recipe's architecture."""
    source = Path(recipe.trainer.init_from)
    if (source / MANIFEST).is_file():
        require_complete(source, name=f"trainer.init_from {source}", collective=True)  # hashing split over ranks
        require_model_config(source, recipe.model, "the recipe (trainer.init_from)")
        load_model_weights(source, gpt)
    else:
        _, hf_state = read_hf_checkpoint(source)
        load_hf_state(gpt, hf_state, recipe.model)


def build_model_chunks(recipe: Recipe, *, hidden_states_out: bool = True) -> list:
    """This rank's model (initialised from `trainer.init_from` when set: `load_initial_weights`; an HF checkpoint of
    another model than `recipe.model` is refused first, `recipe.require_init_from_matches`), ready for training.

    The last stage returns hidden states for the fused log-prob op (`emit_hidden_states`); `hidden_states_out=False`
    keeps megatron's logits [b, s, padded vocab / tp] instead (what `scalerl verify` compares with HF)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    require_init_from_matches(recipe)  # an HF init_from of another model: refused before any weight is built
    dtype = trainer_dtype(recipe)
    gpt = build_model(recipe.model, recipe.parallelism, fp32_lm_head=recipe.trainer.fp32_lm_head,
                      params_dtype=dtype, pre_process=ps.is_pipeline_first_stage(),
                      post_process=ps.is_pipeline_last_stage())
    if recipe.trainer.init_from:
        load_initial_weights(gpt, recipe)
    if hidden_states_out:
        emit_hidden_states(gpt)
    expert_weights_apart(gpt)
    config = gpt.config
    config.variable_seq_lengths = True  # micro-batches are padded to their own longest row
    config.finalize_model_grads_func = finalize_model_grads
    model = _float16_module(config, gpt) if dtype != torch.float32 else gpt
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=True)
    return [DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)]


def _float16_module(config, gpt: torch.nn.Module) -> torch.nn.Module:  # noqa: ANN001
    """megatron's `Float16Module` around `gpt`, which casts every buffer to the body dtype too; the routers' expert
    bias (DeepSeek-V3's score-correction bias: a checkpoint tensor, FP32 in vLLM, never trained) is put back in FP32
    bit for bit (megatron would only cast the rounded value back)."""
    from megatron.core.transformer.module import Float16Module

    kept = {name: tensor.detach().clone() for name, tensor in gpt.named_buffers() if name.endswith(EXPERT_BIAS)}
    wrapped = Float16Module(config, gpt)
    buffers = dict(gpt.named_buffers())
    for name, value in kept.items():
        buffers[name].data = value
    return wrapped


def optimizer_config(recipe: Recipe):
    """Megatron's OptimizerConfig for the recipe: distributed AdamW (betas, eps, weight decay, grad clipping)."""
    from megatron.core.optimizer import OptimizerConfig

    t, dtype = recipe.trainer, trainer_dtype(recipe)
    return OptimizerConfig(optimizer="adam", lr=t.lr, min_lr=t.lr, weight_decay=t.weight_decay,
                           adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps,
                           clip_grad=t.grad_clip, bf16=dtype == torch.bfloat16, params_dtype=dtype,
                           use_distributed_optimizer=True)


def build_optimizer(recipe: Recipe, model_chunks: list):
    """Collective. Megatron's distributed optimizer for `model_chunks`, with the fixes of `platform.megatron_optimizer`
    applied (correct state lookup with an FP32 head among bf16 weights; Adam state present before any step)."""
    from megatron.core.optimizer import get_megatron_optimizer

    optimizer = get_megatron_optimizer(optimizer_config(recipe), model_chunks)
    prepare_optimizer(model_chunks, optimizer)
    return optimizer


def build_model_and_optimizer(recipe: Recipe) -> tuple[list, object]:
    """Collective (after `platform.init_distributed`): megatron's parallel groups for `recipe.parallelism`, then
    this rank's model chunks (`build_model_chunks`: one per rank, DDP-wrapped) and their distributed optimizer
    (`build_optimizer`: possibly chained, dense and expert)."""
    p = recipe.parallelism
    initialize_model_parallel(p.tp, p.pp, p.ep, p.expert_tp, seed=recipe.trainer.seed,
                              timeout_s=recipe.cluster.collective_timeout_s)
    model = build_model_chunks(recipe)
    return model, build_optimizer(recipe, model)
