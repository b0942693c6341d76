"""The CPU compatibility layer for megatron-core 0.16.1: one test per workaround in platform/cpu_compat.py.

Each test shows both that megatron-core still needs the workaround (the unpatched path fails on CPU) and that the
patched path works, so a megatron-core upgrade that changes either side fails here. The layer patches process-wide
state, so everything that installs it runs in spawned gloo workers (two ranks, one spawn for the whole module).
"""

from __future__ import annotations

import time
import types

import pytest
import torch

from megatron_scalerl.platform import run_local_workers
from megatron_scalerl.recipe import ParallelismConfig, load_recipe


def _tiny_moe_model_cfg():
    return load_recipe("scalerl", model_preset="tiny_moe").model.model_copy(
        update=dict(num_layers=1, hidden_size=64, ffn_hidden_size=64, moe_ffn_hidden_size=32, vocab_size=128)
    )


def _moe_forward_backward(tp: int, ep: int) -> float:
    """A one-layer Llama-4 MoE through forward and backward at TP x EP (expert TP = TP); this rank's loss."""
    from megatron_scalerl.models import build_model
    from megatron_scalerl.platform import initialize_model_parallel

    initialize_model_parallel(tp, 1, ep, tp, seed=3)
    try:
        parallel = ParallelismConfig(tp=tp, ep=ep, expert_tp=tp, sequence_parallel=tp > 1)
        model = build_model(_tiny_moe_model_cfg(), parallel, fp32_lm_head=True)
        ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(0))
        logits = model(ids, torch.arange(40).expand(2, 40), None)
        loss = logits.float().square().mean()
        loss.backward()
        return loss.item()
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()


def _checks(rank: int) -> dict:
    """Every workaround, exercised on an initialised 2-rank gloo group with the layer installed."""
    import torch.distributed as dist
    from megatron.core import jit, parallel_state
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.torch_norm import L2Norm

    from megatron_scalerl.platform import cpu_compat, initialize_model_parallel

    out: dict = {"rank": rank, "world_size": dist.get_world_size()}
    # 1. RNG tracker: megatron's own fails on CPU; ours forks per-TP-rank streams and restores the default stream.
    initialize_model_parallel(tp=2, seed=11)
    tracker = get_cuda_rng_tracker()
    out["tracker_class"] = type(tracker).__name__
    try:
        type(tracker).__mro__[1]().add("probe", 1)
        out["stock_tracker_fails"] = False
    except (AssertionError, RuntimeError):
        out["stock_tracker_fails"] = True
    torch.manual_seed(5)
    expected_default = torch.rand(3)
    torch.manual_seed(5)
    with tracker.fork():
        forked = torch.rand(3)
    out["default_stream_restored"] = torch.equal(torch.rand(3), expected_default)
    gathered = [torch.empty(3) for _ in range(2)]
    dist.all_gather(gathered, forked)
    out["tp_streams_differ"] = not torch.equal(gathered[0], gathered[1])
    # ... and a checkpointed (recomputed) function draws the same random numbers in its recomputation.
    from megatron.core.tensor_parallel import checkpoint

    def noisy(x):
        with tracker.fork():
            return torch.nn.functional.dropout(x, 0.5) * torch.rand_like(x)

    x, states = torch.randn(64, requires_grad=True), tracker.get_states()
    torch.manual_seed(9)
    checkpoint(noisy, False, x).sum().backward()
    recomputed_grad, x.grad = x.grad, None
    torch.manual_seed(9)
    tracker.set_states(states)
    noisy(x).sum().backward()
    out["recompute_same_randomness"] = torch.equal(recomputed_grad, x.grad)

    # 2. current device.
    out["current_device"] = torch.cuda.current_device()
    buffer = parallel_state.get_global_memory_buffer()
    out["memory_buffer_device"] = buffer.get_tensor((2, 3), torch.float32, "probe").device.type
    parallel_state.destroy_model_parallel()

    # 3. cuda -> cpu mode: factories, .cuda(), .to("cuda"), type() names; megatron's grad norm (device="cuda").
    out["factory_device"] = torch.zeros(2, device="cuda").device.type
    out["dot_cuda_device"] = torch.ones(1).cuda().device.type
    out["to_cuda_device"] = torch.ones(1).to("cuda").device.type
    out["type_name"] = torch.ones(1).type()
    grads = [torch.full((4,), float(rank + 1))]
    out["grad_norm"] = float(get_grad_norm_fp32(grads, grad_stats_parallel_group=dist.group.WORLD))

    # 4. streams.
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        stream.wait_stream(torch.cuda.current_stream())
    stream.record_event().synchronize()
    torch.cuda.synchronize()
    out["streams"] = True

    # 5. te_general_gemm.
    out["te_general_gemm"] = moe_utils.te_general_gemm

    # 6 + 7. MoE alltoall dispatch with EP2 (numpy split sizes), and with expert TP2 (uneven gathers).
    out["moe_ep2_loss"] = _moe_forward_backward(tp=1, ep=2)
    out["moe_etp2_loss"] = _moe_forward_backward(tp=2, ep=1)
    rows = rank + 1  # rank 0 has 1 row, rank 1 has 2 rows
    local = torch.full((rows, 2), float(rank))
    try:
        dist.all_gather([torch.empty(1, 2), torch.empty(2, 2)], local)
        out["gloo_uneven_gather_fails"] = False
    except RuntimeError:
        out["gloo_uneven_gather_fails"] = True
    out["uneven_gather"] = cpu_compat.gather_uneven_along_first_dim(local, dist.group.WORLD, [1, 2]).tolist()
    full = torch.arange(6.0).reshape(3, 2) * (rank + 1)
    out["uneven_reduce_scatter"] = cpu_compat.reduce_scatter_uneven_along_first_dim(
        full, dist.group.WORLD, [1, 2]
    ).tolist()

    # 8. jit fuser off: an L2Norm (a torch.compile'd kernel in megatron) runs eagerly, no inductor compile.
    out["jit_fuser_is_noop"] = jit.jit_fuser is jit.noop_decorator
    start = time.monotonic()
    L2Norm(8)(torch.randn(4, 8))
    out["l2norm_first_call_s"] = time.monotonic() - start
    return out


