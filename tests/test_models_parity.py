"""HF parity of our Megatron models (dense Llama-3, Llama-4 MoE, dense Qwen3, Qwen3-MoE) at TP1, TP2, PP2, EP2,
TP2xEP2 and TP2xEP2xETP1.

Oracle: transformers' LlamaForCausalLM / Llama4ForCausalLM / Qwen3ForCausalLM / Qwen3MoeForCausalLM with random
weights, fp32: logits (max abs diff <= 1e-4), mean cross-entropy and the gradient norm of that loss. Llama-4 runs on
sequences longer than its attention chunk, with temperature tuning active, a NoPE layer and both dense and MoE
layers; each of those features is shown to matter (switching it off in HF moves the logits far more than our
difference). Qwen3 (tied embeddings) and Qwen3-MoE (8 experts, top-2; renormalised over the chosen two on a model
with dense and routed layers, not renormalised on one routed on every layer) show the same of their q/k RMSNorms
and of norm_topk_prob.
Every layout also exports its shards back to HF names (export_hf_state) and must return the original tensors.
A 263-token vocabulary (models padded to 384 rows) matches HF at TP1 and TP2 too, dense and MoE: the padding
columns' logits are -inf and export gives back exactly the HF tensors, with 263 rows.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_scalerl.models.hf_io import save_random_hf_model
from megatron_scalerl.models.mapping import hf_parameter_names
from megatron_scalerl.platform import run_local_workers
from megatron_scalerl.recipe import ModelConfig, ParallelismConfig, load_recipe
from megatron_scalerl.verify.parity import LayoutResult, hf_reference, run_layout, trainer_layout

pytestmark = pytest.mark.multiprocess

TOLERANCE = 1e-4
SEQ_LEN = 80  # > 2 chunks of 32 tokens
BATCH = 4  # splits over up to 4 data-parallel ranks


ODD_VOCAB = 263  # neither a multiple of 2 nor of 128: the models pad it to padded_vocab_size(263, tp) = 384 rows
ODD_VOCAB_MODELS = ("llama3_vocab263", "llama4_vocab263")
QWEN3_MOE_MODELS = ("qwen3_moe", "qwen3_moe_nonorm")
MODELS = ("llama3", "llama3_tied", "llama4", *ODD_VOCAB_MODELS, "qwen3", *QWEN3_MOE_MODELS)


def _qwen3_cfg(name: str) -> ModelConfig:
    """Qwen3 at test size, every one with the 263-token vocabulary: 4 query heads of 32 over a hidden size of 64 (the
    attention wider than the model, as in Qwen3-0.6B and Qwen3-30B-A3B), tied embeddings (dense, from the preset)."""
    moe = name.startswith("qwen3_moe")
    small = dict(num_layers=4, hidden_size=64, ffn_hidden_size=96, vocab_size=ODD_VOCAB)
    if name == "qwen3_moe":  # decoder_sparse_step 2: layers 1 and 3 routed, 0 and 2 dense; top-2 renormalised
        small.update(moe_ffn_hidden_size=48, moe_layer_interval=2, norm_topk_prob=True)
    if name == "qwen3_moe_nonorm":  # every layer routed; the top-2 of a softmax over all 8, not renormalised
        small.update(moe_ffn_hidden_size=48, moe_layer_interval=1, norm_topk_prob=False)
    base = load_recipe("scalerl", model_preset="tiny_qwen3_moe" if moe else "tiny_qwen3").model
    return ModelConfig.model_validate({**base.model_dump(), **small})


def _model_cfg(name: str) -> ModelConfig:
    if name.startswith("deepseek_"):  # tests/test_deepseek_v3_parity.py's models, by the GPU parity test's names
        from tests.test_deepseek_v3_parity import _model_cfg as deepseek_v3_cfg

        return deepseek_v3_cfg(name.removeprefix("deepseek_"))
    if name.startswith("qwen3"):
        return _qwen3_cfg(name)
    preset = "tiny_moe" if name.startswith("llama4") else "tiny_dense"
    small = dict(num_layers=4, hidden_size=64, ffn_hidden_size=96,
                 vocab_size=ODD_VOCAB if name.endswith("_vocab263") else 256)
    if name.startswith("llama4"):  # layers 1 and 3 MoE, layer 3 NoPE; temperature tuning from position 7 on
        small.update(moe_ffn_hidden_size=48, moe_layer_interval=2, floor_scale=8.0)
    if name == "llama3_tied":
        small.update(tie_word_embeddings=True)
    return load_recipe("scalerl", model_preset=preset).model.model_copy(update=small)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf")
    return {name: str(save_random_hf_model(_model_cfg(name), root / name, seed=7, std=0.1)) for name in MODELS}


def _tokens(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and labels [BATCH, SEQ_LEN] over the model's whole vocabulary."""
    generator = torch.Generator().manual_seed(3)
    vocab = _model_cfg(name).vocab_size
    return (torch.randint(0, vocab, (BATCH, SEQ_LEN), generator=generator),
            torch.randint(0, vocab, (BATCH, SEQ_LEN), generator=generator))


