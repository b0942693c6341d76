"""Generation side: vLLM servers, the orchestrator, rewards, prompt datasets and the rollout stream."""
