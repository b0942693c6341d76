"""`scalerl convert`: HF <-> Megatron at any layout, bit-exact round trips, trainer checkpoints out, bad input refused.

Oracles: the source HF tensors themselves (every tensor equal, dtype included), transformers loading the output
(`AutoModelForCausalLM`, `AutoTokenizer`), and `scalerl verify logits` (HF on the output vs our model, fp32).
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_scalerl.checkpoint.sharded import checkpoint_model_config
from megatron_scalerl.commands import main
from megatron_scalerl.errors import UserError
from megatron_scalerl.models.convert import (
    HF_EXTRAS_DIR,
    hf_extras_source,
    hf_to_megatron,
    megatron_dtypes,
    megatron_to_hf,
    verify_hf_checksums,
)
from megatron_scalerl.recipe import ParallelismConfig, load_recipe

VOCAB = 263  # odd: padded to 384 rows inside the Megatron checkpoint, 263 again in HF


def differing_tensors(a_dir: Path, b_dir: Path) -> list[str]:
    """HF names whose tensors differ (values, dtype or shape) between two HF directories, or that only one has."""
    from megatron_scalerl.models.hf_io import LazyHFState

    a, b = LazyHFState(a_dir), LazyHFState(b_dir)
    return [name for name in sorted(set(a) | set(b))
            if name not in a or name not in b or a[name].dtype != b[name].dtype or not torch.equal(a[name], b[name])]


def _write_tokenizer(directory: Path) -> None:
    """A real (word-level) tokenizer over the model's 263 ids, saved in transformers' format."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(directory)


def _hf_model(directory: Path, preset: str, *, head_fp32: bool = False) -> Path:
    """A tiny HF checkpoint with a 263-token vocabulary and a tokenizer; bf16 body (+ an FP32 head if asked: the
    embedding when the preset ties them)."""
    from megatron_scalerl.models.hf_io import save_random_hf_model

    cfg = load_recipe("scalerl", model_preset=preset).model.model_copy(update={"vocab_size": VOCAB})
    save_random_hf_model(cfg, directory, seed=3)
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    for file in directory.glob("*.safetensors"):
        tensors = {k: v if head_fp32 and k == head else v.bfloat16() for k, v in load_file(file).items()}
        save_file(tensors, file, metadata={"format": "pt"})
    _write_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    return _hf_model(tmp_path_factory.mktemp("dense") / "hf", "tiny_dense", head_fp32=True)


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    return _hf_model(tmp_path_factory.mktemp("moe") / "hf", "tiny_moe")


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> Path:
    return _hf_model(tmp_path_factory.mktemp("tied") / "hf", "tiny_qwen3", head_fp32=True)


