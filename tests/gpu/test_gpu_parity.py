"""HF parity on GPUs: tiny Llama-3, Llama-4 and DeepSeek-V3 (with and without q LoRA: tests/test_deepseek_v3_parity.py's)
checkpoints at TP2 and EP2 (and TP2 x EP2), NCCL, Transformer Engine (its MLA layers for DeepSeek-V3).

The CPU parity tests' models, tokens and oracle (tests/test_models_parity.py, `verify.parity`) on one process per
GPU: every layout runs twice, in fp32 through `verify.parity.run_layout` (what `scalerl verify logits`
runs) and in bf16 (the trainer's precision: the same path with the recipe's precision switched), each with the
trainer's DDP and distributed optimizer for the gradient norm; each layout also exports its shards back to HF names
and must return the checkpoint's tensors bit for bit. The oracle is transformers in fp32 on the CPU.

Tolerances. Transformer Engine runs fp32 GEMMs in TF32 (its cuBLASLt default) and bf16 rounds at every layer, so
the CPU tests' 1e-4 does not apply: each precision's tolerance is a floor or CALIBRATION x the deviation of
transformers' own model at that precision on this GPU (TF32 matmuls, bf16 weights and activations) from its fp32
CPU result, whichever is larger. A wrong layer, mask or mapping moves the logits by far more (the CPU tests show
each Llama-4 feature alone moves them by > 1e-2; a wrong shard by O(1)).
"""

from __future__ import annotations

import contextlib

import pytest

from tests.gpu.gpu_utils import WORKER_TIMEOUT_S, layer_backend

pytestmark = pytest.mark.gpu(gpus=2, te=True)

CALIBRATION = 4.0
FLOORS = {  # precision: (max |logit diff|, loss relative, grad norm relative)
    "fp32": (2e-4, 1e-5, 1e-4),
    "bf16": (5e-2, 1e-2, 5e-2),
}
LAYOUTS = {"tp2": dict(tp=2), "ep2": dict(ep=2), "tp2xep2-etp1": dict(tp=2, ep=2, expert_tp=1),
           "tp2xep2": dict(tp=2, ep=2)}
TWO_GPUS = {"llama3": ["tp2"], "llama3_vocab263": ["tp2"], "llama4": ["tp2", "ep2", "tp2xep2-etp1"],
            "deepseek_v3": ["tp2", "ep2"], "deepseek_moonlight": ["tp2"]}  # Transformer Engine's MLA layers
FOUR_GPUS = {"llama4": ["tp2xep2"]}  # expert TP2 x EP2: 4 ranks
CASES = [pytest.param(arch, name, 2, id=f"{arch}-{name}") for arch, names in TWO_GPUS.items() for name in names] + [
    pytest.param(arch, name, 4, id=f"{arch}-{name}", marks=pytest.mark.gpu(gpus=4, te=True))
    for arch, names in FOUR_GPUS.items() for name in names]


@contextlib.contextmanager
def precision(name: str):
    """`verify.parity.run_layout` builds its recipe with `verify_recipe` (fp32); inside this, in `name` instead."""
    from megatron_scalerl.verify import parity

    original = parity.verify_recipe

    def verify_recipe(model_cfg, parallelism, hf_dir):  # noqa: ANN001, ANN202
        recipe = original(model_cfg, parallelism, hf_dir)
        return recipe.model_copy(update={"trainer": recipe.trainer.model_copy(update={"precision": name})})

    parity.verify_recipe = verify_recipe
    try:
        yield
    finally:
        parity.verify_recipe = original


def hf_at_precision(hf_dir: str, input_ids, labels) -> dict:
    """transformers' own model on this worker's device, as the calibration of each precision: "tf32" (fp32 weights,
    TF32 matmuls on CUDA) and "bf16" (bf16 weights); logits, mean cross-entropy and gradient norm like
    `verify.parity.hf_reference`."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from megatron_scalerl.platform.distributed import current_device
    from megatron_scalerl.verify.parity import LayoutResult

    device = current_device()
    out = {}
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    for name, dtype in (("tf32", torch.float32), ("bf16", torch.bfloat16)):
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = name == "tf32"
        try:
            model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device).train()
            logits = model(input_ids.to(device)).logits.float()
            loss = F.cross_entropy(logits.flatten(0, 1), labels.to(device).flatten())
            loss.backward()
            grad_norm = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None]).norm()
            out[name] = LayoutResult(f"hf-{name}", logits.detach().cpu(), loss.item(), grad_norm.item())
            del model
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
    return out


def parity_worker(rank: int, jobs: list) -> dict:
    """`run_local_workers` entry. jobs: [(arch, HF dir, layouts, input ids, labels)]; per job and layout the fp32
    result with its export check (as tests/test_models_parity.py's `_layouts_worker`), the bf16 result, and (rank
    0) the calibration."""
    from megatron_scalerl.verify.parity import run_layout
    from tests.test_models_parity import _export_check, _model_cfg

    out = {"backend": layer_backend(), "jobs": []}
    for arch, hf_dir, layouts, input_ids, labels in jobs:
        model_cfg = _model_cfg(arch)
        fp32 = [(run_layout(model_cfg, layout, hf_dir, input_ids, labels, with_grad=True),
                 _export_check(model_cfg, layout, hf_dir)) for layout in layouts]
        with precision("bf16"):
            bf16 = [run_layout(model_cfg, layout, hf_dir, input_ids, labels, with_grad=True) for layout in layouts]
        calibration = hf_at_precision(hf_dir, input_ids, labels) if rank == 0 else None
        out["jobs"].append({"fp32": fp32, "bf16": bf16, "hf": calibration})
    return out


def run_parity(checkpoints: dict[str, str], jobs: dict[str, list[str]], world_size: int) -> dict:
    """Every (arch, layout) of `jobs` on `world_size` GPUs (one spawned worker each, NCCL); {(arch, layout name):
    {"fp32": (result, differing exports, names, first-rank names), "bf16": result, "hf": calibration, "backend"}}."""
    from megatron_scalerl.platform import run_local_workers
    from megatron_scalerl.verify.parity import trainer_layout
    from tests.test_models_parity import _merge_ranks, _tokens

    payload = [(arch, checkpoints[arch], [trainer_layout(**LAYOUTS[name]) for name in names], *_tokens(arch))
               for arch, names in jobs.items()]
    per_rank = run_local_workers(parity_worker, world_size, payload, backend="auto", timeout_s=WORKER_TIMEOUT_S)
    results = {}
    for j, (arch, names) in enumerate(jobs.items()):
        merged = _merge_ranks([r["jobs"][j]["fp32"] for r in per_rank], len(names))
        for i, name in enumerate(names):
            [bf16] = [r["jobs"][j]["bf16"][i] for r in per_rank if r["jobs"][j]["bf16"][i] is not None]
            results[(arch, name)] = {"fp32": merged[i], "bf16": bf16, "hf": per_rank[0]["jobs"][j]["hf"],
                                     "backend": per_rank[0]["backend"]}
    return results


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """The CPU parity tests' checkpoints (random weights, std 0.1, seed 7)."""
    from megatron_scalerl.models.hf_io import save_random_hf_model
    from tests.test_models_parity import _model_cfg

    root = tmp_path_factory.mktemp("hf")
    archs = {*TWO_GPUS, *FOUR_GPUS}
    return {name: str(save_random_hf_model(_model_cfg(name), root / name, seed=7, std=0.1)) for name in archs}