def _export_check(model_cfg: ModelConfig, layout: ParallelismConfig, hf_dir: str
                  ) -> tuple[list[str], list[str], list[str]]:
    """Load HF weights at `layout`, export them back, gathered on every rank and onto first ranks only: (HF names not
    given back bit for bit, with HF's shape, in either; HF names this rank yielded in each)."""
    from pathlib import Path

    from megatron.core import parallel_state

    from megatron_scalerl.models import build_model, export_hf_state, load_hf_state
    from megatron_scalerl.models.hf_io import LazyHFState
    from megatron_scalerl.platform import initialize_model_parallel

    hf_state = LazyHFState(Path(hf_dir))
    initialize_model_parallel(layout.tp, layout.pp, layout.ep, layout.expert_tp_size)
    try:
        model = build_model(model_cfg, layout, fp32_lm_head=True)
        load_hf_state(model, hf_state, model_cfg)
        differing, names = [], {False: [], True: []}
        for to_first_rank in (False, True):  # gathered on every rank, and onto each group's first rank only
            for name, tensor in export_hf_state(model, model_cfg, to_first_rank=to_first_rank):
                if not torch.equal(tensor.cpu(), hf_state[name]):  # also False when the shapes differ
                    differing.append(f"{name} (to_first_rank={to_first_rank})")
                names[to_first_rank].append(name)
        if names[True] and names[True] != names[False]:  # a rank that gets any of its stage gets all of it
            differing.append(f"to_first_rank gave {len(names[True])} of the stage's {len(names[False])} tensors")
        return differing, names[False], names[True]
    finally:
        parallel_state.destroy_model_parallel()


def _layouts_worker(rank, model_cfg_json, hf_dir, layouts, input_ids, labels):
    model_cfg = ModelConfig.model_validate_json(model_cfg_json)
    out = []
    for layout in layouts:
        result = run_layout(model_cfg, layout, hf_dir, input_ids, labels, with_grad=True)
        out.append((result, _export_check(model_cfg, layout, hf_dir)))
    return out


def _run(arch, checkpoints, layouts, world_size) -> list[tuple[LayoutResult, set[str], set[str]]]:
    per_rank = run_local_workers(_layouts_worker, world_size, _model_cfg(arch).model_dump_json(), checkpoints[arch],
                                 layouts, *_tokens(arch), timeout_s=600)
    return _merge_ranks(per_rank, len(layouts))


def _merge_ranks(per_rank, num_layouts) -> list[tuple[LayoutResult, set[str], set[str]]]:
    """Per layout: (the one reported result, HF names exported differently on any rank, HF names exported, HF names
    exported onto first ranks)."""
    results = []
    for index in range(num_layouts):
        reported = [r[index][0] for r in per_rank if r[index][0] is not None]
        assert len(reported) == 1
        differing, names, first_names = (set().union(*(r[index][1][i] for r in per_rank)) for i in range(3))
        results.append((reported[0], differing, names, first_names))
    return results


def _check_against_hf(arch, checkpoints, results):
    reference = hf_reference(checkpoints[arch], *_tokens(arch), with_grad=True)
    vocab = _model_cfg(arch).vocab_size
    for result, export_differing, names, first_names in results:
        where = f"{arch} {result.layout}"
        assert torch.isneginf(result.logits[..., vocab:]).all(), where  # the vocabulary padding, if any
        assert (result.logits[..., :vocab] - reference.logits).abs().max().item() <= TOLERANCE, where
        assert result.loss == pytest.approx(reference.loss, rel=1e-5), where
        assert result.grad_norm == pytest.approx(reference.grad_norm, rel=1e-4), where
        assert not export_differing, where
        assert names == first_names == set(hf_parameter_names(_model_cfg(arch))), where
    return reference