def _scalerl(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_scalerl.commands", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.multiprocess
def test_dense_round_trip_is_bit_exact_and_loadable(dense, tmp_path):
    """bf16 body + FP32 head, odd vocabulary, tied to nothing: HF -> Megatron -> HF gives every tensor back in its
    own dtype; config and tokenizer travel with the checkpoint; transformers loads the result as-is."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    megatron = hf_to_megatron(dense, tmp_path / "meg", ParallelismConfig())
    assert (megatron / HF_EXTRAS_DIR / "tokenizer.json").is_file()
    out = megatron_to_hf(megatron, tmp_path / "hf2", ParallelismConfig())
    assert differing_tensors(dense, out) == []
    assert load_file(next(out.glob("*.safetensors")))["lm_head.weight"].dtype == torch.float32
    assert verify_hf_checksums(out) == []
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (dense / name).read_bytes()
    model = AutoModelForCausalLM.from_pretrained(out)
    tokens = AutoTokenizer.from_pretrained(out)("w5 w7 w262", return_tensors="pt").input_ids
    assert tokens.tolist() == [[5, 7, 262]]
    assert model(tokens).logits.shape == (1, 3, VOCAB)
    assert not list(tmp_path.glob(".*partial"))  # nothing left under a temporary name


@pytest.mark.slow
@pytest.mark.multiprocess
def test_moe_converts_at_ep2_and_back_at_tp2_pp2_with_verify(moe, tmp_path):
    """Llama-4 MoE: written by 2 expert-parallel workers, read back by TP2 x PP2 workers (each pipeline stage writes
    its own files) into small safetensors files; `--verify` re-hashes the files and matches HF logits; every tensor is the source's."""
    meg, out = tmp_path / "meg", tmp_path / "hf2"
    proc = _scalerl("convert", "hf-to-megatron", "--hf", str(moe), "--out", str(meg), "--ep", "2", "--verify")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["checksums_ok"] and report["logits"]["max_abs_diff"] <= 1e-4
    proc = _scalerl("convert", "megatron-to-hf", "--megatron", str(meg), "--out", str(out), "--tp", "2", "--pp", "2",
                    "--shard-size", "1", "--verify")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["ok"]
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1  # --shard-size 1 MiB split it
    assert differing_tensors(moe, out) == []


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    return _hf_model(tmp_path_factory.mktemp("qwen3") / "hf", "tiny_qwen3")


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> Path:
    return _hf_model(tmp_path_factory.mktemp("qwen3_moe") / "hf", "tiny_qwen3_moe")


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory) -> Path:
    """A tiny DeepSeek-V3 as DeepSeek releases one (once cast to bf16): `num_nextn_predict_layers: 1` and its
    multi-token-prediction layer's weights after the last decoder layer, in a shard of their own (the layer as
    `model.layers.{L}`: a decoder layer's tensors, copied from the last one, plus enorm, hnorm, eh_proj and the
    shared head)."""
    directory = _hf_model(tmp_path_factory.mktemp("deepseek_v3") / "hf", "tiny_deepseek_v3")
    config = json.loads((directory / "config.json").read_text())
    last, hidden = config["num_hidden_layers"] - 1, config["hidden_size"]
    config["num_nextn_predict_layers"] = 1
    (directory / "config.json").write_text(json.dumps(config))
    (shard,) = directory.glob("*.safetensors")
    weights = load_file(shard)
    g = torch.Generator().manual_seed(7)
    mtp = {name.replace(f"model.layers.{last}.", f"model.layers.{last + 1}."): torch.randn(
        t.shape, generator=g).to(t.dtype) for name, t in weights.items() if name.startswith(f"model.layers.{last}.")}
    mtp.update({f"model.layers.{last + 1}.{name}": torch.randn(shape, generator=g).bfloat16() for name, shape in (
        ("enorm.weight", (hidden,)), ("hnorm.weight", (hidden,)), ("eh_proj.weight", (hidden, 2 * hidden)),
        ("shared_head.norm.weight", (hidden,)), ("shared_head.head.weight", (VOCAB, hidden)))})
    save_file(mtp, directory / "mtp.safetensors", metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {**dict.fromkeys(weights, shard.name), **dict.fromkeys(mtp, "mtp.safetensors")}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, to_megatron, to_hf",
    [("qwen3", ["--tp", "2"], ["--pp", "2"]), ("qwen3_moe", ["--ep", "2"], ["--tp", "2"]),
     ("deepseek_v3", ["--tp", "2", "--ep", "2"], ["--pp", "2"])],
)
@pytest.mark.multiprocess
def test_qwen3_round_trips_through_the_cli(family, to_megatron, to_hf, request, tmp_path):
    """Qwen3 (tied embeddings: one tensor, no lm_head.weight, also when the last pipeline stage holds the head) and
    Qwen3-MoE (one HF tensor per expert, split over 2 expert-parallel ranks, then over TP2) and DeepSeek-V3 (latent
    attention, the routing bias, shared experts; at TP2xEP2, then over 2 pipeline stages) go HF -> Megatron -> HF
    bit for bit (DeepSeek-V3 with its multi-token-prediction layer, which nothing trains, carried through unchanged);
    transformers loads the output and computes exactly the source's logits."""
    from transformers import AutoModelForCausalLM

    source = request.getfixturevalue(family)
    meg, out = tmp_path / "meg", tmp_path / "hf2"
    proc = _scalerl("convert", "hf-to-megatron", "--hf", str(source), "--out", str(meg), *to_megatron)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _scalerl("convert", "megatron-to-hf", "--megatron", str(meg), "--out", str(out), *to_hf)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert differing_tensors(source, out) == []
    names = {name for file in out.glob("*.safetensors") for name in load_file(file)}
    if family == "qwen3":
        assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    else:
        assert {f"model.layers.3.mlp.experts.7.{proj}.weight" for proj in ("gate_proj", "up_proj", "down_proj")} <= names
    if family == "deepseek_v3":  # the multi-token-prediction layer (4) carried through, unchanged
        assert {"model.layers.3.mlp.gate.e_score_correction_bias", "model.layers.0.mlp.gate_proj.weight",
                "model.layers.3.self_attn.kv_a_proj_with_mqa.weight", "model.layers.4.eh_proj.weight",
                "model.layers.4.mlp.experts.7.up_proj.weight"} <= names
        assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
        assert verify_hf_checksums(out) == []
    models = [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32) for d in (source, out)]
    assert type(models[1]).__name__ == {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                                        "deepseek_v3": "DeepseekV3ForCausalLM"}[family]
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(*(model(ids).logits for model in models))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tied_round_trip_at_tp2_and_pp2_keeps_one_fp32_tensor(tied, tmp_path):
    """Tied embeddings (Qwen3), bf16 body, the shared weight FP32 (it is the FP32 head): written by 2 TP workers,
    read back by 2 pipeline stages (the last holds the head as a copy of the embedding and exports nothing of it):
    every tensor comes back bit for bit in its own dtype, the shared one once, and no `lm_head.weight` appears."""
    meg = hf_to_megatron(tied, tmp_path / "meg", ParallelismConfig(tp=2))
    assert megatron_dtypes(meg, checkpoint_model_config(meg)) == ("bfloat16", "float32")  # kept FP32 inside
    out = megatron_to_hf(meg, tmp_path / "hf2", ParallelismConfig(pp=2))
    assert differing_tensors(tied, out) == []
    exported = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert "lm_head.weight" not in exported and exported["model.embed_tokens.weight"].dtype == torch.float32
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True


