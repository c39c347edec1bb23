"""Tests of oscar.core.rotation in float64: orthogonality, Lemma 1, the group property of P, Theorem 1."""

from __future__ import annotations

import pytest
import torch

from oscar.core.rotation import (
    ROTATION_KINDS,
    bit_reversal,
    bit_reversal_indices,
    block_hadamard,
    build_rotation,
    eigenbasis,
    hadamard,
    is_hadamard_order,
    orthogonality_error,
    paley_hadamard,
    random_orthogonal,
)


pytestmark = pytest.mark.usefixtures("single_thread")


HEAD_DIMS = (64, 80, 96, 128, 160, 192, 256)


def _spd(d: int, seed: int, decay: float = 0.9) -> torch.Tensor:
    """A random SPD matrix with geometrically decaying, distinct eigenvalues."""
    q = random_orthogonal(d, seed + 1000)
    lam = decay ** torch.arange(d, dtype=torch.float64) * 10 + 1e-3 * torch.arange(d, 0, -1, dtype=torch.float64)
    return (q * lam) @ q.T


def _group_constant(v: torch.Tensor, g: int) -> bool:
    grp = v.reshape(-1, g)
    return bool(torch.equal(grp, grp[:, :1].expand_as(grp)))


def _near_constant(v: torch.Tensor, g: int) -> bool:
    grp = v.reshape(-1, g)
    return bool(((grp - grp[:, :1]).abs() < 1e-12).all())


@pytest.mark.parametrize("d", HEAD_DIMS + (1, 2, 12, 20, 24, 40))
def test_hadamard_is_orthogonal_with_flat_entries(d):
    h = hadamard(d)
    assert torch.allclose(h @ h.T, torch.eye(d, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.allclose(h.abs(), torch.full((d, d), d**-0.5, dtype=torch.float64), atol=1e-15, rtol=0)


@pytest.mark.parametrize("n", [12, 20])
def test_paley_matrices_are_hadamard_and_integer(n):
    h = paley_hadamard(n)
    assert torch.equal(h.abs(), torch.ones(n, n, dtype=torch.float64))
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))


@pytest.mark.parametrize("d", [3, 36, 72, 100, 120, 257])
def test_unsupported_head_dims_are_refused_naming_the_value(d):
    assert not is_hadamard_order(d)
    with pytest.raises(ValueError, match=rf"d={d}.*2\^k, 12\*2\^k and 20\*2\^k"):
        hadamard(d)


def test_non_positive_head_dim_is_refused():
    with pytest.raises(ValueError, match="d=0 must be a positive integer"):
        hadamard(0)


def test_paley_refuses_bad_orders():
    with pytest.raises(ValueError, match="n=16"):
        paley_hadamard(16)


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_bit_reversal_is_an_involution_permutation(d):
    perm = bit_reversal_indices(d)
    assert sorted(perm.tolist()) == list(range(d))
    assert torch.equal(perm[perm], torch.arange(d))
    p = bit_reversal(d)
    x = torch.randn(3, d, dtype=torch.float64)
    assert torch.equal(x @ p, x[:, perm])
    assert torch.equal(p, p.T)


def test_bit_reversal_values_power_of_two_and_blocked():
    assert bit_reversal_indices(8).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]
    assert bit_reversal_indices(24).tolist() == list(range(24))  # 24 = 12 * 2: one bit, nothing moves
    assert bit_reversal_indices(96).tolist()[:16] == [0, 4, 2, 6, 1, 5, 3, 7, 8, 12, 10, 14, 9, 13, 11, 15]
    assert bit_reversal_indices(80)[16:20].tolist() == [16, 18, 17, 19]  # 80 = 20 * 4


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("kind", ROTATION_KINDS)
def test_every_rotation_is_orthogonal(d, kind):
    g = 32 if d % 32 == 0 else 16
    r = build_rotation(kind, d, cov=_spd(d, d), group_size=g, seed=3)
    assert r.shape == (d, d) and r.dtype == torch.float64
    assert orthogonality_error(r) < 1e-12


def test_rotation_kinds_compose_as_documented():
    d = 64
    c = _spd(d, 1)
    u, lam = eigenbasis(c)
    h, p = hadamard(d), bit_reversal(d)
    assert torch.equal(build_rotation("identity", d), torch.eye(d, dtype=torch.float64))
    assert torch.equal(build_rotation("hp", d), h @ p)
    assert torch.equal(build_rotation("uhp", d, cov=c), u @ h @ p)
    assert torch.equal(build_rotation("raw_uhp", d, cov=c), u @ h @ p)
    assert torch.equal(build_rotation("uh", d, cov=c), u @ h)
    assert torch.equal(build_rotation("up", d, cov=c), u @ p)
    assert torch.equal(build_rotation("random", d, seed=5), random_orthogonal(d, 5))
    assert not torch.equal(random_orthogonal(d, 5), random_orthogonal(d, 6))
    bh = build_rotation("block_hadamard", d, group_size=16)
    assert torch.equal(bh[:16, :16], hadamard(16)) and torch.equal(bh[:16, 16:], torch.zeros(16, 48, dtype=torch.float64))
    assert torch.equal(block_hadamard(d, 16), bh)


