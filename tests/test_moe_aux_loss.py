"""`model.moe_aux_loss_coeff`: off by default (no load-balancing term reaches the router), and when set, megatron-core's
aux-loss balancing pushes the router: on a tiny Qwen3-MoE whose main loss is zero, the router weights get a gradient
only with the coefficient set, and it grows with the coefficient (the aux loss is linear in it)."""

from __future__ import annotations

import pytest
import torch

from megatron_scalerl.platform import run_local_workers
from megatron_scalerl.recipe import ModelConfig, ParallelismConfig, load_recipe

pytestmark = pytest.mark.multiprocess


def _router_grad_norms(rank: int, model_cfg_json: str, coefficients: list[float]) -> list[float]:
    from megatron.core import parallel_state

    from megatron_scalerl.models import build_model
    from megatron_scalerl.platform import initialize_model_parallel

    base = ModelConfig.model_validate_json(model_cfg_json)
    initialize_model_parallel(seed=5)
    ids = torch.randint(0, base.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand(2, 16)
    norms = []
    try:
        for coefficient in coefficients:
            torch.manual_seed(1)
            model = build_model(base.model_copy(update={"moe_aux_loss_coeff": coefficient}), ParallelismConfig(),
                                fp32_lm_head=True)
            (model(ids, positions, None) * 0).sum().backward()  # the main loss contributes nothing
            grads = [p.grad for name, p in model.named_parameters() if name.endswith("router.weight")]
            norms.append(sum(0.0 if g is None else g.norm().item() ** 2 for g in grads) ** 0.5)
    finally:
        parallel_state.destroy_model_parallel()
    return norms


def test_aux_loss_is_off_by_default_and_moves_the_router_when_set():
    model_cfg = load_recipe("scalerl", model_preset="tiny_qwen3_moe").model
    assert model_cfg.moe_aux_loss_coeff == 0.0
    (off, small, large), = run_local_workers(_router_grad_norms, 1, model_cfg.model_dump_json(), [0.0, 0.01, 0.02],
                                             timeout_s=300)
    assert off == 0.0
    assert small > 0 and large == pytest.approx(2 * small, rel=1e-4)
