"""The recipe's `weight_sync` section (issue 39): its defaults, an old run's recipe.yaml without it, bad values refused
when the recipe loads, and what this machine cannot run refused at launch (weight_sync/launch_checks.py), naming the
key: nccl without CUDA, staging that does not fit."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_scalerl.errors import RecipeError, UserError
from megatron_scalerl.fileio import dump_yaml
from megatron_scalerl.launch.local import start_run
from megatron_scalerl.launch.preflight import node_problems
from megatron_scalerl.launch.roles import generator_command
from megatron_scalerl.models.memory_plan import (
    NCCL_COMMUNICATOR_GIB,
    NCCL_PART,
    STAGING_PART,
    WEIGHT_SYNC_QUEUED_BUCKETS,
    generator_plan,
    param_counts,
    reserve_gib,
    vllm_share,
    weight_sync_extras,
    weight_sync_senders,
)
from megatron_scalerl.recipe import load_recipe, load_run_recipe
from megatron_scalerl.recipe.schema import WeightSyncConfig
from megatron_scalerl.recipe.variants import union_variants
from megatron_scalerl.run.directory import RECIPE_FILE
from megatron_scalerl.weight_sync.generator_link import weight_sync_config
from megatron_scalerl.weight_sync.launch_checks import (
    check_weight_sync,
    generator_free_bytes,
    host_available_bytes,
    staging_bytes,
    staging_setting,
)
from megatron_scalerl.weight_sync.transport import QUEUED_BUCKETS, TRANSPORTS, make_transport

GIB = 2**30
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is of a node without CUDA")


def test_defaults_from_scalerl_yaml_and_the_schema_agree():
    defaults = WeightSyncConfig()
    assert (defaults.transport.type, defaults.bucket_mib, defaults.staging, defaults.checksum_every) == (
        "auto", 64.0, "auto", 0)
    assert load_recipe("scalerl").weight_sync == defaults and load_recipe("demo").weight_sync == defaults


def test_an_old_run_recipe_without_the_section_loads_with_the_defaults(tmp_path):
    written = load_recipe("demo").to_dict()
    del written["weight_sync"]  # a RUN/recipe.yaml written before the section existed
    (tmp_path / RECIPE_FILE).write_text(dump_yaml(written))
    recipe = load_run_recipe(tmp_path, RECIPE_FILE)
    assert recipe.weight_sync == WeightSyncConfig()
    overridden = load_run_recipe(tmp_path, RECIPE_FILE, ["weight_sync.staging=off", "weight_sync.bucket_mib=16"])
    assert overridden.weight_sync.staging == "off" and overridden.weight_sync.bucket_mib == 16.0


def test_yaml_on_and_off_are_the_words_and_survive_a_round_trip(tmp_path):
    """YAML 1.1 reads a bare `on` as true: `staging: on` in a file or a --set still means on."""
    (tmp_path / "r.yaml").write_text("base: demo\nweight_sync:\n  staging: on\n  transport: disk\n")
    recipe = load_recipe(str(tmp_path / "r.yaml"))
    assert recipe.weight_sync.staging == "on" and recipe.weight_sync.transport.type == "disk"
    (tmp_path / RECIPE_FILE).write_text(recipe.to_yaml())
    assert load_run_recipe(tmp_path, RECIPE_FILE).weight_sync == recipe.weight_sync
    assert load_recipe("demo", ["weight_sync.staging=off"]).weight_sync.staging == "off"


@pytest.mark.parametrize("override, key", [
    ("weight_sync.bucket_mib=0", "weight_sync.bucket_mib"),
    ("weight_sync.bucket_mib=-4", "weight_sync.bucket_mib"),
    ("weight_sync.staging=maybe", "weight_sync.staging"),
    ("weight_sync.staging=1", "weight_sync.staging"),
    ("weight_sync.transport=infiniband", "weight_sync.transport"),
    ("weight_sync.checksum_every=-1", "weight_sync.checksum_every"),
    ("weight_sync.checksum_every=1.5", "weight_sync.checksum_every"),
    ("weight_sync.bucket=64", "weight_sync.bucket"),
])
def test_bad_values_are_refused_when_the_recipe_loads_naming_the_key(override, key):
    with pytest.raises(RecipeError) as err:
        load_recipe("demo", [override])
    assert err.value.path == key


def test_nccl_without_cuda_is_refused_at_launch_not_at_load():
    recipe = load_recipe("demo", ["weight_sync.transport=nccl"])  # loads anywhere (submit hosts, recipe show)
    with pytest.raises(UserError, match=r"^weight_sync\.transport: nccl needs CUDA on the trainer and the "
                                        r"generators; this node has none \(use auto or gloo\)$"):
        check_weight_sync(recipe, cuda=False, free_bytes_per_worker=None)
    check_weight_sync(recipe, cuda=True, free_bytes_per_worker=None)


def test_staging_that_does_not_fit_is_refused_naming_the_sizes():
    recipe = load_recipe("demo", ["weight_sync.staging=on"])
    need = staging_bytes(recipe, cuda=False)
    with pytest.raises(UserError) as err:
        check_weight_sync(recipe, cuda=False, free_bytes_per_worker=1024)
    message = str(err.value)
    assert message.startswith("weight_sync.staging: on needs one copy of the model's weights beside each generator worker, "
                              f"{need / GIB:.2f} GiB,") and "has 0.00 GiB free" in message
    assert message.endswith("(use auto or off)")
    check_weight_sync(recipe, cuda=False, free_bytes_per_worker=need)  # fits exactly
    check_weight_sync(recipe, cuda=False, free_bytes_per_worker=None)  # unknown: no refusal


def test_staging_on_gpu_generators_with_tensor_parallelism_is_off_until_measured():
    """`auto` runs off there, `on` is refused naming the key; on CPUs, and at generator TP 1, both stay as set."""
    for staging in ("auto", "on", "off"):
        tp1 = load_recipe("scalerl", [f"weight_sync.staging={staging}"])
        tp2 = load_recipe("scalerl", [f"weight_sync.staging={staging}", "parallelism.generator_tp=2"])
        assert staging_setting(tp1, cuda=True) == staging_setting(tp2, cuda=False) == staging
        assert staging_setting(tp2, cuda=True) == ("on" if staging == "on" else "off")
    tp2 = load_recipe("scalerl", ["weight_sync.staging=on", "parallelism.generator_tp=2"])
    with pytest.raises(UserError, match=r"^weight_sync\.staging: on has not been measured on GPU generators with "
                                        r"tensor parallelism \(parallelism\.generator_tp is 2\): use auto"):
        check_weight_sync(tp2, cuda=True, free_bytes_per_worker=None)
    check_weight_sync(tp2, cuda=False, free_bytes_per_worker=None)


@pytest.mark.parametrize("transport", ["auto", "gloo", "disk"])
@pytest.mark.parametrize("staging", ["auto", "off"])
def test_auto_gloo_and_disk_run_anywhere_on_cpu(transport, staging):
    recipe = load_recipe("demo", [f"weight_sync.transport={transport}", f"weight_sync.staging={staging}"])
    check_weight_sync(recipe, cuda=False, free_bytes_per_worker=1)  # nothing fits, and nothing is asked to


def test_staging_bytes_are_the_weights_in_the_serving_dtype():
    """fp32 on CPUs; bf16 on GPUs with the untied head in FP32 (trainer.fp32_lm_head), as the generator holds it."""
    recipe = load_recipe("scalerl", ["trainer.precision=bf16"], model_preset="tiny_dense")
    counts = param_counts(recipe)
    assert counts.output > 0 and staging_bytes(recipe, cuda=False) == counts.total * 4
    assert staging_bytes(recipe, cuda=True) == (counts.total - counts.output) * 2 + counts.output * 4
    no_fp32_head = recipe.model_copy(update={"trainer": recipe.trainer.model_copy(update={"fp32_lm_head": False})})
    assert staging_bytes(no_fp32_head, cuda=True) == counts.total * 2


def test_free_memory_on_cpu_is_memavailable_shared_by_the_generators(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:        20000000 kB\nMemAvailable:   8000000 kB\n")
    assert host_available_bytes(meminfo) == 8_000_000 * 1024
    assert host_available_bytes(tmp_path / "absent") is None
    monkeypatch.setattr("megatron_scalerl.weight_sync.launch_checks.MEMINFO", meminfo)
    assert generator_free_bytes(load_recipe("demo"), cuda=False, generators_here=4) == 2_000_000 * 1024
    assert generator_free_bytes(load_recipe("scalerl", ["parallelism.generator_tp=2"]), cuda=False,
                                generators_here=2) == 2_000_000 * 1024  # 2 generators of 2 workers


@no_cuda
def test_a_local_launch_refuses_before_writing_anything(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(UserError, match=r"^weight_sync\.transport: nccl needs CUDA"):
        start_run(run_dir, load_recipe("demo", ["weight_sync.transport=nccl"]), tmp_path / "no_tokenizer")
    # 16 generators of a 235B model: one fp32 copy each is ~876 GiB, more than any host's memory
    huge = load_recipe("scalerl", ["weight_sync.staging=on"], model_preset="qwen3_235b_a22b")
    with pytest.raises(UserError, match=r"^weight_sync\.staging: on needs .* \(use auto or off\)$"):
        start_run(run_dir, huge, tmp_path / "no_tokenizer")
    assert not run_dir.exists()


def test_the_slurm_node_check_measures_staging_on_the_generator_node(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert node_problems(tmp_path / "run", model, [], None, None, staging_bytes=1024, generators=2) == []
    [problem] = node_problems(tmp_path / "run", model, [], None, None, staging_bytes=2**50, generators=2)
    assert problem.startswith("weight_sync.staging: on needs") and "1048576.00 GiB" in problem
    done = subprocess.run([sys.executable, "-m", "megatron_scalerl.launch.preflight", "node", "--run-dir",
                           str(tmp_path / "run"), "--model", str(model), "--staging-bytes", str(2**50),
                           "--generators", "2"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "weight_sync.staging: on needs" in done.stdout, done.stdout + done.stderr


def test_every_transport_a_recipe_names_is_one_the_transports_module_builds():
    """The receiving side may not import the recipe, so the transports' names live twice: the recipe's
    `weight_sync.transport` alternatives (with `auto`) and `weight_sync.transport.TRANSPORTS`; they must agree."""
    named = {tag for cls in union_variants(WeightSyncConfig.model_fields["transport"].annotation) for tag in cls.tags()}
    assert named - {"auto"} == set(TRANSPORTS)
    with pytest.raises(ValueError, match="one of gloo, nccl, disk"):
        make_transport("tcp")
    # likewise the receivers' bound on queued buckets, which the memory plan counts (models/ may not import it)
    assert WEIGHT_SYNC_QUEUED_BUCKETS == QUEUED_BUCKETS


def test_the_disk_transport_writes_where_its_section_says(tmp_path):
    """`weight_sync.transport: {type: disk, dir}`: the senders' folder (the receivers read it from the sender's
    endpoint); without `dir`, RUN/weight_sync. A bare `disk`, and the broadcast's names, as before."""
    run_dir = tmp_path / "run"
    default = weight_sync_config(load_recipe("demo", ["weight_sync.transport=disk"]), run_dir, "float32")
    assert (default.transport, default.disk_dir) == ("disk", str(run_dir / "weight_sync"))
    scratch = load_recipe("demo", ["weight_sync.transport.type=disk", f"weight_sync.transport.dir={tmp_path / 's'}"])
    assert weight_sync_config(scratch, run_dir, "float32").disk_dir == str(tmp_path / "s")
    assert scratch.to_dict()["weight_sync"]["transport"] == {"type": "disk", "dir": str(tmp_path / "s")}
    assert weight_sync_config(load_recipe("demo", ["weight_sync.transport=gloo"]), run_dir, "float32").transport == \
        "gloo"