def test_rotation_argument_errors():
    with pytest.raises(ValueError, match="unknown rotation kind 'qr'"):
        build_rotation("qr", 64)
    with pytest.raises(ValueError, match="needs a target covariance"):
        build_rotation("uhp", 64)
    with pytest.raises(ValueError, match="does not match head_dim d=64"):
        build_rotation("uh", 64, cov=torch.eye(32))
    with pytest.raises(ValueError, match="needs group_size"):
        build_rotation("block_hadamard", 64)
    with pytest.raises(ValueError, match="group_size=48"):
        block_hadamard(64, 48)


def test_eigenbasis_descending_deterministic_signs():
    c = _spd(96, 2)
    u, lam = eigenbasis(c)
    assert bool((lam[:-1] >= lam[1:]).all())
    assert torch.allclose(u @ torch.diag(lam) @ u.T, c, atol=1e-10, rtol=0)
    idx = u.abs().argmax(0)
    assert bool((u[idx, torch.arange(96)] > 0).all())
    # ground truth: a known basis with the sign convention applied recovers exactly, in order
    q = random_orthogonal(96, 77)
    q = q * torch.sign(q[q.abs().argmax(0), torch.arange(96)])
    lam_true = torch.linspace(5.0, 0.1, 96, dtype=torch.float64)
    u_true, lam_found = eigenbasis((q * lam_true) @ q.T)
    assert torch.allclose(u_true, q, atol=1e-9, rtol=0)
    assert torch.allclose(lam_found, lam_true, atol=1e-12, rtol=0)


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("with_p", [False, True])
def test_lemma1_uh_equalizes_channel_energy(d, with_p):
    c = _spd(d, d + 7)
    r = build_rotation("uhp" if with_p else "uh", d, cov=c)
    diag = torch.diagonal(r.T @ c @ r)
    assert torch.allclose(diag, torch.full((d,), float(torch.trace(c)) / d, dtype=torch.float64), rtol=1e-12, atol=0)
    # and it is not a property of any rotation: U alone keeps the spread
    du = torch.diagonal(build_rotation("u", d, cov=c).T @ c @ build_rotation("u", d, cov=c))
    assert float(du.max() / du.min()) > 10


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("g", [8, 16, 32, 64])
def test_group_property_of_p_with_sylvester_h(d, g):
    if d % g:
        pytest.skip("group does not divide d")
    c = _spd(d, 11)
    u, _ = eigenbasis(c)
    hp = build_rotation("uhp", d, cov=c)
    uh = build_rotation("uh", d, cov=c)
    # exact on the +-1 structure: eigen-direction i maps to row i of H.P (resp. H)
    h_int = hadamard(d) * d**0.5
    with_p = [i for i in range(d) if _group_constant((h_int @ bit_reversal(d))[i], g)]
    without_p = [i for i in range(d) if _group_constant(h_int[i], g)]
    assert with_p == list(range(d // g))  # the top d/G eigen-directions, and only those
    assert without_p == list(range(0, d, g))  # 0, G, 2G, ... without P
    # and through the full float64 rotation U.H.P of a covariance
    assert [i for i in range(d) if _near_constant(u[:, i] @ hp, g)] == with_p
    assert [i for i in range(d) if _near_constant(u[:, i] @ uh, g)] == without_p


@pytest.mark.parametrize("d,g", [(96, 8), (80, 4), (160, 8), (192, 16), (24, 2)])
def test_group_property_for_paley_orders_within_power_of_two_blocks(d, g):
    c = _spd(d, 5)
    u, _ = eigenbasis(c)
    hp = build_rotation("uhp", d, cov=c)
    with_p = [i for i in range(d) if _near_constant(u[:, i] @ hp, g)]
    assert with_p == list(range(d // g))


@pytest.mark.parametrize("d", [64, 96, 128])
def test_theorem1_eigenbasis_minimizes_frozen_error_surrogate(d):
    c = _spd(d, 21, decay=0.85)
    u, lam = eigenbasis(c)
    e = torch.diag(torch.sort(torch.rand(d, dtype=torch.float64, generator=torch.Generator().manual_seed(d)))[0])
    at_u = float(torch.trace(u.T @ c @ u @ e))
    assert abs(at_u - float((lam * torch.diagonal(e)).sum())) < 1e-9 * abs(at_u)
    others = [float(torch.trace(r.T @ c @ r @ e)) for r in (random_orthogonal(d, s) for s in range(200))]
    others += [float(torch.trace(r.T @ c @ r @ e)) for r in (build_rotation(k, d, cov=c) for k in ("identity", "hadamard", "uh", "uhp", "up"))]
    assert min(others) > at_u
    # a small perturbation of U (an orthogonal Givens rotation) also increases it
    for i, j in [(0, 1), (0, d - 1), (3, 7)]:
        gr = torch.eye(d, dtype=torch.float64)
        t = torch.tensor(0.05, dtype=torch.float64)
        gr[i, i] = gr[j, j] = torch.cos(t)
        gr[i, j], gr[j, i] = -torch.sin(t), torch.sin(t)
        assert float(torch.trace((u @ gr).T @ c @ (u @ gr) @ e)) > at_u


def test_dtype_argument_gives_float32_storage():
    r = build_rotation("uhp", 64, cov=_spd(64, 3), dtype=torch.float32)
    assert r.dtype == torch.float32 and orthogonality_error(r) < 1e-6
