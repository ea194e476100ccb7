"""The portable graph's gated delta rule (export/d3/delta_rule.py) computes the recurrence of spec 4.13 chunk by
chunk; its chunk solve must hold in fp32 where the recurrence is well conditioned, a run of one repeated token
included (its keys identical: the case that broke an inverse by repeated squaring at d3-nano's size)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from systemone.export.d3.delta_rule import _unit_lower_inverse, chunked_rule


def recurrence(query, key, value, g, beta, scale):
    """The rule step by step in float64, from a zero state: S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t)
    S_{t-1}^T k_t))^T, o_t = scale S_t^T q_t."""
    query, key, value, g, beta = (x.double() for x in (query, key, value, g, beta))
    batch, length, heads, k_dim = key.shape
    state = torch.zeros(batch, heads, k_dim, value.shape[-1], dtype=torch.float64)
    out = []
    for t in range(length):
        decayed = state * g[:, t].exp()[..., None, None]
        k, v, b = key[:, t], value[:, t], beta[:, t][..., None]
        delta = b * (v - torch.einsum("bhkv,bhk->bhv", decayed, k))
        state = decayed + k[..., :, None] * delta[..., None, :]
        out.append(scale * torch.einsum("bhkv,bhk->bhv", state, query[:, t]))
    return torch.stack(out, dim=1)


def test_the_chunk_solve_is_the_inverse_where_identical_keys_make_it_hard():
    """All strict-lower entries 0.95 (identical keys, update rate 0.95, little decay): the inverse's entries stay
    within 1, while the powers of the strict part reach C(63, 32) x 0.95^32."""
    hard = torch.full((2, 64, 64), 0.95).tril(-1)
    random = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0)).tril(-1) * 0.1
    for strict_lower in (hard, random):
        exact = torch.linalg.inv(torch.eye(64, dtype=torch.float64) + strict_lower.double())
        assert (_unit_lower_inverse(strict_lower).double() - exact).abs().max() < 1e-5


def test_the_chunked_rule_is_the_recurrence_on_a_run_of_one_repeated_token():
    generator = torch.Generator().manual_seed(0)
    batch, length, heads, k_dim, v_dim = 1, 150, 2, 16, 8  # three chunks, the last one partial
    key = F.normalize(torch.randn(batch, 1, heads, k_dim, generator=generator), dim=-1).expand(-1, length, -1, -1)
    query = F.normalize(torch.randn(batch, length, heads, k_dim, generator=generator), dim=-1)
    value = torch.randn(batch, length, heads, v_dim, generator=generator)
    g = torch.full((batch, length, heads), -0.01)
    beta = torch.full((batch, length, heads), 0.95)
    got = chunked_rule(query, key.contiguous(), value, g, beta, k_dim ** -0.5)
    want = recurrence(query, key, value, g, beta, k_dim ** -0.5)
    assert (got.double() - want).abs().max() < 1e-4


def test_the_chunked_rule_is_the_recurrence_on_random_tokens():
    generator = torch.Generator().manual_seed(1)
    batch, length, heads, k_dim, v_dim = 2, 100, 2, 16, 8
    query, key = (F.normalize(torch.randn(batch, length, heads, k_dim, generator=generator), dim=-1)
                  for _ in range(2))
    value = torch.randn(batch, length, heads, v_dim, generator=generator)
    g = -torch.rand(batch, length, heads, generator=generator)
    beta = torch.rand(batch, length, heads, generator=generator)
    got = chunked_rule(query, key, value, g, beta, k_dim ** -0.5)
    assert (got.double() - recurrence(query, key, value, g, beta, k_dim ** -0.5)).abs().max() < 1e-4
