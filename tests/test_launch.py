"""`scalerl train` before any process starts: the run directory it prepares, the roles' commands, bad input."""

import json
import os
import sys

import pytest

from megatron_scalerl.commands import main
from megatron_scalerl.launch.roles import generator_command, prepare_run_dir, trainer_command
from megatron_scalerl.launch.supervise import STOP_TIMEOUT_S, Role
from megatron_scalerl.platform.precision import serving_dtype, with_resolved_precision
from megatron_scalerl.recipe import load_recipe
from megatron_scalerl.run.directory import read_generators, write_generators

RECIPE = load_recipe("scalerl", model_preset="tiny_moe")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from megatron_scalerl.models.tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(["Calculate 5 - 3. <think> 2 </think> \\boxed{2}"] * 20, vocab_size=300,
                    markers=("<think>", "</think>")).save_pretrained(out)
    return out


def test_run_dir_holds_the_recipe_and_a_servable_model_dir(tmp_path, tokenizer_dir, monkeypatch):
    from transformers import AutoConfig, AutoTokenizer

    fsynced, fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsynced.append(os.fstat(fd).st_ino), fsync(fd)))
    written = prepare_run_dir(tmp_path, RECIPE, tokenizer_dir, cuda=False)
    # model/config.json: written atomically (a temp file fsynced, renamed into place, its folder fsynced after)
    assert fsynced.index((tmp_path / "model" / "config.json").stat().st_ino) < fsynced.index(
        (tmp_path / "model").stat().st_ino)
    assert RECIPE.trainer.precision == "auto"  # the presets' default, resolved for this machine in the run's record
    assert written == load_recipe(tmp_path / "recipe.yaml")
    assert written == with_resolved_precision(RECIPE, cuda=False)[0] and written.trainer.precision in ("bf16", "fp32")
    config = AutoConfig.from_pretrained(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    assert config.eos_token_id == tokenizer.eos_token_id and config.vocab_size == RECIPE.model.vocab_size
    assert tokenizer.encode("</think>", add_special_tokens=False) == [tokenizer.convert_tokens_to_ids("</think>")]


def test_the_launchs_tokenizer_reads_as_autotokenizer_does(tmp_path, tokenizer_dir):
    """`tokenizer_facts` (the launch's quick read: transformers' generic fast tokenizer) against AutoTokenizer, the
    oracle: the same length and special ids, from a tokenizer.json, and from vocab.json + merges.txt alone (there it
    is AutoTokenizer itself)."""
    from transformers import AutoTokenizer, GPT2Tokenizer

    from megatron_scalerl.models.tokenizer import special_token_ids, tokenizer_facts

    slow = tmp_path / "slow"
    vocab, merges = _vocab_merges(tokenizer_dir, tmp_path)
    GPT2Tokenizer(vocab_file=vocab, merges_file=merges, bos_token="<|begin_of_text|>",
                  eos_token="<|end_of_text|>").save_pretrained(slow)
    (slow / "tokenizer.json").unlink(missing_ok=True)
    for directory in (tokenizer_dir, slow):
        quick, oracle = tokenizer_facts(directory), AutoTokenizer.from_pretrained(str(directory))
        assert len(quick) == len(oracle) and special_token_ids(quick) == special_token_ids(oracle), directory
        assert special_token_ids(quick)["eos_token_id"] is not None


def _vocab_merges(tokenizer_dir, out):
    """vocab.json and merges.txt of the BPE in `tokenizer_dir`'s tokenizer.json (a tokenizer without tokenizer.json)."""
    model = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]
    vocab, merges = out / "vocab.json", out / "merges.txt"
    vocab.write_text(json.dumps(model["vocab"]))
    merges.write_text("#version: 0.2\n" + "".join(
        (" ".join(m) if isinstance(m, list) else m) + "\n" for m in model["merges"]))
    return str(vocab), str(merges)


def test_roles_commands(tmp_path):
    generator = generator_command(tmp_path, RECIPE, port=8123, host="127.0.0.1", dtype="float32",
                                  log=tmp_path / "g.log")
    assert generator[-3:] == ["--", "--load-format", "dummy"]  # the trainer sends the weights
    assert generator[generator.index("--max-model-len") + 1] == str(256 + 512)
    trainer = trainer_command(tmp_path, RECIPE)
    assert "--nproc-per-node=1" in trainer
    # torchrun waits as long as the launcher for its workers' last checkpoint (its default: SIGKILL after 30 s)
    assert trainer.index(f"--shutdown-timeout={STOP_TIMEOUT_S:.0f}") < trainer.index("-m")
    assert serving_dtype(RECIPE, cuda=False) == "float32" and serving_dtype(RECIPE, cuda=True) == "bfloat16"
    write_generators(tmp_path, ["http://a:1/"], "float32")
    assert read_generators(tmp_path) == (["http://a:1"], "float32")


def test_an_echoed_roles_every_line_is_in_its_log_and_on_our_stdout_once_it_is_stopped(tmp_path, capsys):
    """The orchestrator's role is echoed (its progress and the run's summary): a launcher that exits right after
    `stop()` (no interpreter teardown: `process_exit`) must not lose the lines its copying thread had not reached."""
    lines = 6000  # ~53 KB: all in the pipe's buffer at once, so the process is gone before its lines are copied
    write = f"import sys; sys.stdout.write(''.join(f'line {{i}}\\n' for i in range({lines})))"
    role = Role("orchestrator", [sys.executable, "-c", write], tmp_path / "orchestrator.log", echo=True).start()
    role.process.wait(timeout=60)
    role.stop()
    assert role.log.read_text().splitlines()[-1] == f"line {lines - 1}"
    assert capsys.readouterr().out.splitlines()[-1] == f"line {lines - 1}"


