"""vLLM's offline engine timed on a set of requests: the baseline bench/generation.py and bench/real_model.py
measure our fleet against. A script of its own, run as a plain subprocess (`offline_run` in bench/generation.py):
vLLM spawns its engine-core and worker processes, and each spawned process imports its parent's main script again,
so a main script that imports only vLLM saves each of them the benches' own imports (megatron-core, our trainer:
about 4 s of CPU each, three processes per run).

Reads one JSON object on stdin: `model`, `engine` (`vllm.LLM` keywords), `repeats`, `env` (set before vLLM is
imported) and `requests` (`prompt_ids`, `max_tokens`, `temperature`, `top_p`, `seed` each). Prints one JSON object
on its last line: `seconds` (the median of `repeats` timed `LLM.generate` passes of every request at once, after
one warm-up pass) and `tokens` (generated in a pass).
"""

import json
import os
import statistics
import sys
import time


def main() -> None:
    job = json.load(sys.stdin)
    os.environ.update(job["env"])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["model"], enforce_eager=True, logprobs_mode="processed_logprobs", seed=0, **job["engine"])
    requests = job["requests"]
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in requests]
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=r["temperature"], top_p=r["top_p"],
                             seed=r["seed"], logprobs=0, detokenize=False) for r in requests]
    times, tokens = [], 0
    for attempt in range(job["repeats"] + 1):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        if attempt:
            times.append(time.perf_counter() - start)
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    llm.llm_engine.engine_core.shutdown()  # else its engine process outlives this one, which waits for it at exit
    print(json.dumps({"seconds": statistics.median(times), "tokens": tokens}))


if __name__ == "__main__":
    main()