def _train_from_converted(rank, recipe_yaml: str, run_dir: str, hf_dir: str) -> dict:
    """The trainer (bf16 + FP32 head) started from a converted Megatron checkpoint and from the HF directory: the
    same weights; then one step and a trainer checkpoint; the trained model's HF export."""
    from megatron_scalerl.models.weights import export_hf_state
    from megatron_scalerl.recipe import load_recipe
    from megatron_scalerl.trainer.setup import build_model_and_optimizer
    from megatron_scalerl.trainer.trainer import Trainer
    from tests.trainer_utils import rl_batch

    recipe = load_recipe(recipe_yaml)
    from_hf, _ = build_model_and_optimizer(recipe.model_copy(update={"trainer": recipe.trainer.model_copy(
        update={"init_from": hf_dir})}))
    hf_start = dict(export_hf_state(from_hf[0], recipe.model))
    trainer = Trainer(run_dir, recipe)
    start = dict(export_hf_state(trainer.model[0], recipe.model))  # at TP1 these are views of the live weights
    same_start = all(torch.equal(start[k], hf_start[k]) for k in hf_start)
    trainer.train_step(rl_batch(0, vocab=VOCAB))
    trainer.checkpoint()
    trained = {k: v.clone() for k, v in export_hf_state(trainer.model[0], recipe.model)}
    return {"same_start": same_start, "trained": trained}


