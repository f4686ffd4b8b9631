"""Random routings for the EP tests, and a plain-Python layout oracle.

Every generator takes an explicit ``torch.Generator`` so that each rank of a multi-process test can
rebuild every rank's inputs from one shared seed.
"""

from __future__ import annotations

import torch

KINDS = ("balanced", "skewed", "minus_one", "silent", "duplicates")


def route(
    kind: str, num_tokens: int, num_topk: int, num_experts: int, num_ranks: int, g: torch.Generator
) -> torch.Tensor:
    """``[num_tokens, num_topk]`` int64 expert indices of the given kind (-1 = no expert).

    balanced: distinct experts uniformly at random; skewed: distinct experts, ~85% of the probability
    mass on rank 0's experts; minus_one: balanced with ~30% of slots and every 5th token fully -1;
    silent: all -1; duplicates: experts drawn with replacement (slots may repeat an expert).
    """
    t, k, e = num_tokens, num_topk, num_experts
    if t == 0:
        return torch.empty(0, k, dtype=torch.int64)
    if kind == "silent":
        return torch.full((t, k), -1, dtype=torch.int64)
    if kind == "duplicates":
        return torch.randint(0, e, (t, k), generator=g, dtype=torch.int64)
    if kind == "skewed":
        local = e // num_ranks
        probs = torch.full((e,), 0.15 / max(e - local, 1), dtype=torch.float64)
        probs[:local] = 0.85 / local  # every expert keeps a nonzero weight, so k distinct slots exist
        return (
            torch.multinomial(probs.expand(t, e), k, replacement=False, generator=g)
            .to(torch.int64)
            .contiguous()
        )
    idx = torch.rand(t, e, generator=g).argsort(dim=1)[:, :k].to(torch.int64).contiguous()
    if kind == "balanced":
        return idx
    if kind == "minus_one":
        drop = torch.rand(t, k, generator=g) < 0.3
        idx = torch.where(drop, -1, idx)
        idx[::5] = -1
        return idx
    raise ValueError(f"unknown routing kind {kind!r}")


def naive_layout(
    topk_idx: torch.Tensor, num_experts: int, num_ranks: int
) -> tuple[list[int], list[int], list[list[bool]]]:
    """(tokens per rank, entries per expert, token-in-rank mask) by explicit loops; out-of-range ignored."""
    local = num_experts // num_ranks
    per_expert = [0] * num_experts
    mask = []
    for row in topk_idx.tolist():
        m = [False] * num_ranks
        for e in row:
            if 0 <= e < num_experts:
                per_expert[e] += 1
                m[e // local] = True
        mask.append(m)
    per_rank = [sum(m[r] for m in mask) for r in range(num_ranks)]
    return per_rank, per_expert, mask


def assert_layout_equals_naive(
    layout, topk_idx: torch.Tensor, num_experts: int, num_ranks: int, what: str = ""
) -> None:
    per_rank, per_expert, mask = naive_layout(topk_idx.cpu(), num_experts, num_ranks)
    assert layout.num_tokens_per_rank.dtype == torch.int32, what
    assert layout.num_tokens_per_expert.dtype == torch.int32, what
    assert layout.is_token_in_rank.dtype == torch.bool, what
    assert layout.num_tokens_per_rank.cpu().tolist() == per_rank, f"{what}: num_tokens_per_rank"
    assert layout.num_tokens_per_expert.cpu().tolist() == per_expert, f"{what}: num_tokens_per_expert"
    got = layout.is_token_in_rank.cpu()
    assert list(got.shape) == [topk_idx.shape[0], num_ranks], (
        f"{what}: is_token_in_rank shape {list(got.shape)}"
    )
    assert got.tolist() == mask, f"{what}: is_token_in_rank"