@pytest.fixture(scope="module")
def checks() -> list[dict]:
    return run_local_workers(_checks, 2, timeout_s=300)


def test_workers_report_in_rank_order(checks):
    assert [(result["rank"], result["world_size"]) for result in checks] == [(0, 2), (1, 2)]


def test_rng_tracker_is_cpu_and_forks_per_tp_rank(checks):
    for result in checks:
        assert result["tracker_class"] == "CPURNGStatesTracker"
        assert result["stock_tracker_fails"], "megatron's CUDA tracker now works on CPU: the workaround can go"
        assert result["default_stream_restored"]
        assert result["recompute_same_randomness"]
    assert checks[0]["tp_streams_differ"]


def test_current_device_is_cpu(checks):
    assert checks[0]["current_device"] == "cpu"
    assert checks[0]["memory_buffer_device"] == "cpu"


def test_cuda_tensors_land_on_cpu_and_report_cuda_types(checks):
    result = checks[0]
    assert result["factory_device"] == result["dot_cuda_device"] == result["to_cuda_device"] == "cpu"
    assert result["type_name"] == "torch.cuda.FloatTensor"
    expected = (4 * 1.0**2 + 4 * 2.0**2) ** 0.5  # both ranks' grads in one norm
    assert result["grad_norm"] == pytest.approx(expected)


def test_streams_are_no_ops(checks):
    assert checks[0]["streams"]


def test_te_general_gemm_defined_as_none(checks):
    assert checks[0]["te_general_gemm"] is None


def test_moe_alltoall_dispatch_runs_with_ep2_and_expert_tp2(checks):
    """Runs at all (numbers at these layouts are checked against HF in test_models_parity)."""
    for result in checks:
        for key in ("moe_ep2_loss", "moe_etp2_loss"):
            assert 0 < result[key] < float("inf")


def test_uneven_collectives(checks):
    assert checks[0]["gloo_uneven_gather_fails"], "gloo gathers uneven sizes now: the workaround can go"
    for result in checks:
        assert result["uneven_gather"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    summed = (torch.arange(6.0).reshape(3, 2) * 3).tolist()  # rank factors 1 + 2
    assert checks[0]["uneven_reduce_scatter"] == summed[:1]
    assert checks[1]["uneven_reduce_scatter"] == summed[1:]


def test_jit_fuser_disabled(checks):
    assert checks[0]["jit_fuser_is_noop"]
    assert checks[0]["l2norm_first_call_s"] < 2.0


def test_version_pin_is_checked(monkeypatch):
    import megatron.core

    from megatron_scalerl.platform import cpu_compat

    cpu_compat.check_megatron_version()
    monkeypatch.setattr(megatron.core, "__version__", "0.17.0")
    with pytest.raises(cpu_compat.MegatronVersionError, match="0.17.0 is installed"):
        cpu_compat.check_megatron_version()


def test_patch_targets_are_checked():
    from megatron_scalerl.platform import cpu_compat

    module = types.ModuleType("megatron.core.fake")
    with pytest.raises(cpu_compat.MegatronVersionError, match="megatron.core.fake.gone is gone"):
        cpu_compat.require_megatron_attr(module, "gone")


def test_sequence_parallel_norm_needs_our_torch_norm():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_scalerl.platform.layer_backend import TorchNorm

    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
        tensor_model_parallel_size=2, sequence_parallel=True, use_cpu_initialization=True,
    )
    with pytest.raises(AssertionError, match="sequence parallel"):
        WrappedTorchNorm(config, 8)
    norm = TorchNorm(config, 8, eps=1e-5)
    assert isinstance(norm, torch.nn.RMSNorm)
    assert all(param.sequence_parallel for param in norm.parameters())
