"""Tasks: where prompts come from and how answers are judged, shared by the orchestrator, evaluation and the demo
(`prompts`: sources, held-out split, sampler, chat template; `rewards`: verifiers run in worker processes)."""
