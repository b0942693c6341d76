"""HF parity of our Megatron models (dense Llama-3, Llama-4 MoE) at TP1, TP2, PP2, EP2 and TP2xEP2.

Oracle: transformers' LlamaForCausalLM / Llama4ForCausalLM with random weights, fp32: logits (max abs diff
<= 1e-4), mean cross-entropy and the gradient norm of that loss. Llama-4 runs on sequences longer than its
attention chunk, with temperature tuning active, a NoPE layer and both dense and MoE layers; each of those
features is shown to matter (switching it off in HF moves the logits far more than our difference).
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

TOLERANCE = 1e-4
SEQ_LEN = 80  # > 2 chunks of 32 tokens
BATCH = 4  # splits over up to 4 data-parallel ranks


ODD_VOCAB = 263  # neither a multiple of 2 nor of 128: the models pad it to padded_vocab_size(263, tp) = 384 rows
ODD_VOCAB_MODELS = ("llama3_vocab263", "llama4_vocab263")
MODELS = ("llama3", "llama3_tied", "llama4", *ODD_VOCAB_MODELS)


def _model_cfg(name: str) -> ModelConfig:
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


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama3", "llama3_tied"])
def test_dense_layouts_match_hf(name, checkpoints):
    results = _run(name, checkpoints, [trainer_layout(tp=2), trainer_layout(pp=2)], world_size=2)
    _check_against_hf(name, checkpoints, results)


@pytest.mark.slow
def test_moe_layouts_match_hf_and_each_other(checkpoints, tp1):
    layouts = [trainer_layout(tp=2), trainer_layout(pp=2), trainer_layout(ep=2), trainer_layout(tp=2, ep=2), trainer_layout(tp=2, ep=2, expert_tp=1)]
    results = _run("llama4", checkpoints, layouts, world_size=4)
    _check_against_hf("llama4", checkpoints, results)
    single = tp1["llama4"][0]
    for result, *_ in results:  # the same loss and grad norm as one process
        assert result.loss == pytest.approx(single.loss, rel=1e-6), result.layout
        assert result.grad_norm == pytest.approx(single.grad_norm, rel=1e-5), result.layout


def _odd_vocabulary_worker(rank, checkpoints):
    return [_layouts_worker(rank, _model_cfg(name).model_dump_json(), checkpoints[name], [trainer_layout(tp=2)],
                            *_tokens(name)) for name in ODD_VOCAB_MODELS]


@pytest.mark.slow
def test_odd_vocabulary_at_tp2_matches_hf(checkpoints):
    """TP2 splits the 384 padded rows 192 + 192: rank 1 holds tokens 192..262 and 121 padding rows."""
    per_rank = run_local_workers(_odd_vocabulary_worker, 2, checkpoints, timeout_s=600)
    for index, name in enumerate(ODD_VOCAB_MODELS):
        _check_against_hf(name, checkpoints, _merge_ranks([r[index] for r in per_rank], 1))


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
