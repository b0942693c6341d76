"""A few bf16 trainer steps on one GPU (TP1, NCCL, the recipe's own precision: bf16 with an FP32 head), a checkpoint,
and an exact resume; dense Llama-3 and Llama-4 MoE.

The CPU resume tests' scenarios (tests/test_trainer_resume.py: `_train_and_save`, `_resume`) in one spawned GPU
worker: train 4 steps checkpointing after 0, 1 and 2, then resume from step 2 in a fresh trainer; the resumed run
must load exactly the saved weights and give the uninterrupted run's losses: bit for bit when every kernel was
deterministic (`torch.use_deterministic_algorithms` on, `gpu_utils.DETERMINISTIC_ENV`: Transformer Engine's and
cuBLAS's settings), else within `RESUME_TOLERANCE` of them, a tolerance set by the uninterrupted run's own repeat
(the control) and naming the ops that had no deterministic kernel (megatron's MoE unpermute scatter-adds).

Also: a freshly built optimizer has taken no Adam step (`platform.megatron_optimizer.materialise_optimizer_state`
runs one at learning rate 0 to create the state, then resets the step count; with Transformer Engine, megatron-core
uses TE's FusedAdam, which counts steps in its parameter groups, not per parameter).
"""

from __future__ import annotations

import math

import pytest

from tests.gpu.gpu_utils import (
    DETERMINISTIC_ENV,
    WORKER_TIMEOUT_S,
    deterministic_on_cpu,
    environment,
    layer_backend,
)

pytestmark = pytest.mark.gpu(gpus=1)

MODELS = {"dense": "tiny_dense", "moe": "tiny_moe"}
# Where some kernel is not deterministic: the resumed losses within 4x the control's own spread (the uninterrupted
# run against its repeat), and never tighter than 1e-3 of the loss's size.
RESUME_TOLERANCE = {"control_factor": 4.0, "relative_floor": 1e-3}


def fresh_optimizer(rank: int, hf: str) -> dict:
    """The step counts of a newly built trainer's optimizer: per parameter (torch's Adam) and per parameter group
    (TE's / Apex's FusedAdam)."""
    from megatron_scalerl.platform.megatron_optimizer import optimizer_parts
    from megatron_scalerl.trainer.setup import build_model_and_optimizer
    from tests.trainer_utils import tiny_recipe

    _, optimizer = build_model_and_optimizer(tiny_recipe(hf=hf))
    classes, steps = set(), set()
    for part in optimizer_parts(optimizer):
        inner = part.optimizer
        classes.add(f"{type(inner).__module__}.{type(inner).__qualname__}")
        steps |= {("group", float(group["step"])) for group in inner.param_groups if "step" in group}
        steps |= {("parameter", float(state["step"])) for state in inner.state.values() if "step" in state}
    return {"optimizers": sorted(classes), "steps": sorted(steps), "backend": layer_backend()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from megatron_scalerl.platform import run_local_workers
    from tests.test_trainer_resume import _resume, _train_and_save
    from tests.trainer_utils import run_scenarios, tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("gpu_trainer")
    hf = {name: tiny_hf_checkpoint(root / f"hf_{name}", model=model) for name, model in MODELS.items()}
    scenarios = {}
    for name, model in MODELS.items():
        layout = {} if model == "tiny_dense" else {"model": model}
        scenarios[f"{name}/run"] = (deterministic_on_cpu, _train_and_save, root / name, hf[name], layout)
        scenarios[f"{name}/rerun"] = (deterministic_on_cpu, _train_and_save, root / f"{name}_rerun", hf[name], layout)
        scenarios[f"{name}/resumed"] = (deterministic_on_cpu, _resume, root / name, hf[name], layout)
    scenarios["fresh_optimizer"] = (fresh_optimizer, hf["dense"])
    with environment(DETERMINISTIC_ENV):
        [results] = run_local_workers(run_scenarios, 1, scenarios, backend="auto", timeout_s=WORKER_TIMEOUT_S)
    return results


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", list(MODELS))
def test_bf16_steps_checkpoint_and_exact_resume(runs, name, gpu_figures):
    run, rerun, resumed = runs[f"{name}/run"], runs[f"{name}/rerun"], runs[f"{name}/resumed"]
    weights_equal = set(resumed["weights"]) == set(run["weights"]) and all(
        t.dtype == resumed["weights"][n].dtype and bool((t == resumed["weights"][n]).all())
        for n, t in run["weights"].items())
    nondeterministic = sorted(set(run["nondeterministic"]) | set(resumed["nondeterministic"]))
    resumed_diff, control_diff = _max_diff(resumed["losses"], run["losses"][2:]), _max_diff(rerun["losses"], run["losses"])
    tolerance = max(RESUME_TOLERANCE["control_factor"] * control_diff,
                    RESUME_TOLERANCE["relative_floor"] * max(abs(loss) for loss in run["losses"]))
    gpu_figures.update({
        "losses": run["losses"], "resumed from": resumed["iteration"], "max|dloss| resumed": resumed_diff,
        "max|dloss| rerun": control_diff, "weights equal after load": weights_equal, "precision": run["precision"],
        "deterministic": not nondeterministic, "nondeterministic ops": nondeterministic,
    })
    assert run["precision"] == "bf16"
    assert all(math.isfinite(loss) for loss in run["losses"]), run["losses"]
    assert (resumed["iteration"], resumed["hours"], resumed["version"]) == (2, run["hours"], 4)
    assert weights_equal, "the resumed trainer did not load exactly the weights saved at step 2"
    if not nondeterministic:
        control = ("" if rerun["losses"] == run["losses"] else
                   f" (and the deterministic GPU run is not reproducible by itself: a rerun gave {rerun['losses']})")
        assert resumed["losses"] == run["losses"][2:], \
            f"resumed losses {resumed['losses']} != uninterrupted {run['losses'][2:]}{control}"
    else:
        assert resumed_diff <= tolerance, (
            f"resumed losses {resumed['losses']} differ from the uninterrupted {run['losses'][2:]} by {resumed_diff:.3g}, "
            f"past {tolerance:.3g} (4x the rerun's {control_diff:.3g}); kernels without a deterministic "
            f"implementation: {nondeterministic}")


def test_fresh_optimizer_has_taken_no_step(runs, gpu_figures):
    fresh = runs["fresh_optimizer"]
    gpu_figures.update({"optimizer": ", ".join(c.rsplit(".", 1)[-1] for c in fresh["optimizers"]),
                        "step counts": [f"{kind} {value:g}" for kind, value in fresh["steps"]],
                        "layers": fresh["backend"]["linear_qkv"].rsplit(".", 1)[-1]})
    assert fresh["steps"], "the optimizer has no step count at all: its state was not created at build time"
    assert all(value == 0 for _, value in fresh["steps"]), (
        f"a fresh {fresh['optimizers']} already counts steps {fresh['steps']}: its first real update would use "
        "the bias correction of a later step (materialise_optimizer_state resets per-parameter steps only)")
