"""The orchestrator's old home, kept for scripts: `python -m megatron_scalerl.rollout.orchestrator` starts
`python -m megatron_scalerl.orchestrator`. Everything else lives in `megatron_scalerl.orchestrator`."""
