"""The depthwise causal ("short") convolution both families' text graphs use, as K shifted products.

The sum is conv1d's, but exported as Mul/Add on slices rather than a grouped Conv: cuDNN runs a grouped Conv of
this shape in a fallback mode (it was 96.6% of the d3 graph's CUDA kernel time, and made d1's graph 3x slower)
and searches algorithms again at every new shape. `shifted_conv_rows` is the same sum over time steps as rows
(channels last), for a graph whose products read and write [B, T, C]: no transpose of either on the way.
"""

from __future__ import annotations

import torch


def shifted_conv(window: torch.Tensor, weight: torch.Tensor, length: int) -> torch.Tensor:
    """out[:, :, t] = sum_k weight[:, k] * window[:, :, t + k] for t < length: `window` [B, C, K - 1 + length]
    holds the K - 1 values before the first output (zeros at the start of a prompt), `weight` is [C, K]."""
    return sum(window[:, :, k:k + length] * weight[:, k:k + 1] for k in range(weight.shape[1]))


def shifted_conv_rows(window: torch.Tensor, weight: torch.Tensor, length: int) -> torch.Tensor:
    """The same sum, channels last: out[:, t] = sum_k weight[:, k] * window[:, t + k] for t < length, `window`
    [B, K - 1 + length, C] (each shift a block of whole rows), `weight` [C, K]."""
    return sum(window[:, k:k + length] * weight[:, k] for k in range(weight.shape[1]))
