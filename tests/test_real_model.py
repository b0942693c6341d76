"""A real model's path, small (issue 51): a GGUF file as llama.cpp writes one becomes an HF checkpoint
(`models.gguf.gguf_to_hf`: weights, tokenizer, chat template, end tokens, generation config) that converts at TP3 (9
heads and 3 KV groups, as SmolLM2's: 3 divides them, 2 does not) and PP2 and back bit for bit; the real-model demo's
recipe and its refusals. The oracle: the HF checkpoint the GGUF was written from (tests/gguf_utils.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_scalerl.errors import UserError
from megatron_scalerl.models.gguf import gguf_to_hf
from megatron_scalerl.models.tokenizer import end_token_ids, train_tokenizer
from megatron_scalerl.recipe import ParallelismConfig, load_recipe
from megatron_scalerl.tasks.prompts import render_prompt
from tests.gguf_utils import write_llama_gguf
from tests.test_convert import differing_tensors
from tests.test_tasks_formats import CHATML

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


@pytest.fixture(scope="module")
def smol_shaped(tmp_path_factory) -> tuple[Path, Path]:
    """(the HF checkpoint, its GGUF): a Llama of SmolLM2's shape in small (9 heads, 3 KV groups, tied embeddings,
    a ChatML template, `<|im_end|>` as its end token), fp32."""
    from megatron_scalerl.models.hf_io import save_random_hf_model

    root = tmp_path_factory.mktemp("smol")
    tokenizer = train_tokenizer([f"{IM_START}user\nWhat is {i} + {i}?{IM_END}\n{IM_START}assistant\n{2 * i}{IM_END}"
                                 for i in range(200)], vocab_size=384, markers=(IM_START, IM_END))
    tokenizer.eos_token, tokenizer.chat_template = IM_END, CHATML
    cfg = load_recipe("scalerl", model_preset="tiny_dense").model.model_copy(update={
        "num_layers": 2, "hidden_size": 288, "num_attention_heads": 9, "num_query_groups": 3, "head_dim": 32,
        "ffn_hidden_size": 384, "vocab_size": len(tokenizer), "tie_word_embeddings": True, "rope_scaling": None})
    hf = save_random_hf_model(cfg, root / "hf", seed=5)
    tokenizer.save_pretrained(hf)
    return hf, write_llama_gguf(hf, root / "tiny.gguf")


def test_a_gguf_becomes_the_hf_checkpoint_it_was_written_from(smol_shaped, tmp_path):
    from transformers import AutoTokenizer

    source, gguf_file = smol_shaped
    out = gguf_to_hf(gguf_file, tmp_path / "hf")
    assert differing_tensors(source, out) == []  # fp32 weights, q/k permuted back, one tied embedding
    config = json.loads((out / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["tie_word_embeddings"]) == (9, 3, True)
    ours, theirs = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(source)
    assert ours.chat_template == CHATML and ours.eos_token == IM_END
    text = f"{IM_START}user\nWhat is 12 + 7?{IM_END}"
    assert ours(text, add_special_tokens=False).input_ids == theirs(text, add_special_tokens=False).input_ids
    assert end_token_ids(ours) == {theirs.convert_tokens_to_ids(IM_END)}  # its generation_config.json's
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == ours.eos_token_id
    assert not list(tmp_path.glob(".*tmp"))
    with pytest.raises(UserError, match="no such GGUF file"):
        gguf_to_hf(tmp_path / "missing.gguf", tmp_path / "x")


@pytest.mark.parametrize("layout", [{"tp": 3}, {"pp": 2}])
def test_a_gguf_checkpoint_converts_at_tp3_and_pp2_and_back_bit_exact(smol_shaped, layout, tmp_path):
    from megatron_scalerl.models.convert import hf_to_megatron, megatron_to_hf

    hf = gguf_to_hf(smol_shaped[1], tmp_path / "hf")
    parallel = ParallelismConfig(**layout)
    back = megatron_to_hf(hf_to_megatron(hf, tmp_path / "meg", parallel), tmp_path / "back", parallel)
    assert differing_tensors(hf, back) == []
    assert (back / "generation_config.json").read_text() == (hf / "generation_config.json").read_text()


def test_the_real_demo_recipe_asks_in_the_models_own_format(smol_shaped, tmp_path):
    from transformers import AutoTokenizer

    from megatron_scalerl.demo.real_model import HELDOUT_NAME, real_demo_recipe, write_heldout
    from megatron_scalerl.tasks.problems import load_source

    hf = smol_shaped[0]
    recipe = real_demo_recipe("smollm2_135m", hf, tmp_path / "run", ["trainer.max_steps=3"])
    source, (benchmark,) = recipe.data.train[0], recipe.eval.benchmarks
    assert recipe.trainer.init_from == str(hf.resolve()) and recipe.algorithm.length_control.mode == "none"
    assert (source.thinking, source.answer_format, benchmark.name) == (False, "last_number", HELDOUT_NAME)
    assert (benchmark.thinking, benchmark.instruction, benchmark.answer_format) == (
        False, source.instruction, source.answer_format)
    (tmp_path / "run").mkdir()
    heldout = write_heldout(recipe, tmp_path / "run")
    problems = load_source(benchmark.source(), seed=0, owner="heldout")
    assert len(problems) == recipe.data.validation_holdout == len(heldout.read_text().splitlines())
    prompt = render_prompt(problems[0], AutoTokenizer.from_pretrained(hf))
    assert prompt.endswith(f"{source.instruction}{IM_END}\n{IM_START}assistant\n") and "think" not in prompt


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.multiprocess
def test_the_real_model_bench_reports_every_ratio(smol_shaped, tmp_path):
    """bench/real_model.py on the small SmolLM2-shaped checkpoint (from its GGUF, as the real one is built), at its
    smallest: each ratio produced and sane (the real model's figures: docs/benchmarks.md)."""
    from safetensors.torch import load_file

    from tests.bench_utils import positive, run_bench

    hf = gguf_to_hf(smol_shaped[1], tmp_path / "hf")
    figures = run_bench("real_model.py", "--hf", str(hf), "--prompts", "4", "--max-tokens", "8", "--steps", "1",
                        "--repeats", "1", "--peak-size", "256", "--peak-repeats", "2", "--set",
                        "rollout.prompts_per_step=1", "--set", "rollout.generations_per_prompt=4")
    assert figures["samples"] == 4 and figures["generator_dtype"] == "float32"
    for side in ("fleet", "offline", "transformers"):
        assert 0 < figures["generation"][side]["tokens"] <= 4 * 8 and positive(figures["generation"][side]["seconds"])
    assert positive(figures["fleet_over_offline"]) and positive(figures["fleet_over_transformers"])
    train, update = figures["train"], figures["update"]
    assert positive(train["tokens_per_s"]) and 0 < train["flops_per_s"] and 0 < train["mfu"] <= 1.5, train
    params = sum(t.numel() for t in load_file(hf / "model.safetensors").values())
    assert update["bytes"] == 4 * params  # fp32 on the wire, the tied head once
    assert 0 < update["pause_share"] <= 1 and positive(update["update_over_flat"]), update
    # where the update's time goes: every part once, none negative, together within the update's own seconds
    from megatron_scalerl.weight_sync.sender import PHASES

    phases = update["phases_s"]
    assert list(phases) == list(PHASES) and min(phases.values()) >= 0 and phases["send_s"] > 0, phases
    assert sum(phases.values()) <= update["seconds"] + 0.01, (phases, update["seconds"])
