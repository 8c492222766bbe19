"""repetition_penalty (the float32 cast and HF's repetition penalty on a decode step's logits, with the tokens so far
kept in a mask): the reference against transformers' RepetitionPenaltyLogitsProcessor step by step (CPU), and the
kernel against the reference (GPU), and the kernel against the processor on the GPU. Both divide by the penalty
exactly or through its reciprocal, as they are told (torch's CUDA kernels divide a tensor by a Python scalar the second
way, the reciprocal computed in double and rounded once), so the comparisons are exact."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from patcher.ops import reference
from patcher.ops.sampling import scalar_division_by_reciprocal

pytestmark = pytest.mark.usefixtures("kernels_built")


def history(batch: int, vocab: int, columns: int, seed: int) -> torch.Tensor:
    """Token ids [batch, columns] from few distinct ids (many repeats), some past the vocabulary (an embedding
    table larger than the lm_head)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, min(vocab, 60), (batch, columns), generator=g)
    tokens[:, 3::7] = vocab + torch.arange(batch)[:, None]  # ids no logit belongs to
    tokens[0, 5:9] = vocab - 1  # the last id, repeated
    return tokens


def run_steps(ops, logits_steps, tokens, prompt: int, penalty: float, device, reciprocal: bool):
    """The decode loop's use of the op: the mask of the prompt's tokens, then one step per logits row, each adding
    the current token (slot = prompt - 1, prompt, ...). Returns the scores of every step and the final mask."""
    batch, vocab = logits_steps[0].shape
    tokens = tokens.to(device)
    start = tokens[:, :prompt].clamp(max=vocab)
    seen = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=device).scatter(1, start, True)[:, :vocab]
    seen = seen.contiguous()
    outs = []
    for i, logits in enumerate(logits_steps):
        slot = torch.tensor([prompt - 1 + i], device=device)
        out = torch.empty(batch, vocab, dtype=torch.float32, device=device)
        ops.repetition_penalty(logits.to(device), seen, tokens, slot, penalty, reciprocal, out)
        outs.append(out.cpu())
    return outs, seen.cpu()


