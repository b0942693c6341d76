"""`scalerl serve` of the demo's model (random weights, the demo tokenizer and its chat template) driven by the
official OpenAI Python client, as a user's tools drive it: the model list, completions with log-probs, chat
completions, and a client with a wrong key refused; one server for all four. The chat route renders a user message
exactly as the run renders its prompts (the same prompt token ids, BOS included when the request asks for it with
vLLM's `add_special_tokens`; without, the prompt is the same text less the BOS), so its greedy answer is the
completion's."""

from __future__ import annotations

import signal

import openai
import pytest

from megatron_scalerl.platform import free_port
from megatron_scalerl.recipe import load_recipe
from megatron_scalerl.tasks.problems import Problem
from megatron_scalerl.tasks.prompts import INSTRUCTIONS, render_prompt
from tests.test_inference_serve import KEY, _read_ready_line, start_serve, stop_serve

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
PROBLEM = "Calculate 7 + 8."
ASKED = Problem("q", PROBLEM, "")
MESSAGE = f"{PROBLEM}\n\n{INSTRUCTIONS['math']}"  # the user message of its prompt (`render_prompt`)


def test_the_openai_client_lists_completes_and_chats_with_the_demo_model_and_needs_the_key(tmp_path):
    from transformers import AutoTokenizer

    from megatron_scalerl.demo.model import build_model

    model = str(build_model(load_recipe("demo"), tmp_path / "demo", seed=0))
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt_ids = tokenizer(render_prompt(ASKED, tokenizer)).input_ids  # BOS, then the text the run trains on
    port = free_port()
    proc = start_serve(model, port, tmp_path / "vllm.log", "--dtype", "float32", "--max-model-len", "512")
    try:
        assert "API key on every route" in _read_ready_line(proc, 300)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120)
        assert [served.id for served in client.models.list().data] == [model]

        completion = client.completions.create(model=model, prompt=render_prompt(ASKED, tokenizer), max_tokens=8,
                                               temperature=0.0, logprobs=2)
        (choice,) = completion.choices
        assert completion.usage.prompt_tokens == len(prompt_ids)
        assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == completion.usage.completion_tokens
        assert completion.usage.completion_tokens > 0 and all(lp <= 0.0 for lp in choice.logprobs.token_logprobs)
        assert all(0 < len(top) <= 2 for top in choice.logprobs.top_logprobs)

        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": MESSAGE}], max_tokens=8, temperature=0.0,
            extra_body={"add_special_tokens": True, "return_token_ids": True})
        assert chat.prompt_token_ids == prompt_ids  # vLLM's field: the training prompt, token for token
        assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content == choice.text
        plain = client.chat.completions.create(  # as any OpenAI client sends it: no BOS, a system message first
            model=model, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": MESSAGE}],
            max_tokens=4, temperature=0.0)
        assert plain.usage.prompt_tokens == len(tokenizer("Be brief.\n\n" + render_prompt(ASKED),
                                                          add_special_tokens=False).input_ids)
        assert isinstance(plain.choices[0].message.content, str) and plain.usage.completion_tokens > 0

        stranger = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0, timeout=30)
        for call in (stranger.models.list, lambda: stranger.chat.completions.create(
                model=model, messages=[{"role": "user", "content": MESSAGE}], max_tokens=1)):
            with pytest.raises(openai.AuthenticationError) as refused:
                call()
            assert refused.value.status_code == 401 and "needs its API key" in refused.value.body  # our middleware's
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:  # a failed check: SIGTERM too, so that `scalerl serve` stops its vLLM server (a SIGKILL orphans it)
        stop_serve(proc)
