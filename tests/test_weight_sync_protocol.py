"""Weight-sync pieces that need no process: buckets, packing, group ranks, checksums, the server command line and
the worker extension's registration (the end-to-end tests are test_weight_sync_dense.py / test_weight_sync_moe.py)."""

import json

import pytest
import torch

from megatron_scalerl.inference.vllm_server import WORKER_EXTENSION, VLLMServerConfig, find_tcmalloc
from megatron_scalerl.weight_sync.protocol import (
    EMBEDDING,
    LM_HEAD,
    MIB,
    Assembler,
    Bucket,
    Piece,
    bucket_header,
    checksum,
    group_buckets,
    rank_offsets,
)
from megatron_scalerl.weight_sync.sender import wire_dtype


def _named(*sizes, dtype=torch.float32):
    return [(f"t{i}", torch.arange(n, dtype=dtype)) for i, n in enumerate(sizes)]


def test_buckets_respect_size_order_and_dtype():
    named = _named(10, 10, 30, 5) + [("h", torch.ones(3, dtype=torch.bfloat16)), ("i", torch.ones(2))]
    groups = group_buckets([Piece.of(p) for p in named], 80, lambda name: dict(named)[name].dtype)  # 20 fp32
    assert [[p.name for p in g] for g in groups] == [["t0", "t1"], ["t2"], ["t3"], ["h"], ["i"]]  # t2 (120 B) alone
    # sizes count in the wire dtype: cast to bf16, everything fits in two buckets of 80 bytes
    halves = group_buckets([Piece.of(p) for p in named], 80, lambda name: torch.bfloat16)
    assert [[p.name for p in g] for g in halves] == [["t0", "t1"], ["t2", "t3", "h", "i"]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bucket_round_trip_through_header(dtype):
    named = [(name, torch.randn(*shape).to(dtype)) for name, shape in (("a", (3, 4)), ("b", (5,)), ("c", (2, 3)))]
    pieces = [Piece.of(p) for p in named]
    bucket = Bucket.pack(7, pieces)
    header = json.loads(json.dumps(bucket.header()))  # plain JSON, as it travels
    assert header == bucket_header(7, pieces, lambda name: dtype)  # the plan's header, computed without packing
    received = Bucket.empty_from_header(header, torch.device("cpu"))
    received.packed.copy_(bucket.packed)
    for (name, tensor), (got_name, got) in zip(named, received.tensors(), strict=True):
        assert got_name == name and got.dtype == tensor.dtype and torch.equal(got, tensor)
    assert "bucket 7 (3 tensors" in bucket.describe()


def test_assembler_refuses_slices_that_do_not_fit():
    full = torch.arange(12.0).reshape(4, 3)
    top, bottom = Piece("w", full[:2], (4, 3), (0, 0)), Piece("w", full[2:], (4, 3), (2, 0))
    assembler = Assembler()
    first = Bucket.pack(0, [top])
    assert assembler.add(first.header(), first.packed) == [] and assembler.incomplete() == ["w"]
    second = Bucket.pack(1, [bottom])
    ((name, whole),) = assembler.add(second.header(), second.packed)
    assert name == "w" and torch.equal(whole, full) and assembler.incomplete() == []
    outside = Bucket.pack(2, [Piece("w", full[2:], (4, 3), (3, 0))])
    with pytest.raises(ValueError, match="w: slice at \\[3, 0\\] of shape \\[2, 3\\] outside \\[4, 3\\]"):
        assembler.add(outside.header(), outside.packed)
    other = Bucket.pack(3, [Piece("w", full[:2].double(), (4, 3), (0, 0))])
    assembler.add(other.header(), other.packed)  # w, float64 now
    mixed = Bucket.pack(4, [Piece("w", full[:2], (4, 3), (2, 0))])
    with pytest.raises(ValueError, match="w: a slice of shape \\[4, 3\\] torch.float32 after slices of"):
        assembler.add(mixed.header(), mixed.packed)


def test_group_ranks_follow_server_worker_counts():
    assert rank_offsets([2, 1, 4]) == ([1, 3, 4], 8)  # trainer rank 0, then 2 + 1 + 4 server workers
    assert rank_offsets([1]) == ([1], 2)


def test_wire_dtypes_and_checksums():
    assert wire_dtype(LM_HEAD, torch.bfloat16, fp32_lm_head=True, tied=False) == torch.float32
    assert wire_dtype(LM_HEAD, torch.bfloat16, fp32_lm_head=False, tied=False) == torch.bfloat16
    assert wire_dtype("model.norm.weight", torch.bfloat16, fp32_lm_head=True, tied=False) == torch.bfloat16
    assert wire_dtype(EMBEDDING, torch.bfloat16, fp32_lm_head=True, tied=False) == torch.bfloat16
    # tied embeddings: the embedding is the head, and travels in FP32 with it
    assert wire_dtype(EMBEDDING, torch.bfloat16, fp32_lm_head=True, tied=True) == torch.float32
    assert wire_dtype(EMBEDDING, torch.bfloat16, fp32_lm_head=False, tied=True) == torch.bfloat16
    t = torch.randn(64)
    flipped = t.clone()
    flipped.view(torch.int32)[10] ^= 1  # one bit
    assert checksum(t) == checksum(t.clone()) != checksum(flipped)
    assert checksum(t) != checksum(t.bfloat16())
    assert MIB == 2**20


def test_server_command_enables_weight_transfer():
    config = VLLMServerConfig(model="/m", port=8123, dtype="float32", tensor_parallel_size=2, api_key="k")
    cmd = config.command()
    assert cmd[1:3] == ["-m", "megatron_scalerl.inference.api_server"]
    assert json.loads(cmd[cmd.index("--weight-transfer-config") + 1]) == {"backend": "scalerl"}  # our receiver
    assert cmd[cmd.index("--worker-extension-cls") + 1] == WORKER_EXTENSION and "--enable-scale-out" in cmd
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2" and "--enforce-eager" in cmd
    env = config.environment({})
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    # the key guards every route (our middleware) and is not on the command line
    assert env["VLLM_API_KEY"] == "k" and "k" not in cmd and "--api-key" not in cmd
    assert cmd[cmd.index("--middleware") + 1] == "megatron_scalerl.inference.server_auth.RequireApiKey"
    assert (find_tcmalloc() or "none") in env.get("LD_PRELOAD", "none")
    plain = VLLMServerConfig(model="/m", port=1, weight_transfer=False)
    assert "--weight-transfer-config" not in plain.command() and "VLLM_SERVER_DEV_MODE" not in plain.environment({})


def test_server_command_passes_llama4_temperature_tuning(tmp_path):
    """vLLM turns Llama-4's attention temperature tuning on only above 32k tokens unless told: pass the checkpoint's."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama4_text", "attn_temperature_tuning": True}))
    cmd = VLLMServerConfig(model=str(tmp_path), port=1).command()
    assert json.loads(cmd[cmd.index("--override-generation-config") + 1]) == {"attn_temperature_tuning": True}
    plain = VLLMServerConfig(model="/no/such/dir", port=1).command()
    assert "--override-generation-config" not in plain
    assert plain[plain.index("--generation-config") + 1] == "vllm"  # a checkpoint's sampling defaults never apply


@pytest.mark.parametrize("chunk, block", [(32, "32"), (8192, None), (None, None)])
def test_server_block_size_divides_the_attention_chunk(tmp_path, chunk, block):
    """vLLM refuses requests when the Llama-4 attention chunk is not a multiple of the KV block (128 on CPUs)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama4_text", "attention_chunk_size": chunk}))
    cmd = VLLMServerConfig(model=str(tmp_path), port=1).command()
    assert (cmd[cmd.index("--block-size") + 1] if "--block-size" in cmd else None) == block
    assert VLLMServerConfig(model=str(tmp_path), port=1, extra_args=("--block-size", "16")).command().count(
        "--block-size") == 1  # the caller's own choice wins


def test_worker_extension_registers_our_receiver_and_fits_vllm_worker():
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.v1.worker.cpu_worker import CPUWorker

    from megatron_scalerl.inference import worker_extension
    from megatron_scalerl.weight_sync.receiver import ScaleRLWeightTransferEngine

    for name in ("scalerl", "gloo"):  # "gloo": its name before
        assert WeightTransferEngineFactory._registry[name]() is ScaleRLWeightTransferEngine
    # vLLM's start-up check: no attribute of the extension (its weight-sync methods, inherited, included) may be the
    # worker's own
    methods = [name for name in dir(worker_extension.ScaleRLWorkerExtension) if not name.startswith("__")]
    assert {"scalerl_stage_weights", "scalerl_fp32_lm_head", "scalerl_capture_routes"} <= set(methods)
    assert all(not hasattr(CPUWorker, name) for name in methods)
