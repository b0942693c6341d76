"""Live weight sync: the sharded Megatron trainer -> N vLLM servers, over vLLM's own weight-transfer protocol.

    export.export_buckets(model, model_cfg, bucket_mib, serving_dtype, fp32_lm_head)   HF-named buckets on rank 0
    sender.WeightSender(urls, WeightSyncConfig(...)).connect()                           trainer rank 0's driver
    sender.push_weights(model, model_cfg, config, sender_or_None, weight_version)      collective, every rank
    transport            trainer rank 0's end of the broadcast: gloo (CPU) or vLLM's NCCL (GPU)
    protocol             buckets, wire dtypes, group ranks, checksums (shared by both sides)

The servers' side lives in `inference/`: `gloo_engine` (the CPU receiver, vLLM weight-transfer backend "gloo") and
`worker_extension` (the vLLM worker plugin that registers it; FP32 LM head; checksums). Submodules are imported
explicitly: the server side must not pull in megatron-core, and the trainer side imports vLLM only where it talks to
servers.
"""
