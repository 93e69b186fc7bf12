"""Verifying draft tokens against the target model's distributions (docs/speculative_decoding.md).

A request with k drafts d_0 .. d_{k-1} gets k + 1 target rows: row j is the target's distribution of the token
after the request's tokens plus d_0 .. d_{j-1}; row k (the bonus row) follows all k drafts. Both rules emit the
accepted prefix of the drafts and then exactly one token of the target's own: a + 1 tokens, 1 <= a + 1 <= k + 1.

- Greedy (``greedy_accept``): keep d_j while it equals the target's arg-max t_j; then emit t_j at the first
  mismatch, or the bonus t_k. The tokens are exactly greedy decoding's.
- Temperature > 0 with one-hot drafts (n-gram), as the engine runs it: t_j is the plain sampler's draw from p_j
  (the exponential race, with the noise of output position n + j), and ``greedy_accept`` keeps d_j while d_j == t_j.
  This is the lossless rule below for q one-hot, coupled to that draw: P(t_j = d_j) = p_j(d_j), and given
  t_j != d_j, t_j ~ p_j without d_j, renormalised = norm(max(0, p_j - onehot(d_j))). Each emitted token is the
  draw plain decoding makes at its position, so a seeded request gives the same tokens with and without drafts.
- Temperature > 0 in general (``rejection_sample``, Leviathan et al. 2023; needed for a draft model's q): accept
  d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection emit a sample of
  norm(max(0, p_j - q_j)) and stop; after k acceptances emit a sample of p_k. Every emitted token is distributed
  as the target's p at its position. With q_j one-hot at d_j (``draft_probs=None``): accept with probability
  p_j(d_j), otherwise sample p_j without d_j (the same law as the coupled form above, other draws).

Written in device-agnostic torch; the random draws come from the caller (``draw_uniforms_and_noise``) so that a
seeded request's draws at an output position depend on its seed and the position only.
"""

from __future__ import annotations

import torch


def greedy_accept(draft_token_ids: list[list[int]], target_token_ids: list[list[int]]) -> list[list[int]]:
    """Per request: the drafts up to the first one that differs from the target's arg-max, then the target's token
    there (or the bonus). ``target_token_ids[i]`` has ``len(draft_token_ids[i]) + 1`` entries.

    Example: drafts [5, 6, 7], targets [5, 6, 9, 4] -> [5, 6, 9]; drafts [5], targets [5, 8] -> [5, 8].
    """
    out: list[list[int]] = []
    for drafts, targets in zip(draft_token_ids, target_token_ids, strict=True):
        if len(targets) != len(drafts) + 1:
            raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} target tokens, got {len(targets)}")
        num_accepted = 0
        while num_accepted < len(drafts) and drafts[num_accepted] == targets[num_accepted]:
            num_accepted += 1
        out.append([*drafts[:num_accepted], targets[num_accepted]])
    return out


def draw_uniforms_and_noise(
    num_rows: int, vocab_size: int, generators: dict[int, torch.Generator], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per target row: a uniform in [0, 1) (the acceptance test) and V Exp(1) values (the recovery or bonus draw).
    Row r in ``generators`` draws both from that generator alone; the others from the default generator."""
    uniforms = torch.rand(num_rows, device=device)
    noise = torch.empty(num_rows, vocab_size, device=device).exponential_()
    for row, generator in generators.items():
        uniforms[row] = torch.rand((), generator=generator, device=device)
        noise[row].exponential_(generator=generator)
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)  # Exp(1) can return 0; 0 / 0 would win the arg-max
    return uniforms, noise


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: list[list[int]],
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
) -> list[list[int]]:
    """The lossless rule for every request at once.

    target_probs [N, V]: request i's k_i + 1 rows in order, requests one after another (N = sum(k_i + 1)).
    draft_probs [sum(k_i), V] (the drafts' rows in the same order) or None: one-hot at each draft (n-gram).
    uniforms [N], noise [N, V] from ``draw_uniforms_and_noise`` (entries of bonus rows' uniforms are unused).
    Example of the row layout: drafts [[4, 2], [7]] -> target rows [r0 r0 r0 | r1 r1]: draft rows [0, 1, 3],
    bonus rows [2, 4].
    """
    num_rows, vocab_size = target_probs.shape
    counts = [len(drafts) + 1 for drafts in draft_token_ids]
    if sum(counts) != num_rows:
        raise ValueError(f"{num_rows} target rows for drafts needing {sum(counts)}")
    device = target_probs.device
    is_draft_row = torch.ones(num_rows, dtype=torch.bool, device=device)
    starts: list[int] = []
    start = 0
    for count in counts:
        starts.append(start)
        start += count
        is_draft_row[start - 1] = False
    draft_rows = torch.nonzero(is_draft_row).squeeze(1)  # [D]
    drafts = torch.tensor([t for ds in draft_token_ids for t in ds], dtype=torch.int64, device=device)  # [D]
    probs = target_probs.to(torch.float32)
    p_draft = probs[draft_rows, drafts]  # [D]
    residual = probs.clone()  # bonus rows: p itself
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        residual[draft_rows, drafts] = 0.0  # max(0, p - onehot(d)) is p without d
    else:
        q = draft_probs.to(torch.float32)
        q_draft = q[torch.arange(len(drafts), device=device), drafts]
        residual[draft_rows] = (probs[draft_rows] - q).clamp_min_(0.0)
    empty = residual.sum(dim=-1) <= 0  # p == q: a rejection has probability 0; float rounding gets p itself
    residual[empty] = probs[empty]
    accepted = (uniforms[draft_rows] * q_draft < p_draft).tolist()  # accept with probability min(1, p / q)
    # Exponential race: argmax(r / E) samples norm(r) (the scale of r does not matter).
    emitted = residual.div(noise).argmax(dim=-1).tolist()  # [N]: the token each row emits if it is the last
    out: list[list[int]] = []
    draft_index = 0
    for drafts_i, start in zip(draft_token_ids, starts, strict=True):
        num_accepted = 0
        while num_accepted < len(drafts_i) and accepted[draft_index + num_accepted]:
            num_accepted += 1
        draft_index += len(drafts_i)
        out.append([*drafts_i[:num_accepted], int(emitted[start + num_accepted])])
    return out
