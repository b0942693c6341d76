"""`python -m megatron_scalerl.orchestrator --run-dir RUN [--resume]`: the orchestrator process."""

from megatron_scalerl.families.llama4.rope_note import quiet_if_said
from megatron_scalerl.orchestrator.orchestrator import main
from megatron_scalerl.process_exit import exit_with

if __name__ == "__main__":
    quiet_if_said()  # a run's processes: transformers' note on Scout's RoPE scaling was said once by the launcher
    exit_with(main)
