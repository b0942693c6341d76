"""Live weight sync: the sharded Megatron trainer -> N vLLM servers, each sending rank straight to every worker.

    sender.WeightSender(urls, SenderConfig(...), sends=models.weights.sends_weights()).connect()   every rank
    sender.push_weights(model, model_cfg, config, sender, weight_version)    collective, every rank: one sync
    fleet_control.FleetControl   trainer rank 0's HTTP to every server at once: the plan, pause, update, resume
    transport                    `WeightTransport` and its transports (gloo, NCCL, disk), used by both ends
    protocol                     pieces, buckets and their headers (the plan), the `Assembler`, wire dtypes, group
                                 ranks, checksums, the gloo rendezvous (shared by both sides)

Each sending rank sends its own slices of HF tensors (`models.weights.export_hf_slices`: no gather, no funnel
through one rank) over its own group. The servers' side lives in `inference/`: `weight_receiver` (the receiver,
vLLM weight-transfer backend "scalerl", alias "gloo") and `worker_extension` (the vLLM worker plugin that registers
it; staging, checksums, FP32 LM head). Submodules are imported explicitly: the server side must not pull in
megatron-core, and the trainer side imports vLLM only where it talks to servers.
"""

# The worker extension's refusal to convert the LM head while a weight update holds it empty (callers retry on it;
# here, not in `protocol`, so that `scalerl serve` reads it without importing torch).
WEIGHT_UPDATE_IN_PROGRESS = "the LM head is being reloaded by a weight update"