def test_what_weight_sync_makes_on_a_generator_gpu_is_kept_out_of_vllms_share():
    """The generator plan's parts beside vLLM's own (`memory_plan.weight_sync_extras`), on the shipped 8B recipe
    (bf16, FP32 head, NCCL on GPUs): the FP32 head's copy less the bf16 weight it replaces, one communicator per
    sending trainer rank, the queued buckets and the arriving one (weight_sync.transport's own bound); none on
    CPUs but the host-memory parts' absence; the launch gives their sum to `scalerl serve --reserve-gib`, which
    lowers vLLM's share by it."""
    recipe = load_recipe("scalerl", model_preset="llama3_8b")
    counts, tp = param_counts(recipe), recipe.parallelism.generator_tp
    extras = weight_sync_extras(recipe, cuda=True)
    assert extras == {"fp32 lm head (weight sync)": counts.output * (4 - 2) / tp,
                      NCCL_PART: weight_sync_senders(recipe) * NCCL_COMMUNICATOR_GIB * GIB,
                      "buckets in flight (weight sync)": (QUEUED_BUCKETS + 1) * recipe.weight_sync.bucket_mib * 2**20}
    assert weight_sync_senders(recipe) == recipe.parallelism.tp  # dense: data-parallel rank 0's TP ranks
    assert weight_sync_extras(recipe, cuda=False) == {}  # fp32 served, gloo into host memory
    staged = load_recipe("scalerl", ["weight_sync.staging=on"], model_preset="llama3_8b")
    assert weight_sync_extras(staged, cuda=True)[STAGING_PART] == staging_bytes(staged, cuda=True)
    assert generator_plan(recipe).total_gib == pytest.approx(
        (sum(generator_plan(recipe).parts.values()) + sum(extras.values())) / GIB)
    reserve = reserve_gib(recipe)
    assert reserve == pytest.approx(sum(extras.values()) / GIB)
    command = generator_command(Path("run"), recipe, port=8000, host="127.0.0.1", dtype="bfloat16", log=Path("g.log"))
    assert command[command.index("--reserve-gib") + 1] == f"{reserve:.3f}"
    assert command.index("--reserve-gib") < command.index("--")  # scalerl serve's flag, not vLLM's
    assert vllm_share(reserve, 80) == pytest.approx(0.9 - reserve / 80)
    with pytest.raises(ValueError, match=r"weight sync needs 40\.00 GiB of each 80\.0 GiB GPU beside vLLM"):
        vllm_share(40, 80)
