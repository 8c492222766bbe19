"""The sampling kernel (sample_survivors: top-k's survivors, the warpers and the draw) and next_token's id map against
their pure-torch references (GPU only), and the reference against transformers' own warpers (CPU and GPU).

sample_survivors is the reference's arithmetic on the same float32 values: its softmaxes follow torch's warp softmax,
so probabilities agree to a float's rounding (PROB_RTOL); its top-p cumulative sum adds in another order than
torch's scan, so the kept tokens are compared on scores whose cumulative probabilities keep clear of 1 - top_p by
far more than that rounding (random normal logits times 3: the nearest lies about 1e-4 away). Which of several
scores equal to the m-th largest survive is each implementation's own choice, so the scores here keep the m largest
clear of the rest (`logits`).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from patcher.ops import reference, sample_survivors_workspace
from patcher.ops.sampling import SURVIVORS_MAX, SURVIVORS_MAX_VOCAB

pytestmark = pytest.mark.usefixtures("kernels_built")


PROB_RTOL = 4 * 2.0**-24  # a few float32 roundings of a probability (the exp, the sum's order, the division)

# (temperature, top_k, top_p, min_p): HF's defaults, the Qwen2 and Llama instruct configurations, min-p, off
WARPERS = [(1.0, 50, 1.0, 0.0), (0.7, 20, 0.8, 0.0), (0.6, 50, 0.9, 0.0), (1.3, 40, 1.0, 0.05), (0.9, 7, 0.95, 0.1)]


def logits(batch, vocab, m, device, dtype=torch.float32, seed=0, ties=False):
    """Random logits [batch, vocab] (normal times 3) whose m largest of each row (at random ids) all lie at least 1
    above the rest, so that every implementation selects the same m. `ties`: few distinct values instead, the m
    largest among 10 .. 12 and the rest among -3 .. 2."""
    g = torch.Generator(device=device).manual_seed(seed)
    if ties:
        x = torch.randint(-3, 3, (batch, vocab), generator=g, device=device).float()
        top = torch.randint(10, 13, (batch, m), generator=g, device=device).float()
    else:
        x = torch.randn(batch, vocab, generator=g, device=device).mul(3)
        top = x.amax(-1, keepdim=True) + 1 + torch.randn(batch, m, generator=g, device=device).abs().mul(3)
    ids = torch.rand(batch, vocab, generator=g, device=device).argsort(-1)[:, :m]
    return x.scatter(1, ids, top).to(dtype)


def outputs(batch, m, device, seed=0):
    """Exp(1) noise [batch, m] and the three outputs to fill."""
    noise = torch.empty(batch, m, device=device).exponential_(1.0, generator=torch.Generator(device).manual_seed(seed))
    return noise, (torch.empty(batch, m, device=device), torch.empty(batch, m, dtype=torch.long, device=device),
                   torch.empty(batch, m, device=device))  # fmt: skip


def run(ops, scores, noise, warpers, m):
    """ops.sample_survivors on fresh outputs and workspace: (warped, sorted_ids, draw)."""
    out = outputs(scores.shape[0], m, scores.device)[1]
    workspace = sample_survivors_workspace(scores.shape[0], scores.shape[1], m, scores.device)
    ops.sample_survivors(scores, noise, *warpers, *out, workspace)
    return out


def hf_warped(logits, temperature, top_k, top_p, min_p):
    """transformers' warpers in generate's order on the whole vocabulary."""
    scores = logits.clone()
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p > 0:
        scores = MinPLogitsWarper(min_p)(None, scores)
    return scores


@pytest.mark.parametrize("warpers", WARPERS, ids=lambda w: "t{}-k{}-p{}-minp{}".format(*w))
def test_reference_equals_transformers_warpers(warpers):
    """CPU: the reference on top-k's 2 x top_k survivors gives transformers' warped scores over the vocabulary."""
    top_k = warpers[1]
    scores = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)).mul(3)
    noise, _ = outputs(4, 2 * top_k, "cpu")
    warped, sorted_ids, draw = run(reference, scores, noise, warpers, 2 * top_k)
    full = torch.full_like(scores, -math.inf).scatter_(1, sorted_ids, warped)
    assert torch.equal(full, hf_warped(scores, *warpers))
    assert bool((sorted_ids.diff(dim=-1) > 0).all())
    assert torch.equal(draw, warped.softmax(-1) / noise)


def assert_same(got, want, what=""):
    """Sorted ids and warped scores exactly, the draw within PROB_RTOL."""
    assert torch.equal(got[1], want[1]), f"{what}: other survivors"
    assert torch.equal(got[0], want[0]), f"{what}: other warped scores"
    assert torch.allclose(got[2], want[2], rtol=PROB_RTOL, atol=0), f"{what}: other draws"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("warpers", WARPERS, ids=lambda w: "t{}-k{}-p{}-minp{}".format(*w))
def test_sample_survivors_matches_reference(warpers, batch, dtype):
    """GPU: the scores in the model's dtype, at vocabularies of one part (1000), just over one (4097), SmolLM2's,
    Qwen2's and the largest the kernel takes."""
    from patcher.ops import KERNELS

    m = 2 * warpers[1]
    for vocab in (1000, 4097, 49_152, 151_936, SURVIVORS_MAX_VOCAB):
        scores = logits(batch, vocab, m, "cuda", dtype, seed=vocab)
        noise, _ = outputs(batch, m, "cuda", seed=vocab)
        got, want = run(KERNELS, scores, noise, warpers, m), run(reference, scores, noise, warpers, m)
        assert_same(got, want, f"vocab {vocab}")


@pytest.mark.gpu
def test_sample_survivors_strided_rows():
    """GPU: rows that are the start of longer rows (the step's logits of a wider buffer), noise likewise."""
    from patcher.ops import KERNELS

    m, warpers = 40, (0.7, 20, 0.8, 0.0)
    wide = logits(5, 50_000 + 24, m, "cuda", torch.float16)
    scores = wide[:, 3:50_003]
    wide_noise = outputs(5, m + 8, "cuda")[0]
    noise = wide_noise[:, :m]
    assert scores.stride(0) != scores.shape[1] and noise.stride(0) != m
    assert_same(run(KERNELS, scores, noise, warpers, m), run(reference, scores.contiguous(), noise.contiguous(),
                                                                warpers, m))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 3, 33, 100, 257, SURVIVORS_MAX])
def test_sample_survivors_odd_sizes_and_ties(m):
    """GPU: survivor counts from 1 to the kernel's limit, with many equal scores among them (top-k's k-th tied,
    top-p's stable order: equal scores in id order, as the reference's stable sort)."""
    from patcher.ops import KERNELS

    scores = logits(5, 4096 + 3 * m, m, "cuda", ties=True, seed=m)
    noise, _ = outputs(5, m, "cuda", seed=m)
    for warpers in [(1.0, max(m // 2, 1), 0.7, 0.0), (0.8, m, 0.5, 0.2)]:
        assert_same(run(KERNELS, scores, noise, warpers, m), run(reference, scores, noise, warpers, m), str(warpers))


@pytest.mark.gpu
def test_sample_survivors_ties_at_the_mth_are_the_same_every_launch():
    """GPU: where more scores than m equal the m-th largest, the kernel keeps m of them (distinct ids, each at that
    score), the same ones every launch, and leaves the workspace's tickets zero for the next."""
    from patcher.ops import KERNELS

    m, warpers = 40, (1.0, 20, 1.0, 0.0)
    scores = torch.zeros(3, 30_000, device="cuda")
    scores[:, 1000:1010] = 1.0  # ten above, then 29,990 ties for the other 30
    noise, _ = outputs(3, m, "cuda")
    workspace = sample_survivors_workspace(3, 30_000, m, "cuda")
    results = []
    for _ in range(3):
        out = outputs(3, m, "cuda")[1]
        KERNELS.sample_survivors(scores, noise, *warpers, *out, workspace)
        results.append(out)
        assert int(workspace[:3].count_nonzero()) == 0
    for out in results[1:]:
        assert torch.equal(out[1], results[0][1]) and torch.equal(out[0], results[0][0])
    ids = results[0][1]
    assert bool((ids.diff(dim=-1) > 0).all())
    assert int((scores.gather(1, ids) == 1.0).sum()) == 3 * 10


@pytest.mark.gpu
def test_sample_survivors_bad_inputs():
    from patcher.ops import KERNELS

    scores = logits(2, 3000, 40, "cuda")
    noise, out = outputs(2, 40, "cuda")
    workspace = sample_survivors_workspace(2, 3000, 40, "cuda")
    warpers = (1.0, 20, 1.0, 0.0)
    big_noise, big = outputs(2, SURVIVORS_MAX + 1, "cuda")
    with pytest.raises(RuntimeError, match="1 <= m <= min"):
        KERNELS.sample_survivors(torch.randn(2, 5000, device="cuda"), big_noise, *warpers, *big, workspace)
    with pytest.raises(RuntimeError, match="temperature must be positive"):
        KERNELS.sample_survivors(scores, noise, 0.0, 20, 1.0, 0.0, *out, workspace)
    with pytest.raises(RuntimeError, match="vocab <= "):
        KERNELS.sample_survivors(torch.randn(2, SURVIVORS_MAX_VOCAB + 1, device="cuda"), noise, *warpers, *out,
                                 workspace)  # fmt: skip
    with pytest.raises(RuntimeError, match="warped must be a contiguous"):
        KERNELS.sample_survivors(scores, noise, *warpers, out[0].t().contiguous().t(), *out[1:], workspace)
    with pytest.raises(RuntimeError, match="workspace must be"):
        KERNELS.sample_survivors(scores, noise, *warpers, *out, workspace[:10])


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 5, 64])
def test_next_token_maps_the_argmax_through_ids(batch):
    """GPU: with ids, next_token writes ids[b, argmax(scores[b])] (the embedding of that id), as the reference."""
    from patcher.ops import KERNELS, next_token_workspace

    g = torch.Generator(device="cuda").manual_seed(batch)
    scores = torch.rand(batch, 40, generator=g, device="cuda")
    ids = torch.randint(0, 50_000, (batch, 40), generator=g, device="cuda")
    embed = torch.randn(50_000, 64, generator=g, device="cuda").half()

    def run(ops, device):
        state = [torch.zeros(batch, 12, dtype=torch.long), torch.tensor([3]), torch.zeros(batch, dtype=torch.bool),
                 torch.tensor([-1]), torch.tensor(0), embed.to(device), torch.zeros(batch, 64).half(),
                 next_token_workspace(batch, device)]  # fmt: skip
        state = [t.to(device) for t in state]
        ops.next_token(scores.to(device), *state[:6], state[6], state[7], ids.to(device))
        return state[0].cpu(), state[6].cpu()

    tokens, x = run(KERNELS, "cuda")
    want_tokens, want_x = run(reference, "cpu")
    assert torch.equal(tokens, want_tokens) and torch.equal(x, want_x)
    assert torch.equal(tokens[:, 4], ids.gather(1, scores.argmax(-1, keepdim=True)).squeeze(1).cpu())
