"""The depthwise causal ("short") convolution both families' text graphs use, as K shifted products.

The sum is conv1d's, but exported as Mul/Add on slices rather than a grouped Conv: cuDNN runs a grouped Conv of
this shape in a fallback mode (it was 96.6% of the d3 graph's CUDA kernel time, and made d1's graph 3x slower)
and searches algorithms again at every new shape.
"""

from __future__ import annotations

import torch


def shifted_conv(window: torch.Tensor, weight: torch.Tensor, length: int) -> torch.Tensor:
    """out[:, :, t] = sum_k weight[:, k] * window[:, :, t + k] for t < length: `window` [B, C, K - 1 + length]
    holds the K - 1 values before the first output (zeros at the start of a prompt), `weight` is [C, K]."""
    return sum(window[:, :, k:k + length] * weight[:, k:k + 1] for k in range(weight.shape[1]))
