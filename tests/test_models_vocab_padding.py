"""Any vocabulary at any TP: the padded vocabulary size, the mapping's padding/stripping, and the recipe rule.

Oracle: the HF tensors themselves (padding appends zero rows; export gives back exactly the HF tensor) and the rule
written out (smallest multiple of lcm(128, tp) >= vocab). The model-level checks (HF parity at TP2 on a 263-token
vocabulary, export after load) are in tests/test_models_parity.py; the masked log-probs in test_trainer_logprobs.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_scalerl.models import mapping
from megatron_scalerl.models.mapping import padded_vocab_size
from megatron_scalerl.models.weights import RankLayout, hf_to_megatron_state
from megatron_scalerl.recipe import load_recipe


@pytest.mark.parametrize(
    "vocab, tp, padded",
    [(263, 1, 384), (263, 2, 384), (263, 8, 384), (1024, 2, 1024), (32001, 4, 32128), (128256, 8, 128256),
     (128257, 8, 128384), (202048, 8, 202112), (263, 3, 384), (1024, 3, 1152), (1, 1, 128)],
)
def test_padded_vocab_size(vocab, tp, padded):
    assert padded_vocab_size(vocab, tp) == padded


def test_padded_vocab_size_is_the_same_at_every_power_of_two_tp():
    """The checkpoint's embedding has one global shape at TP1..TP128, so it reshards between them."""
    for vocab in range(1, 1000):
        sizes = {padded_vocab_size(vocab, 2**k) for k in range(8)}
        assert sizes == {padded_vocab_size(vocab, 1)}
        (size,) = sizes
        assert vocab <= size < vocab + 128 and size % 128 == 0
    assert padded_vocab_size(1000, 6, divisible_by=8) == 1008  # multiple of lcm(8, 6) = 24


def _model_cfg(tied: bool = False):
    return load_recipe("scalerl", model_preset="tiny_dense").model.model_copy(
        update=dict(num_layers=1, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2, num_query_groups=2,
                    head_dim=4, vocab_size=263, tie_word_embeddings=tied))


def _hf_state() -> dict[str, torch.Tensor]:
    """The model-level HF tensors (the tests' stages hold no decoder layers)."""
    g = torch.Generator().manual_seed(0)
    return {"model.embed_tokens.weight": torch.randn(263, 8, generator=g), "model.norm.weight": torch.rand(8),
            "lm_head.weight": torch.randn(263, 8, generator=g)}


@pytest.mark.parametrize("tied", [False, True])
def test_vocab_rules_pad_when_sharding_and_strip_when_exporting(tied):
    cfg = _model_cfg(tied)
    hf = _hf_state()
    # TP2 over a 2-stage pipeline: the tied model's last stage holds its own copy of the embedding as LM head.
    stages = [RankLayout(tp_rank=r, tp_size=2, etp_rank=r, etp_size=2, ep_rank=0, ep_size=1, layers=range(0),
                         first_stage=first, last_stage=not first) for first in (True, False) for r in range(2)]
    states = [hf_to_megatron_state(hf, cfg, ranks) for ranks in stages]
    for name, rule, hf_name in [
        ("embedding.word_embeddings.weight", mapping.EMBEDDING, "model.embed_tokens.weight"),
        ("output_layer.weight", mapping.TIED_OUTPUT_LAYER if tied else mapping.OUTPUT_LAYER,
         "model.embed_tokens.weight" if tied else "lm_head.weight"),
    ]:
        shards = [state[name] for state in states if name in state]
        assert [s.shape for s in shards] == [(192, 8), (192, 8)]  # 384 = padded_vocab_size(263, 2) rows in all
        assert torch.equal(shards[0], hf[hf_name][:192])
        assert torch.equal(shards[1][:71], hf[hf_name][192:]) and not shards[1][71:].any()  # 121 zero rows
        (exported,) = mapping.to_hf(rule, mapping.unshard(rule, shards), cfg).values()
        assert exported.shape == (263, 8) and torch.equal(exported, hf[hf_name])