def _single_process_worker(rank, checkpoints):
    """Both families at TP1 and the FP32-head checks, in one worker process."""
    results = {}
    for arch in MODELS:
        (run, export), = _layouts_worker(rank, _model_cfg(arch).model_dump_json(), checkpoints[arch], [trainer_layout()],
                                         *_tokens(arch))
        results[arch] = (run, *(set(part) for part in export))
    return results, _head_checks(rank, _model_cfg("llama3").model_dump_json())


@pytest.fixture(scope="module")
def single_process(checkpoints):
    (result,) = run_local_workers(_single_process_worker, 1, checkpoints, timeout_s=600)
    return result


@pytest.fixture(scope="module")
def tp1(single_process):
    return single_process[0]


@pytest.mark.parametrize("arch", MODELS)
def test_tp1_matches_hf(arch, checkpoints, tp1):
    _check_against_hf(arch, checkpoints, [tp1[arch]])


@pytest.mark.parametrize(
    "change",
    [
        {"attention_chunk_size": 16},  # chunked local attention is in effect at this length
        {"attn_temperature_tuning": False},  # temperature tuning is in effect
        {"use_qk_norm": False},  # L2 QK norm
        {"no_rope_layers": [1, 1, 1, 1]},  # the NoPE layer
    ],
)
def test_llama4_features_matter(change, checkpoints, tp1):
    """Each Llama-4 feature changes HF's logits by far more than our difference from HF."""
    hf = AutoModelForCausalLM.from_pretrained(checkpoints["llama4"], dtype=torch.float32, **change)
    with torch.no_grad():
        changed = hf(_tokens("llama4")[0]).logits
    assert (changed - tp1["llama4"][0].logits).abs().max().item() > 100 * TOLERANCE


def _hf_logits(checkpoint: str, name: str, edit=None, **change) -> torch.Tensor:
    """HF's fp32 logits [BATCH, SEQ_LEN, vocab] on `name`'s tokens, its config changed by `change` and its modules
    by `edit(model)`."""
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, **change)
    if edit is not None:
        edit(hf)
    with torch.no_grad():
        return hf(_tokens(name)[0]).logits


def _qk_norm_weights_to_one(hf) -> None:
    for layer in hf.model.layers:
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            norm.weight.data.fill_(1.0)


def _no_qk_norm(hf) -> None:
    for layer in hf.model.layers:
        layer.self_attn.q_norm = layer.self_attn.k_norm = torch.nn.Identity()


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("edit", [_qk_norm_weights_to_one, _no_qk_norm], ids=["qk_norm_weights", "no_qk_norm"])
def test_qwen3_qk_norm_matters(name, edit, checkpoints, tp1):
    """The q/k RMSNorm, and its weights (drawn from U(0.5, 1.5)), change HF's logits by far more than our difference."""
    changed = _hf_logits(checkpoints[name], name, edit)
    assert (changed - tp1[name][0].logits).abs().max().item() > 100 * TOLERANCE


@pytest.mark.parametrize("name", QWEN3_MOE_MODELS)
def test_qwen3_moe_norm_topk_prob_matters(name, checkpoints, tp1):
    """HF with norm_topk_prob switched computes logits far from ours: we follow the checkpoint's setting, both ways."""
    flipped = not _model_cfg(name).norm_topk_prob
    changed = _hf_logits(checkpoints[name], name, norm_topk_prob=flipped)
    assert (changed - tp1[name][0].logits).abs().max().item() > 100 * TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama3", "llama3_tied", "qwen3"])
def test_dense_layouts_match_hf(name, checkpoints):
    results = _run(name, checkpoints, [trainer_layout(tp=2), trainer_layout(pp=2)], world_size=2)
    _check_against_hf(name, checkpoints, results)


MOE_LAYOUTS = [trainer_layout(tp=2), trainer_layout(pp=2), trainer_layout(ep=2), trainer_layout(tp=2, ep=2),
               trainer_layout(tp=2, ep=2, expert_tp=1)]


