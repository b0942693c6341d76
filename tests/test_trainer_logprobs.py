"""Chunked, vocab-parallel FP32 log-probs equal the naive full-logits computation (values and gradients)."""

import pytest
import torch
import torch.distributed as dist

from megatron_scalerl.platform import run_local_workers
from megatron_scalerl.trainer.logprobs import naive_token_logprobs, token_logprobs


def _inputs(tokens=37, hidden=24, vocab=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64).float() * 0.3
    t = torch.randint(0, vocab, (tokens,), generator=g)
    upstream = torch.randn(tokens, generator=g)
    return h, w, t, upstream


@pytest.mark.parametrize("chunk", [1, 5, 37, 1000])
def test_chunked_equals_naive_values_and_grads(chunk):
    h, w, t, up = _inputs()
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = token_logprobs(h1, w1, t, chunk_tokens=chunk)
    (lp * up).sum().backward()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp_ref, ent_ref = naive_token_logprobs(h2, w2, t)
    (lp_ref * up).sum().backward()
    torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-5, atol=1e-5)
    assert not ent.requires_grad and lp.dtype == torch.float32


def test_bf16_hidden_gives_fp32_logprobs_and_bf16_grad():
    h, w, t, up = _inputs(dtype=torch.bfloat16)
    h.requires_grad_()
    lp, _ = token_logprobs(h, w, t, chunk_tokens=8)
    lp_ref, _ = naive_token_logprobs(h.detach().float(), w, t)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-5)
    (lp * up).sum().backward()
    assert h.grad.dtype == torch.bfloat16


def test_megatron_layout_shapes_and_mismatch_error():
    h, w, t, _ = _inputs(tokens=12)
    lp, ent = token_logprobs(h.view(6, 2, -1), w, t.view(6, 2), chunk_tokens=4)
    assert lp.shape == (6, 2) and ent.shape == (6, 2)
    with pytest.raises(ValueError, match="disagree on tokens"):
        token_logprobs(h.view(6, 2, -1), w, t.view(2, 6))


def _tp_worker(rank, world, sequence_parallel):
    h, w, t, up = _inputs(tokens=16, vocab=64)
    h3, t2 = h.view(8, 2, -1), t.view(8, 2)
    v_local = w.shape[0] // world
    w_local = w[rank * v_local:(rank + 1) * v_local].clone().requires_grad_()
    s_local = h3.shape[0] // world
    h_in = (h3[rank * s_local:(rank + 1) * s_local] if sequence_parallel else h3).clone().requires_grad_()
    lp, ent = token_logprobs(h_in, w_local, t2, tp_group=dist.group.WORLD, sequence_parallel=sequence_parallel,
                             chunk_tokens=3)
    (lp * up.view(8, 2)).sum().backward()
    return lp.detach(), ent, h_in.grad, w_local.grad


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_two_ranks_equal_naive(sequence_parallel):
    results = dict(enumerate(run_local_workers(_tp_worker, 2, 2, sequence_parallel, timeout_s=120)))
    h, w, t, up = _inputs(tokens=16, vocab=64)
    h_ref, w_ref = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp_ref, ent_ref = naive_token_logprobs(h_ref, w_ref, t)
    (lp_ref * up).sum().backward()
    grad_h_ref = h_ref.grad.view(8, 2, -1)
    for rank in range(2):
        lp, ent, grad_h, grad_w = results[rank]
        torch.testing.assert_close(lp.view(-1), lp_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent.view(-1), ent_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad_w, w_ref.grad[rank * 32:(rank + 1) * 32], rtol=1e-5, atol=1e-5)
        expect_h = grad_h_ref[rank * 4:(rank + 1) * 4] if sequence_parallel else grad_h_ref
        torch.testing.assert_close(grad_h, expect_h, rtol=1e-5, atol=1e-5)


def test_bf16_head_rounds_the_logits():
    h, w, t, _ = _inputs(hidden=64)
    lp32, _ = token_logprobs(h, w, t)
    lp16, _ = token_logprobs(h, w, t, logits_dtype=torch.bfloat16)
    ref16, _ = naive_token_logprobs(h.bfloat16(), w.bfloat16(), t)
    assert lp16.dtype == torch.float32
    torch.testing.assert_close(lp16, ref16, rtol=1e-2, atol=1e-2)
    assert (lp16 - lp32).abs().max() > 1e-4  # the bf16 projection really is coarser
