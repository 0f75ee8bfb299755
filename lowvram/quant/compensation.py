"""Residual compensation: correct a Linear's INT4 error E = W - Q(W) with small FP16 terms.

Bias correction c = E mu (mu: mean input), and low rank (LQER, QERA, EoRA): with
H = E[x x^T] = L L^T (the covariance when c is on), the truncated SVD E L ~ U S V^T gives
the optimal B = U sqrt(S), A = sqrt(S) V^T L^-1. Fitted on even samples, chosen in closed
form on odd ones among ranks 0, R/4, R/2, R, scales 0.25..1, with or without c: the smallest
rank reaching 90% of the best gain wins; nothing is kept when nothing helps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_CANDIDATES = (0.25, 0.5, 0.75, 1.0)
MIN_SHARE_OF_BEST_GAIN = 0.9
DAMPING = 1e-2
# Above this many columns a randomized SVD of the top components beats the full one.
MIN_LOWRANK_SVD_SIZE = 512


class InputStats:
    """First and second moments of a Linear's inputs, for the fit and eval halves apart.
    Linears reading one input share it, and with it the fit half's Cholesky factor."""

    def __init__(self, num_features: int, device: torch.device):
        self.sums = [torch.zeros(num_features, dtype=torch.float64, device=device) for _ in range(2)]
        self.second = [torch.zeros(num_features, num_features, dtype=torch.float32, device=device) for _ in range(2)]
        self.counts = [0, 0]
        self._is_normalized = False
        self._cholesky: dict[bool, torch.Tensor | None] = {}

    def add(self, x: torch.Tensor, is_fit: bool) -> None:
        """x [T, K], tokens of one half; only before moments() is read."""
        half = 0 if is_fit else 1
        xf = x.to(torch.float32)
        self.sums[half] += xf.sum(dim=0, dtype=torch.float64)
        self.second[half].addmm_(xf.t(), xf)
        self.counts[half] += x.shape[0]

    def moments(self, is_fit: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean [K], E[x x^T] [K, K]), float32; the other half's when this one is empty."""
        if not self._is_normalized:  # in place: for K = 8960 a second moment is 320 MB
            for half in range(2):
                self.second[half] /= max(self.counts[half], 1)
            self._is_normalized = True
        half = 0 if is_fit else 1
        half = half if self.counts[half] else 1 - half
        mean = (self.sums[half] / max(self.counts[half], 1)).to(torch.float32)
        return mean, self.second[half]

    def fit_cholesky(self, is_centered: bool) -> torch.Tensor | None:
        """L with L L^T = the fit half's E[x x^T] (covariance if is_centered), damped; None if
        not positive definite even after damping."""
        if is_centered not in self._cholesky:
            mean, second = self.moments(is_fit=True)
            weighting = second.clone()
            if is_centered:
                weighting.addr_(mean, mean, alpha=-1)
            diagonal = weighting.diagonal()
            damp = DAMPING * diagonal.mean().clamp(min=1e-8)
            diagonal.add_(damp)
            for _ in range(4):  # float32 rounding can leave a nearly singular H indefinite: damp harder
                chol, info = torch.linalg.cholesky_ex(weighting)
                if int(info) == 0:
                    break
                diagonal.add_(damp * 9)
                damp = damp * 10
                chol = None
            self._cholesky[is_centered] = chol
        return self._cholesky[is_centered]


@dataclass
class Compensation:
    lora_a: torch.Tensor | None  # [r, K]
    lora_b: torch.Tensor | None  # [N, r], the scale already applied
    bias_correction: torch.Tensor | None  # [N]
    rank: int
    scale: float
    error_reduction: float  # share of the INT4 output error removed on the held-out half (0..1)