def _check_moe_layouts(name, checkpoints, tp1, results) -> None:
    _check_against_hf(name, checkpoints, results)
    single = tp1[name][0]
    for result, *_ in results:  # the same loss and grad norm as one process
        assert result.loss == pytest.approx(single.loss, rel=1e-6), f"{name} {result.layout}"
        assert result.grad_norm == pytest.approx(single.grad_norm, rel=1e-5), f"{name} {result.layout}"


@pytest.mark.slow
def test_moe_layouts_match_hf_and_each_other(checkpoints, tp1):
    _check_moe_layouts("llama4", checkpoints, tp1, _run("llama4", checkpoints, MOE_LAYOUTS, world_size=4))


def _models_worker(rank, checkpoints, names, layouts):
    """Each model of `names` at each of `layouts`, in turn, on one set of workers."""
    return [_layouts_worker(rank, _model_cfg(name).model_dump_json(), checkpoints[name], layouts, *_tokens(name))
            for name in names]


def _run_models(checkpoints, names, layouts, world_size) -> dict[str, list]:
    per_rank = run_local_workers(_models_worker, world_size, checkpoints, names, layouts, timeout_s=600)
    return {name: _merge_ranks([r[index] for r in per_rank], len(layouts)) for index, name in enumerate(names)}


@pytest.mark.slow
def test_qwen3_moe_layouts_match_hf_and_each_other(checkpoints, tp1):
    """Both routings (norm_topk_prob true on dense + routed layers, false on routed ones only) at every MoE layout."""
    for name, results in _run_models(checkpoints, QWEN3_MOE_MODELS, MOE_LAYOUTS, world_size=4).items():
        _check_moe_layouts(name, checkpoints, tp1, results)


@pytest.mark.slow
def test_odd_vocabulary_at_tp2_matches_hf(checkpoints):
    """TP2 splits the 384 padded rows 192 + 192: rank 1 holds tokens 192..262 and 121 padding rows."""
    for name, results in _run_models(checkpoints, ODD_VOCAB_MODELS, [trainer_layout(tp=2)], world_size=2).items():
        _check_against_hf(name, checkpoints, results)


def _head_checks(rank: int, model_cfg_json: str) -> dict:
    """FP32 head on/off in a bf16 model: dtypes of weights and logits, and how the logits are computed."""
    from megatron.core.transformer.module import Float16Module

    from megatron_scalerl.models import build_model
    from megatron_scalerl.platform import initialize_model_parallel

    model_cfg = ModelConfig.model_validate_json(model_cfg_json)
    initialize_model_parallel(seed=5)
    ids = torch.randint(0, model_cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand(2, 16)
    out = {}
    for fp32_head in (True, False):
        model = build_model(model_cfg, ParallelismConfig(), fp32_lm_head=fp32_head, params_dtype=torch.bfloat16)
        wrapped = Float16Module(model.config, model)  # how the trainer runs bf16 (casts the whole model)
        captured = {}
        model.output_layer.register_forward_pre_hook(
            lambda _m, args, captured=captured: captured.setdefault("hidden", args[0])
        )
        with torch.no_grad():
            logits = wrapped(ids, positions, None, fp32_output=False)
            fp32_reference = (captured["hidden"].float() @ model.output_layer.weight.float().t()).transpose(0, 1)
        out[fp32_head] = {
            "head_dtype": model.output_layer.weight.dtype,
            "body_dtype": model.decoder.layers[0].self_attention.linear_qkv.weight.dtype,
            "logits_dtype": logits.dtype,
            "diff_from_fp32_matmul": (logits.float() - fp32_reference).abs().max().item(),
        }
    return out


def test_fp32_head_switch(single_process):
    on, off = single_process[1][True], single_process[1][False]
    assert on["head_dtype"] == torch.float32 and on["body_dtype"] == torch.bfloat16
    assert on["logits_dtype"] == torch.float32
    assert on["diff_from_fp32_matmul"] < 1e-5  # FP32 weights x FP32-upcast hidden states
    assert off["head_dtype"] == off["body_dtype"] == off["logits_dtype"] == torch.bfloat16
    assert off["diff_from_fp32_matmul"] > 1e-3  # bf16 matmul rounding
