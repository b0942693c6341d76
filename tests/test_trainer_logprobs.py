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
@pytest.mark.multiprocess
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


def _padded(w, padded_vocab, seed=1):
    """w [vocab, h] with rows appended up to padded_vocab: large random values, so unmasked padding would show."""
    g = torch.Generator().manual_seed(seed)
    return torch.cat([w, 10 * torch.randn(padded_vocab - w.shape[0], w.shape[1], generator=g)])


@pytest.mark.parametrize("chunk", [4, 1000])
def test_vocab_padding_is_masked_exactly(chunk):
    """263 tokens padded to 384 rows (models.mapping.padded_vocab_size): bit-for-bit the unpadded computation."""
    h, w, t, up = _inputs(vocab=263)
    t[:3] = torch.tensor([262, 0, 261])  # the last real rows
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = token_logprobs(h1, w1, t, chunk_tokens=chunk)
    (lp * up).sum().backward()
    h2, w2 = h.clone().requires_grad_(), _padded(w, 384).requires_grad_()
    lp_pad, ent_pad = token_logprobs(h2, w2, t, chunk_tokens=chunk, vocab_size=263)
    (lp_pad * up).sum().backward()
    assert torch.equal(lp_pad, lp) and torch.equal(ent_pad, ent)
    assert torch.equal(h2.grad, h1.grad) and torch.equal(w2.grad[:263], w1.grad)
    assert not w2.grad[263:].any()
    lp_ref, ent_ref = naive_token_logprobs(h, w, t)
    torch.testing.assert_close(lp_pad, lp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_pad, ent_ref, rtol=1e-5, atol=1e-5)


# (vocab, padded vocab, sequence parallel): rank 1's slice is part padding / all padding
PADDED_TP_CASES = [(263, 384, False), (100, 256, True)]


def _padded_tp_worker(rank, world):
    out = []
    for vocab, padded_vocab, sequence_parallel in PADDED_TP_CASES:
        h, w, t, up = _inputs(tokens=16, vocab=vocab)
        t[:2] = vocab - 1
        h3, t2 = h.view(8, 2, -1), t.view(8, 2)
        v_local = padded_vocab // world
        w_local = _padded(w, padded_vocab)[rank * v_local:(rank + 1) * v_local].clone().requires_grad_()
        s_local = h3.shape[0] // world
        h_in = (h3[rank * s_local:(rank + 1) * s_local] if sequence_parallel else h3).clone().requires_grad_()
        lp, ent = token_logprobs(h_in, w_local, t2, tp_group=dist.group.WORLD, sequence_parallel=sequence_parallel,
                                 chunk_tokens=3, vocab_size=vocab)
        (lp * up.view(8, 2)).sum().backward()
        out.append((lp.detach(), ent, h_in.grad, w_local.grad))
    return out


@pytest.mark.multiprocess
def test_vocab_padding_two_ranks_equal_naive_unpadded():
    results = run_local_workers(_padded_tp_worker, 2, 2, timeout_s=120)
    for case, (vocab, padded_vocab, sequence_parallel) in enumerate(PADDED_TP_CASES):
        h, w, t, up = _inputs(tokens=16, vocab=vocab)
        t[:2] = vocab - 1
        h_ref, w_ref = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp_ref, ent_ref = naive_token_logprobs(h_ref, w_ref, t)
        (lp_ref * up).sum().backward()
        grad_w_ref = torch.cat([w_ref.grad, torch.zeros(padded_vocab - vocab, w.shape[1])])  # padding: no gradient
        v_local = padded_vocab // 2
        for rank in range(2):
            lp, ent, grad_h, grad_w = results[rank][case]
            torch.testing.assert_close(lp.view(-1), lp_ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ent.view(-1), ent_ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(grad_w, grad_w_ref[rank * v_local:(rank + 1) * v_local], rtol=1e-5, atol=1e-5)
            assert not grad_w[max(vocab - rank * v_local, 0):].any()
            expect_h = h_ref.grad.view(8, 2, -1)
            expect_h = expect_h[rank * 4:(rank + 1) * 4] if sequence_parallel else expect_h
            torch.testing.assert_close(grad_h, expect_h, rtol=1e-5, atol=1e-5)