def fit_compensation(error: torch.Tensor, stats: InputStats, max_rank: int, use_bias: bool) -> Compensation | None:
    """The correction of one Linear, or None when no candidate lowers the held-out error.

    error: W - Q(W) [N, K] as the layer computes it (float32); stats: moments of its inputs.
    """
    error = error.to(torch.float32)
    max_rank = min(max_rank, *error.shape)
    mean_fit, _ = stats.moments(is_fit=True)
    mean_eval, second_eval = stats.moments(is_fit=False)

    # Held-out error of E - gamma * M_r with bias b, in closed form:
    # tr(E He E^T) - 2 gamma c_r + gamma^2 q_r - 2 b.(E mu_e - gamma M_r mu_e) + |b|^2
    base = float((error * (error @ second_eval)).sum())
    error_mean_eval, error_mean_fit = error @ mean_eval, error @ mean_fit

    ranks = sorted({0, max(1, max_rank // 4), max(1, max_rank // 2), max_rank}) if max_rank > 0 else [0]
    chol = stats.fit_cholesky(is_centered=use_bias) if ranks[-1] > 0 else None
    if chol is None:
        ranks = [0]
    else:
        # B [N, R], A [R, K] minimising ||(E - B A) L||_F
        weighted = error @ chol  # [N, K]
        top = min(ranks[-1], *weighted.shape)
        if min(weighted.shape) > MIN_LOWRANK_SVD_SIZE:
            u, s, v = torch.svd_lowrank(weighted, q=min(top + 8, min(weighted.shape)), niter=4)
            u, s, vt = u[:, :top], s[:top], v[:, :top].t()
        else:
            u, s, vt = torch.linalg.svd(weighted, full_matrices=False)
            u, s, vt = u[:, :top], s[:top], vt[:top]
        root = s.sqrt()
        lora_b = u * root
        # A L = sqrt(S) V^T  ->  A = sqrt(S) V^T L^-1
        lora_a = torch.linalg.solve_triangular(chol, root[:, None] * vt, upper=False, left=False)
        a_second = lora_a @ second_eval  # [R, K]
        gram_a = a_second @ lora_a.t()  # [R, R]
        gram_b = lora_b.t() @ lora_b  # [R, R]
        cross = (lora_b.t() * (a_second @ error.t())).sum(dim=1)  # [R], c_r is a prefix sum
        a_mean_eval, a_mean_fit = lora_a @ mean_eval, lora_a @ mean_fit  # [R]

    candidates = []  # (error, rank, gamma, has_bias)
    for rank in ranks:
        for gamma in SCALE_CANDIDATES if rank else (0.0,):
            c = q = low_rank_mean_eval = low_rank_mean_fit = 0.0
            if rank:
                c = float(cross[:rank].sum())
                q = float((gram_b[:rank, :rank] * gram_a[:rank, :rank]).sum())
                low_rank_mean_eval = lora_b[:, :rank] @ a_mean_eval[:rank]
                low_rank_mean_fit = lora_b[:, :rank] @ a_mean_fit[:rank]
            quadratic = base - 2 * gamma * c + gamma * gamma * q
            candidates.append((quadratic, rank, gamma, False))
            if use_bias:
                bias = error_mean_fit - gamma * low_rank_mean_fit
                residual_mean = error_mean_eval - gamma * low_rank_mean_eval
                value = quadratic - 2 * float(bias @ residual_mean) + float(bias @ bias)
                candidates.append((value, rank, gamma, True))

    best_error = min(c[0] for c in candidates)
    if best_error >= base or base <= 0:
        return None
    good_enough = base - MIN_SHARE_OF_BEST_GAIN * (base - best_error)
    chosen_rank = min(c[1] for c in candidates if c[0] <= good_enough)
    value, rank, gamma, has_bias = min((c for c in candidates if c[1] == chosen_rank), key=lambda c: c[0])
    bias_correction = None
    if has_bias:
        bias_correction = error_mean_fit
        if rank:
            bias_correction = bias_correction - gamma * (lora_b[:, :rank] @ a_mean_fit[:rank])
    return Compensation(
        lora_a=lora_a[:rank].contiguous() if rank else None,
        lora_b=(gamma * lora_b[:, :rank]).contiguous() if rank else None,
        bias_correction=bias_correction,
        rank=rank,
        scale=gamma if rank else 0.0,
        error_reduction=1.0 - value / base,
    )
