"""Statistics over the tokens a mask selects (1 = the token counts, 0 = padding or ignored).

These are verl's `masked_mean`, `masked_var` and `masked_whiten` (verl/utils/torch_functional.py):
the mean divides by `mask.sum() + 1e-8`, the variance is unbiased (Bessel's n / (n - 1)) and computed
around the masked mean of the whole tensor, and whitening adds 1e-8 under the square root.
"""

from __future__ import annotations

import torch

# Added to the token count of a mean, so an all-zero mask gives 0 instead of NaN (as verl).
MEAN_EPS = 1e-8
# Added to the variance before the reciprocal square root in whitening (as verl).
WHITEN_EPS = 1e-8


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """sum_i values_i * mask_i over `axis` (all elements when None).

    values, mask: same shape, e.g. (B, T). Masked-out entries are replaced by 0 before the product,
    so a NaN or inf sitting in padding cannot leak into the sum. (A Python 0.0 keeps `values`' dtype
    and, unlike a zero tensor, launches nothing: losses call this several times a micro-batch.)
    """
    kept = torch.where(mask.bool(), values, 0.0)
    return (kept * mask).sum(dim=axis) if axis is not None else (kept * mask).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """sum(values * mask) / (sum(mask) + 1e-8) over `axis` (all elements when None).

    values, mask: same shape, e.g. (B, T); returns a scalar, or the shape reduced over `axis`.
    """
    count = mask.sum(dim=axis) if axis is not None else mask.sum()
    return masked_sum(values, mask, axis) / (count + MEAN_EPS)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries of the whole tensor: scalar.

    var = masked_mean((values - mu)^2) with mu = masked_mean(values); unbiased multiplies by
    n / (n - 1), n = sum(mask). Raises ValueError when n is 0, or 1 with `unbiased` (division by zero).
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count == 0:
            raise ValueError("masked_var: the mask selects no element (all response_mask entries are 0)")
        if count == 1:
            raise ValueError(
                "masked_var: the mask selects a single element, so the unbiased variance divides by zero; "
                "use a larger batch"
            )
        variance = variance * (count / (count - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mu) / sqrt(var + 1e-8), mu and var the masked mean and unbiased variance: same shape.

    With `shift_mean=False` the mean is added back (scale only). Entries where mask = 0 are
    transformed too (they do not enter mu or var); callers multiply by the mask where they must be 0.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened
