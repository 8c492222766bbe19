"""The sampling warpers' kernel (warp_survivors) and next_token's id map against their pure-torch references (GPU
only), and the reference against transformers' own warpers (CPU and GPU).

warp_survivors is the reference's arithmetic on the same float32 values: its softmaxes follow torch's warp softmax,
so probabilities agree to a float's rounding (PROB_RTOL); its top-p cumulative sum adds in another order than
torch's scan, so the kept tokens are compared on scores whose cumulative probabilities keep clear of 1 - top_p by
far more than that rounding (random normal logits times 3: the nearest lies about 1e-4 away).
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

from patcher.ops import reference
from patcher.ops.sampling import WARP_SURVIVORS_MAX

PROB_RTOL = 4 * 2.0**-24  # a few float32 roundings of a probability (the exp, the sum's order, the division)

# (temperature, top_k, top_p, min_p): HF's defaults, the Qwen2 and Llama instruct configurations, min-p, off
WARPERS = [(1.0, 50, 1.0, 0.0), (0.7, 20, 0.8, 0.0), (0.6, 50, 0.9, 0.0), (1.3, 40, 1.0, 0.05), (0.9, 7, 0.95, 0.1)]


def survivors(batch, vocab, m, device, layout="contiguous", seed=0):
    """torch.topk's m largest of random logits (normal, times 3), the noise, and the outputs to fill."""
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=g, device=device).mul(3)
    values, ids = torch.topk(logits, m, dim=-1)
    noise = torch.empty(batch, m, device=device).exponential_(1.0, generator=g)
    if layout == "row-strided":  # each row the start of a longer row
        values = torch.cat([values, values[:, :5]], 1)[:, :m]
        ids = torch.cat([ids, ids[:, :5]], 1)[:, :m]
        noise = torch.cat([noise, noise[:, :5]], 1)[:, :m]
    outputs = (torch.empty(batch, m, device=device), torch.empty(batch, m, dtype=torch.long, device=device),
               torch.empty(batch, m, device=device))  # fmt: skip
    return logits, (values, ids, noise), outputs


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
    temperature, top_k, top_p, min_p = warpers
    logits, (values, ids, noise), (warped, sorted_ids, draw) = survivors(4, 1000, 2 * top_k, "cpu")
    reference.warp_survivors(values, ids, noise, temperature, top_k, top_p, min_p, warped, sorted_ids, draw)
    full = torch.full_like(logits, -math.inf).scatter_(1, sorted_ids, warped)
    assert torch.equal(full, hf_warped(logits, temperature, top_k, top_p, min_p))
    assert bool((sorted_ids.diff(dim=-1) > 0).all())
    assert torch.equal(draw, warped.softmax(-1) / noise)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "row-strided"])
@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("warpers", WARPERS, ids=lambda w: "t{}-k{}-p{}-minp{}".format(*w))
def test_warp_survivors_matches_reference(warpers, batch, layout):
    """GPU: sorted ids exactly, the same tokens kept with the same scores, the draw within PROB_RTOL."""
    from patcher.ops import KERNELS

    temperature, top_k, top_p, min_p = warpers
    _, inputs, got = survivors(batch, 50_000, 2 * top_k, "cuda", layout)
    _, _, want = survivors(batch, 50_000, 2 * top_k, "cuda", layout)
    KERNELS.warp_survivors(*inputs, temperature, top_k, top_p, min_p, *got)
    reference.warp_survivors(*inputs, temperature, top_k, top_p, min_p, *want)
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0], want[0])
    assert torch.allclose(got[2], want[2], rtol=PROB_RTOL, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 3, 33, 100, 257, WARP_SURVIVORS_MAX])
def test_warp_survivors_odd_sizes_and_ties(m):
    """GPU: survivor counts from 1 to the kernel's limit, with many equal scores (top-p's stable order: equal scores
    in id order, as the reference's stable sort)."""
    from patcher.ops import KERNELS

    g = torch.Generator(device="cuda").manual_seed(m)
    logits = torch.randint(-3, 3, (5, 4096), generator=g, device="cuda").float()  # few distinct values: ties
    values, ids = torch.topk(logits, m, dim=-1)
    noise = torch.empty_like(values).exponential_(1.0, generator=g)
    for temperature, top_k, top_p, min_p in [(1.0, max(m // 2, 1), 0.7, 0.0), (0.8, m, 0.5, 0.2)]:
        got = (torch.empty_like(values), torch.empty_like(ids), torch.empty_like(values))
        want = (torch.empty_like(values), torch.empty_like(ids), torch.empty_like(values))
        KERNELS.warp_survivors(values, ids, noise, temperature, top_k, top_p, min_p, *got)
        reference.warp_survivors(values, ids, noise, temperature, top_k, top_p, min_p, *want)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
        assert torch.allclose(got[2], want[2], rtol=PROB_RTOL, atol=0)


@pytest.mark.gpu
def test_warp_survivors_bad_inputs():
    from patcher.ops import KERNELS

    _, (values, ids, noise), out = survivors(2, 3000, WARP_SURVIVORS_MAX + 1, "cuda")
    with pytest.raises(RuntimeError, match="1 <= m <= 1024"):
        KERNELS.warp_survivors(values, ids, noise, 1.0, 10, 1.0, 0.0, *out)
    _, (values, ids, noise), out = survivors(2, 3000, 40, "cuda")
    with pytest.raises(RuntimeError, match="temperature must be positive"):
        KERNELS.warp_survivors(values, ids, noise, 0.0, 10, 1.0, 0.0, *out)
    with pytest.raises(RuntimeError, match="values must be a"):
        KERNELS.warp_survivors(values.half(), ids, noise, 1.0, 10, 1.0, 0.0, *out)
    with pytest.raises(RuntimeError, match="warped must be a contiguous"):
        KERNELS.warp_survivors(values, ids, noise, 1.0, 10, 1.0, 0.0, out[0].t().contiguous().t(), *out[1:])


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