def test_vocab_rows_must_match_the_config():
    cfg = _model_cfg()
    hf = _hf_state()
    hf["lm_head.weight"] = torch.zeros(300, 8)  # would fit the 384 padded rows, but is not this model's head
    ranks = RankLayout(0, 1, 0, 1, 0, 1, range(0), False, True)
    with pytest.raises(ValueError, match="lm_head.weight: 300 rows, but the model's vocab_size is 263"):
        hf_to_megatron_state(hf, cfg, ranks)


def test_recipe_accepts_any_vocabulary_at_any_tp():
    recipe = load_recipe("scalerl", ["model.vocab_size=263", "parallelism.tp=2", "cluster.gpus_per_node=2"],
                         model_preset="tiny_dense")
    assert (recipe.model.vocab_size, recipe.parallelism.tp) == (263, 2)
    assert load_recipe("scalerl", ["model.vocab_size=128257"]).model.vocab_size == 128257  # llama3_8b preset: tp 2


VOCAB_263 = ["model.vocab_size=263"]
TRAIN_263 = [*VOCAB_263, "trainer.precision=fp32"]  # fp32, so TP2 and TP1 agree to 1e-4


def _train_and_save(rank, run_dir, hf, tp):
    """Two steps at `tp` from the HF weights in a new run `run_dir`, checkpointing after the first: the (loss, grad
    norm) of each step."""
    from megatron_scalerl.trainer.trainer import Trainer
    from tests.trainer_utils import rl_batch, tiny_recipe

    trainer = Trainer(run_dir, tiny_recipe(tp=tp, hf=hf, extra=TRAIN_263))
    metrics = []
    for seed in range(2):
        m = trainer.train_step(rl_batch(seed, vocab=263))
        metrics.append((m["train/loss"], m["train/grad_norm"]))
        if seed == 0:
            trainer.checkpoint()
    return metrics


def _at_tp1(rank, run_dir, single_run_dir, hf):
    """At TP1: the two steps from the HF weights (in `single_run_dir`), then the second step again from the TP2
    checkpoint in `run_dir`, the resumed model's vocab rows and whether its padding rows are still all zero."""
    from megatron_scalerl.models.weights import unwrap_model
    from megatron_scalerl.trainer.trainer import Trainer
    from tests.trainer_utils import rl_batch, tiny_recipe

    single = _train_and_save(rank, single_run_dir, hf, 1)
    trainer = Trainer(run_dir, tiny_recipe(hf=hf, extra=TRAIN_263))  # resumes from the TP2 checkpoint
    m = trainer.train_step(rl_batch(1, vocab=263))
    gpt = unwrap_model(trainer.model[0])
    padding_zero = not gpt.embedding.word_embeddings.weight[263:].any() and not gpt.output_layer.weight[263:].any()
    return single, (m["train/loss"], m["train/grad_norm"]), gpt.output_layer.weight.shape[0], padding_zero


@pytest.mark.slow
@pytest.mark.multiprocess
def test_trainer_on_a_padded_vocabulary_reshards_tp2_to_tp1(tmp_path):
    """Train the tiny model with 263 tokens at TP2 (384 rows, 192 per rank), checkpoint, resume at TP1: the same
    losses and grad norms as one process throughout, and the padding rows never move from zero."""
    from megatron_scalerl.models.hf_io import save_random_hf_model
    from megatron_scalerl.platform import run_local_workers

    hf = str(save_random_hf_model(load_recipe("scalerl", VOCAB_263, model_preset="tiny_dense").model,
                                  tmp_path / "hf", seed=0))
    tp2 = run_local_workers(_train_and_save, 2, tmp_path / "run", hf, 2, timeout_s=400)
    (single, resumed, rows, padding_zero), = run_local_workers(_at_tp1, 1, tmp_path / "run", tmp_path / "tp1", hf,
                                                               timeout_s=400)
    for metrics in tp2:
        for got, expected in zip(metrics, single, strict=True):
            assert got == pytest.approx(expected, rel=1e-4)
    assert resumed == pytest.approx(single[1], rel=1e-4)
    assert rows == 384 and padding_zero