@pytest.mark.parametrize("penalty", [1.1, 1.05, 0.8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_reference_equals_transformers_step_by_step(dtype, penalty):
    """At every length, the op's scores equal HF's processor on the float32 logits and the sequence so far (ids past
    the vocabulary left out of HF's input, which cannot index them)."""
    batch, vocab, prompt, steps = 3, 300, 6, 12
    tokens = history(batch, vocab, prompt + steps, seed=1)
    g = torch.Generator().manual_seed(2)
    logits_steps = [torch.randn(batch, vocab, generator=g).mul(4).to(dtype) for _ in range(steps)]
    outs, _ = run_steps(reference, logits_steps, tokens, prompt, penalty, "cpu", scalar_division_by_reciprocal("cpu"))
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    for i, (logits, out) in enumerate(zip(logits_steps, outs, strict=True)):
        so_far = tokens[:, : prompt + i]
        so_far = torch.where(so_far < vocab, so_far, so_far[:, :1])  # past the vocabulary: a repeat of an id inside
        expected = hf(so_far, logits.float())
        assert torch.equal(out, expected), f"step {i}"
        assert (out != logits.float()).any()  # the penalty acted


def test_reciprocal_division_is_the_product_with_the_float_reciprocal():
    """The reference's two divisions: exact, and s * float32(1 / penalty) (the reciprocal in double, rounded once, as
    torch's CUDA kernels take it; for 1.1 not 1.0f / 1.1f), which differ in the last bit somewhere."""
    scores = torch.linspace(-50, 50, 20_001)
    seen = torch.ones(1, scores.numel(), dtype=torch.bool)
    tokens, slot = torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    exact, by_reciprocal = torch.empty(1, scores.numel()), torch.empty(1, scores.numel())
    reference.repetition_penalty(scores[None], seen, tokens, slot, 1.1, False, exact)
    reference.repetition_penalty(scores[None], seen, tokens, slot, 1.1, True, by_reciprocal)
    positive = scores > 0
    assert torch.equal(exact[0, positive], scores[positive] / 1.1)  # the CPU divides exactly
    inverse = torch.tensor(1.0 / 1.1, dtype=torch.float32)
    assert inverse != torch.tensor(1.0) / torch.tensor(1.1)
    assert torch.equal(by_reciprocal[0, positive], scores[positive] * inverse)
    assert (exact != by_reciprocal).any()


@pytest.mark.gpu
@pytest.mark.parametrize("reciprocal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch, vocab", [(1, 49_152), (5, 4_097), (64, 1_000), (2, 151_936)])
def test_kernel_equals_reference(batch, vocab, dtype, reciprocal):
    """GPU: every step's scores and the mask equal the reference's run on the GPU, exactly."""
    from patcher.ops import KERNELS

    prompt, steps = 9, 5
    tokens = history(batch, vocab, prompt + steps + 1, seed=batch)
    g = torch.Generator(device="cuda").manual_seed(vocab)
    logits_steps = [torch.randn(batch, vocab, generator=g, device="cuda").mul(4).to(dtype) for _ in range(steps)]
    got, got_seen = run_steps(KERNELS, logits_steps, tokens, prompt, 1.1, "cuda", reciprocal)
    want, want_seen = run_steps(reference, logits_steps, tokens, prompt, 1.1, "cuda", reciprocal)
    assert torch.equal(got_seen, want_seen)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"step {i}"


@pytest.mark.gpu
@pytest.mark.parametrize("penalty", [1.1, 1.05, 0.7])
def test_kernel_equals_transformers_on_the_gpu(penalty):
    """GPU: with the division torch uses on the device, every step's scores equal HF's processor run on the GPU."""
    from patcher.ops import KERNELS

    batch, vocab, prompt, steps = 4, 32_000, 7, 9
    tokens = history(batch, vocab, prompt + steps, seed=3)
    g = torch.Generator(device="cuda").manual_seed(4)
    logits_steps = [torch.randn(batch, vocab, generator=g, device="cuda").mul(4).half() for _ in range(steps)]
    reciprocal = scalar_division_by_reciprocal(torch.device("cuda"))
    outs, _ = run_steps(KERNELS, logits_steps, tokens, prompt, penalty, "cuda", reciprocal)
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    for i, (logits, out) in enumerate(zip(logits_steps, outs, strict=True)):
        so_far = tokens[:, : prompt + i]
        so_far = torch.where(so_far < vocab, so_far, so_far[:, :1]).cuda()
        assert torch.equal(out, hf(so_far, logits.float()).cpu()), f"step {i}"


@pytest.mark.gpu
def test_kernel_reads_strided_logits():
    """GPU: logits that are one position of a [B, T, V] output (the prefill's last logits) read as rows."""
    from patcher.ops import KERNELS

    batch, vocab = 3, 5_000
    full = torch.randn(batch, 4, vocab, device="cuda").half()
    logits = full[:, -1]
    tokens = history(batch, vocab, 12, seed=7)
    reciprocal = scalar_division_by_reciprocal(torch.device("cuda"))
    got, _ = run_steps(KERNELS, [logits], tokens, 10, 1.3, "cuda", reciprocal)
    want, _ = run_steps(reference, [logits.contiguous()], tokens, 10, 1.3, "cuda", reciprocal)
    assert torch.equal(got[0], want[0])


@pytest.mark.gpu
def test_kernel_bad_inputs():
    from patcher.ops import KERNELS

    logits = torch.randn(2, 100, device="cuda")
    seen = torch.zeros(2, 100, dtype=torch.bool, device="cuda")
    tokens = torch.zeros(2, 8, dtype=torch.long, device="cuda")
    slot = torch.zeros(1, dtype=torch.long, device="cuda")
    out = torch.empty(2, 100, device="cuda")
    with pytest.raises(RuntimeError, match="repetition_penalty must be positive"):
        KERNELS.repetition_penalty(logits, seen, tokens, slot, 0.0, True, out)
    with pytest.raises(RuntimeError, match="seen must be"):
        KERNELS.repetition_penalty(logits, seen.int(), tokens, slot, 1.1, True, out)
    with pytest.raises(RuntimeError, match="out must be a contiguous float32"):
        KERNELS.repetition_penalty(logits, seen, tokens, slot, 1.1, True, out.half())
    with pytest.raises(RuntimeError, match="tokens must be an int64"):
        KERNELS.repetition_penalty(logits, seen, tokens[:1], slot, 1.1, True, out)
    with pytest.raises(RuntimeError, match="logits must be"):
        KERNELS.repetition_penalty(logits.t(), seen, tokens, slot, 1.1, True, out)