@pytest.fixture(scope="module")
def references(checkpoints) -> dict:
    """transformers in fp32 on the CPU, per architecture (computed when first asked for)."""
    from megatron_scalerl.verify.parity import hf_reference
    from tests.test_models_parity import _tokens

    cache: dict = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = hf_reference(checkpoints[arch], *_tokens(arch), with_grad=True)
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def two_gpus(checkpoints):
    return run_parity(checkpoints, TWO_GPUS, 2)


@pytest.fixture(scope="module")
def four_gpus(checkpoints):
    return run_parity(checkpoints, FOUR_GPUS, 4)


def compare(result, reference, calibration, vocab: int, precision_name: str) -> dict:
    """Figures of `result` against the fp32 CPU oracle, with this precision's tolerances."""
    logit_floor, loss_floor, grad_floor = FLOORS[precision_name]
    hf = calibration["tf32" if precision_name == "fp32" else "bf16"]

    def logit_diff(r):
        return (r.logits[..., :vocab] - reference.logits).abs().max().item()

    def rel(a, b):
        return abs(a - b) / abs(b)

    return {
        "logit_diff": logit_diff(result), "logit_tol": max(logit_floor, CALIBRATION * logit_diff(hf)),
        "loss_rel": rel(result.loss, reference.loss),
        "loss_tol": max(loss_floor, CALIBRATION * rel(hf.loss, reference.loss)),
        "grad_rel": rel(result.grad_norm, reference.grad_norm),
        "grad_tol": max(grad_floor, CALIBRATION * rel(hf.grad_norm, reference.grad_norm)),
        "padding_neg_inf": bool(result.logits[..., vocab:].isneginf().all()),
    }


@pytest.mark.parametrize("arch, layout, world_size", CASES)
def test_layout_matches_hf_on_gpus(arch, layout, world_size, request, references, gpu_figures):
    from megatron_scalerl.models.mapping import hf_parameter_names
    from tests.test_models_parity import _model_cfg

    run = request.getfixturevalue("two_gpus" if world_size == 2 else "four_gpus")[(arch, layout)]
    model_cfg = _model_cfg(arch)
    reference = references(arch)
    (fp32, differing, names, first_names), bf16 = run["fp32"], run["bf16"]
    figures = {precision_name: compare(result, reference, run["hf"], model_cfg.vocab_size, precision_name)
               for precision_name, result in (("fp32", fp32), ("bf16", bf16))}
    gpu_figures.update({
        "max|dlogit| fp32": figures["fp32"]["logit_diff"], "tol fp32": figures["fp32"]["logit_tol"],
        "max|dlogit| bf16": figures["bf16"]["logit_diff"], "tol bf16": figures["bf16"]["logit_tol"],
        "loss rel bf16": figures["bf16"]["loss_rel"], "grad-norm rel bf16": figures["bf16"]["grad_rel"],
        "exports differing": len(differing), "layers": run["backend"]["linear_qkv"].rsplit(".", 1)[-1],
    })
    assert run["backend"]["transformer_engine"], f"the workers did not build Transformer Engine layers: {run['backend']}"
    for precision_name, f in figures.items():
        where = f"{arch} {layout} {precision_name}: {f}"
        assert f["padding_neg_inf"], where
        assert f["logit_diff"] <= f["logit_tol"], where
        assert f["loss_rel"] <= f["loss_tol"], where
        assert f["grad_rel"] <= f["grad_tol"], where
    assert not differing, f"exported back differently from the checkpoint: {sorted(differing)[:5]}"
    assert names == first_names == set(hf_parameter_names(model_cfg))