def test_a_trainer_checkpoints_config_and_tokenizer_come_from_where_its_run_started(tmp_path):
    """A run's checkpoint RUN/checkpoints/iter_N: its run's recipe.yaml names `trainer.init_from` (its `hf/` when that
    is a converted checkpoint); without a recipe.yaml, nothing; a damaged one is an error naming it."""
    ckpt = tmp_path / "run" / "checkpoints" / "iter_0000001"
    ckpt.mkdir(parents=True)
    assert hf_extras_source(ckpt) is None
    source = tmp_path / "converted"
    (source / HF_EXTRAS_DIR).mkdir(parents=True)
    recipe = tmp_path / "run" / "recipe.yaml"
    recipe.write_text(load_recipe("demo", [f"trainer.init_from={source}"]).to_yaml())
    assert hf_extras_source(ckpt) == source / HF_EXTRAS_DIR
    recipe.write_text(recipe.read_text().replace("trainer:\n", "trainer:\n  no_such_key: 1\n"))
    with pytest.raises(UserError, match=f"{recipe}: trainer.no_such_key: unknown key"):
        hf_extras_source(ckpt)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_trainer_starts_from_a_converted_checkpoint_and_its_checkpoints_export(dense, tmp_path):
    """`trainer.init_from` takes the converted checkpoint (written at TP2, read at TP1); the run's own checkpoint
    exports to HF with the trainer's dtypes (bf16 body, FP32 head, asked for on any CPU), the tokenizer of the run's source, and exactly
    the trained weights."""
    from megatron_scalerl.fileio import dump_yaml
    from megatron_scalerl.platform import run_local_workers
    from tests.trainer_utils import BF16, tiny_recipe

    meg = hf_to_megatron(dense, tmp_path / "meg", ParallelismConfig(tp=2))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    recipe = tiny_recipe(hf=str(meg), extra=[*BF16, f"model.vocab_size={VOCAB}"])  # the GPU recipe's dtypes
    (run_dir / "recipe.yaml").write_text(dump_yaml(recipe.model_dump(mode="json")))
    (result,) = run_local_workers(_train_from_converted, 1, str(run_dir / "recipe.yaml"), str(run_dir), str(dense),
                                  timeout_s=600)
    assert result["same_start"]
    out = megatron_to_hf(run_dir / "checkpoints" / "iter_0000001", tmp_path / "trained_hf", ParallelismConfig())
    exported = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert exported["lm_head.weight"].dtype == torch.float32
    assert exported["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert exported.keys() == result["trained"].keys()
    assert all(torch.equal(exported[k], result["trained"][k]) for k in exported)
    assert (out / "tokenizer.json").read_bytes() == (dense / "tokenizer.json").read_bytes()


# -- bad input: one line, exit 2, nothing written -------------------------------------------------------------------

def _copy_hf(source: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(source, target)
    return target


def _refused(args: list[str], message: str, out: Path) -> None:
    """`scalerl convert ARGS --out OUT` (the CLI's `main`, in this process: no interpreter started for a refusal)
    exits 2 with one `error:` line holding `message`, and writes nothing."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        code = main(["convert", *args, "--out", str(out)])
    assert code == 2, stderr.getvalue()[-2000:]
    lines = [line for line in stderr.getvalue().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], stderr.getvalue()[-2000:]
    assert not out.exists() and not list(out.parent.glob(f".{out.name}*"))


def test_unknown_architecture(dense, tmp_path):
    bad = _copy_hf(dense, tmp_path / "gpt2")
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "gpt2", "architectures": ["GPT2LMHead"]}))
    _refused(["hf-to-megatron", "--hf", str(bad)], "model_type", tmp_path / "out")


def test_truncated_shard(dense, tmp_path):
    bad = _copy_hf(dense, tmp_path / "truncated")
    shard = bad / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    _refused(["hf-to-megatron", "--hf", str(bad)], "model.safetensors: unreadable safetensors file", tmp_path / "out")


def test_missing_shard(dense, tmp_path):
    bad = _copy_hf(dense, tmp_path / "missing")
    weight_map = {name: "model-00002-of-00002.safetensors" for name in load_file(bad / "model.safetensors")}
    (bad / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (bad / "model.safetensors").unlink()
    _refused(["hf-to-megatron", "--hf", str(bad)], "model-00002-of-00002.safetensors: listed in the index",
             tmp_path / "out")


def test_shape_disagrees_with_config(dense, tmp_path):
    bad = _copy_hf(dense, tmp_path / "shape")
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] * 2}))
    _refused(["hf-to-megatron", "--hf", str(bad)], "mlp.gate_proj.weight has shape", tmp_path / "out")


@pytest.mark.multiprocess
def test_checkpoint_that_fails_its_manifest(dense, tmp_path):
    meg = hf_to_megatron(dense, tmp_path / "meg", ParallelismConfig())
    data = next(meg.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    _refused(["megatron-to-hf", "--megatron", str(meg)], "sha256 mismatch", tmp_path / "out")
    # the trainer starting from it refuses it too (its two ranks split the hashing), before loading any weight
    from megatron_scalerl.platform import WorkerError, run_local_workers
    from tests.trainer_utils import tiny_recipe

    recipe = tiny_recipe(dp=2, hf=str(meg), extra=[f"model.vocab_size={VOCAB}"])
    with pytest.raises(WorkerError, match=r"trainer\.init_from .*sha256 mismatch"):
        run_local_workers(_build_trainer, 2, recipe, timeout_s=300)


def _build_trainer(rank: int, recipe) -> None:
    from megatron_scalerl.trainer.setup import build_model_and_optimizer

    build_model_and_optimizer(recipe)


def test_existing_output_is_never_overwritten(dense, tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(UserError, match="already exists"):
        hf_to_megatron(dense, tmp_path / "out", ParallelismConfig())


@pytest.mark.slow  # an end-to-end run of its own (make test-fast stays under 10 minutes)
@pytest.mark.multiprocess
def test_interrupted_conversion_leaves_no_output(dense, tmp_path):
    """Killed mid-conversion: OUT does not exist (the work sits under a hidden temporary name), and a rerun works."""
    import os
    import signal
    import time

    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "megatron_scalerl.commands", "convert", "hf-to-megatron", "--hf",
                             str(dense), "--out", str(out)], start_new_session=True, stderr=subprocess.DEVNULL)
    partial = tmp_path / ".out.partial"
    deadline = time.monotonic() + 120
    while not partial.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert partial.exists(), "the conversion never started writing"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    hf_to_megatron(dense, out, ParallelismConfig())
    assert (out / "manifest.json").is_file()