def test_local_roles_share_the_cores_unless_the_user_set_a_thread_count(tmp_path, monkeypatch):
    """On CPU, without OMP_NUM_THREADS, torch and vLLM would each start a thread per core on cores they share."""
    import os

    from megatron_scalerl.launch.local import local_roles

    demo = load_recipe("demo")  # two trainer ranks and one generator
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    generators, urls, trainer, _ = local_roles(tmp_path, demo, resume=False, cuda=False)
    assert [g.env["OMP_NUM_THREADS"] for g in generators] == ["2"] and trainer.env["OMP_NUM_THREADS"] == "2"
    assert read_generators(tmp_path) == (urls, "float32")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    _, _, trainer, _ = local_roles(tmp_path, demo, resume=False, cuda=False)
    assert trainer.env["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice reaches every role as it is
    generators, _, trainer, _ = local_roles(tmp_path, demo, resume=False, cuda=False)
    assert "OMP_NUM_THREADS" not in trainer.env and "OMP_NUM_THREADS" not in generators[0].env


def test_on_gpus_each_role_gets_its_own_devices_within_those_the_launch_was_given(tmp_path, monkeypatch):
    """cuda=True builds the GPU roles' environments (no GPU is touched): the trainer's ranks first, then each
    generator's generator_tp devices, mapped through an inherited CUDA_VISIBLE_DEVICES (SLURM's, the user's)."""
    from megatron_scalerl.errors import UserError
    from megatron_scalerl.launch.local import local_roles

    recipe = load_recipe("demo", ["cluster.generator_nodes=2"])  # 2 trainer ranks, 2 generators
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    generators, _, trainer, _ = local_roles(tmp_path, recipe, resume=False, cuda=True)
    assert trainer.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert [g.env["CUDA_VISIBLE_DEVICES"] for g in generators] == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    generators, _, trainer, _ = local_roles(tmp_path, recipe, resume=False, cuda=True)
    assert trainer.env["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert [g.env["CUDA_VISIBLE_DEVICES"] for g in generators] == ["6", "7"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    with pytest.raises(UserError, match="needs 4 GPUs .* CUDA_VISIBLE_DEVICES=4,5,6 gives this launch 3"):
        local_roles(tmp_path, recipe, resume=False, cuda=True)


@pytest.mark.parametrize("argv, message", [
    (["train"], "give --recipe"),
    (["train", "--resume"], "--resume needs --run-dir of an existing run"),
    (["train", "--resume", "--run-dir", "{tmp}/empty"], "{tmp}/empty: no recipe.yaml, not a run directory"),
    (["train", "--recipe", "scalerl", "--model", "tiny_moe", "--run-dir", "{tmp}/empty"],
     "the run needs a tokenizer"),
    (["train", "--recipe", "scalerl", "--model", "tiny_moe", "--run-dir", "{tmp}/used", "--tokenizer", "{tok}"],
     "is not empty: continue it with --resume"),
])
def test_train_refuses_bad_input_in_one_line(tmp_path, tokenizer_dir, capsys, argv, message):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "recipe.yaml").write_text("x")
    argv = [a.format(tmp=tmp_path, tok=tokenizer_dir) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message.format(tmp=tmp_path) in err and err.count("\n") == 1


def test_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path, tokenizer_dir):
    from megatron_scalerl.errors import UserError

    small = load_recipe("scalerl", model_preset="tiny_moe", overrides=["model.vocab_size=128"])
    with pytest.raises(UserError, match=r"tokenizer .*: 2\d\d ids, more than model.vocab_size 128"):
        prepare_run_dir(tmp_path / "run", small, tokenizer_dir, cuda=False)
    assert not (tmp_path / "run").exists()


def test_an_hf_init_of_another_shape_is_refused_before_any_model_is_built(tmp_path, capsys):
    """`trainer.init_from` an HF checkpoint (`scalerl demo --init-only`: the demo's tiny MoE) whose config.json says
    other num_layers and hidden_size than the recipe: `scalerl train` refuses it before anything is written or any
    role starts, naming the file and both fields; a trainer rank started on its own refuses it before it builds its
    model (no parallel state is set up here: a build would fail otherwise)."""
    from megatron_scalerl.errors import UserError
    from megatron_scalerl.recipe import require_init_from_matches
    from megatron_scalerl.trainer.setup import build_model_chunks

    model = tmp_path / "model"
    assert main(["demo", "--init-only", str(model)]) == 0
    capsys.readouterr()
    other = ["model.num_layers=2", "model.hidden_size=48"]
    argv = ["train", "--recipe", "demo", "--model", f"hf:{model}", *(a for o in other for a in ("--set", o)),
            "--run-dir", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{model / 'config.json'} describes another model than the recipe's model section (2 field(s) differ)" in err
    assert "model.hidden_size: 48 in the recipe, 128 in config.json; model.num_layers: 2 in the recipe, 4 in " \
        "config.json" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()
    with pytest.raises(UserError, match=r"config\.json describes another model .*model\.num_layers: 2 in the recipe"):
        build_model_chunks(load_recipe("demo", other, model_preset=f"hf:{model}"))
    assert require_init_from_matches(load_recipe("demo", model_preset=f"hf:{model}")) is None  # its own model: fine
