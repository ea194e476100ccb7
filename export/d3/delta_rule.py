"""The gated delta rule, chunked, as the portable d3 text graph computes it (spec 4.13), in a form
`torch.onnx.export(dynamo=True)` keeps dynamic:

* the chunk loop runs on torch's `scan` (lowered to ONNX `Scan`), so the number of chunks follows the sequence
  length instead of being unrolled and pinned to the trace length;
* the unit-lower-triangular solve of each chunk is a blocked inverse: the inverses of the diagonal blocks of size
  1, 2, 4, ..., C, each pair joined as [[A^-1, 0], [-B^-1 L A^-1, B^-1]], a level at a time as two products of
  whole C x C matrices (static shapes: the export stays quick). Its products are of true inverse blocks, as
  bounded as forward substitution's (transformers' solve).
  An inverse by repeated squaring, (I + N)(I + N^2)(I + N^4)... for N the negated strict lower part, formed powers
  whose entries grow like a binomial coefficient and cancel in fp32: on a run of one repeated token its d3-nano
  code logits were 0.08 off transformers'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._higher_order_ops.scan import scan

CHUNK = 64


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _unit_lower_inverse(strict_lower: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 for a strictly lower triangular A [..., C, C], C a power of two: the blocked inverse, written on
    whole C x C matrices. X holds the inverses of the diagonal blocks of size s (zero elsewhere); joining each pair,
    [[P, 0], [L, Q]]^-1 = [[P^-1, 0], [-Q^-1 L P^-1, Q^-1]], is X - X (A masked to the L blocks) X."""
    count = strict_lower.shape[-1]
    index = torch.arange(count, device=strict_lower.device)
    rows, cols = index[:, None], index[None, :]
    inverse = torch.eye(count, dtype=strict_lower.dtype, device=strict_lower.device)
    size = 1
    while size < count:
        coupling = (rows // (2 * size) == cols // (2 * size)) & (rows % (2 * size) >= size) & (cols % (2 * size) < size)
        inverse = inverse - inverse @ (strict_lower * coupling) @ inverse
        size *= 2
    return inverse


def _chunk_step(state: torch.Tensor, chunk: list[torch.Tensor]):
    """One chunk of the gated delta rule: read the carried state, then update it (the scan body)."""
    q, k, new_v, k_cumdecay, attn, chunk_decay = chunk
    v_new = new_v - k_cumdecay @ state
    out = q @ state + attn @ v_new
    next_state = state * chunk_decay + k.transpose(-1, -2) @ v_new
    return next_state, out.clone()


def chunk_gated_delta_rule(query, key, value, g, beta, initial_state=None):
    """Gated delta rule over [B, L, H, D] inputs (causal); returns [B, L, H, Dv], and with `initial_state` (the
    state [1, H, Dk, Dv] of the tokens before, the same for every row) also the state after the last token."""
    query, key, value, beta, g = (x.float() for x in (query, key, value, beta, g))
    return chunked_rule(l2norm(query), l2norm(key), value, g, beta, query.shape[-1] ** -0.5, initial_state)


def chunked_rule(query, key, value, g, beta, scale: float, initial_state=None):
    """The rule on L2-normalised fp32 query and key [B, L, H, Dk], value [B, L, H, Dv], g and beta [B, L, H],
    chunk by chunk: intra-chunk products, then a `scan` carrying the state from chunk to chunk. From zero, or from
    `initial_state` [1, H, Dk, Dv]; then (output, final state [B, H, Dk, Dv]) are returned. The final state is that
    after each row's last token only where the row has no padding: padding is read as tokens. The chunk padding
    here is not (a zero key and update rate leave the state as it was, a zero decay exponent scales it by one)."""
    query, key, value, beta, g = (x.transpose(1, 2) for x in (query * scale, key, value, beta, g))
    batch, heads, length, _ = key.shape
    v_dim = value.shape[-1]
    chunks = (length + CHUNK - 1) // CHUNK
    pad = chunks * CHUNK - length
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = (x.reshape(batch, heads, chunks, CHUNK, x.shape[-1])
                                  for x in (query, key, k_beta, v_beta))
    g = g.reshape(batch, heads, chunks, CHUNK)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=query.device).triu(1)
    cum = g.cumsum(dim=-1)
    pairwise = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    ut_system = ((k_beta @ key.transpose(-1, -2)) * pairwise).tril(-1)
    intra = (query @ key.transpose(-1, -2)) * pairwise
    inverse = _unit_lower_inverse(ut_system)
    new_values = inverse @ v_beta
    k_cumdecay = inverse @ (k_beta * cum.exp().unsqueeze(-1))
    query = query * cum.exp().unsqueeze(-1)
    key = key * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    # Chunks first and (batch, heads) flattened: the scan body is plain 3-D bmm, which the ONNX decomposition
    # keeps free of symbolic reshapes.
    xs = [x.movedim(2, 0).flatten(1, 2) for x in (query, key, new_values, k_cumdecay, intra, chunk_decay)]
    # The zero state is derived from the data so that its batch dimension stays symbolic in the export.
    state = torch.zeros_like(xs[1][0].transpose(-1, -2) @ xs[2][0])
    if initial_state is not None:
        state = state + initial_state.expand(batch, -1, -1, -1).reshape(state.shape)
    final, out = scan(_chunk_step, state, xs)
    out = out.unflatten(1, (batch, heads)).movedim(0, 2).reshape(batch, heads, chunks * CHUNK, v_dim)[:, :, :length]
    if initial_state is None:
        return out.transpose(1, 2)
    return out.transpose(1, 2), final.reshape(batch, heads, *final.shape[1:])
