"""Orthogonal rotations for KV-cache quantization, in the row-vector convention `x_rot = x @ R`.

Building blocks:

- `hadamard(d)`: normalized Walsh-Hadamard matrix for `d = 2^k`, `12 * 2^k` or `20 * 2^k`
  (every entry `+-1/sqrt(d)`). Orders 12 and 20 come from Paley construction I on the quadratic
  residues mod 11 and mod 19, built in code. For `d = m * 2^k` (`m` in {12, 20}) the matrix is
  `kron(H_m, S_{2^k})` (`S` Sylvester) with its rows put in "power-of-two-major" order: row
  `b * m + a` is row `a * 2^k + b` of the Kronecker product. For `m = 1` this is plain Sylvester.
- `bit_reversal(d)`: the permutation `P` applied last to the output channels,
  `(x @ P)[j] = x[rev(j)]`. For `d = m * 2^k` it reverses the `k` low bits of the channel index
  inside each contiguous block of `2^k` channels (`P = I_m (x) P_{2^k}`); for `d = 2^k` it is the
  ordinary bit reversal.
- `eigenbasis(C)`: eigenvectors of a symmetric matrix as columns, eigenvalues descending, each
  column's largest-magnitude entry positive (first such entry on ties).

Why `U.H.P`: `x @ U` puts the target's variance in descending order on channels `0..d-1`; `H`
spreads every channel's energy evenly (Lemma 1: `diag(R^T C R) = tr(C)/d` for `R = U.H`); with
Sylvester ordering, row `i` of `H` is the Walsh function `(-1)^popcount(i & j)`, and after the
bit reversal `P` rows `0..d/G-1` become constant inside every group of `G` consecutive channels
(G a power of two dividing `2^k`), so the `d/G` top eigen-directions cost no quantization range.
Without `P` the group-constant rows are `0, G, 2G, ...` instead. For `d = m * 2^k` the row order
above keeps the same statement for any power of two `G` dividing `2^k`; groups wider than `2^k`
(e.g. `G = 32` at `d = 96 = 12 * 8`) cannot be made constant by any Hadamard of order 12 or 20.
"""

from __future__ import annotations

from functools import lru_cache

import torch

ROTATION_KINDS = ("identity", "hadamard", "hp", "block_hadamard", "random", "u", "uh", "up", "uhp", "raw_uhp")
NEEDS_COVARIANCE = ("u", "uh", "up", "uhp", "raw_uhp")
_PALEY_ORDERS = (12, 20)


def _split_order(d: int) -> tuple[int, int]:
    """`d = m * 2^k` with `m` in {1, 12, 20}: returns `(m, 2^k)`, or raises naming the valid forms."""
    if isinstance(d, bool) or not isinstance(d, int) or d <= 0:
        raise ValueError(f"head_dim d={d!r} must be a positive integer")
    for m in (1, *_PALEY_ORDERS):
        if d % m == 0:
            p = d // m
            if p & (p - 1) == 0:
                return m, p
    raise ValueError(
        f"no Hadamard construction for head_dim d={d}; valid forms are 2^k, 12*2^k and 20*2^k "
        "(e.g. 64, 80, 96, 128, 160, 192, 256)"
    )


def is_hadamard_order(d: int) -> bool:
    """Whether `hadamard(d)` exists (d = 2^k, 12*2^k or 20*2^k)."""
    try:
        _split_order(d)
    except ValueError:
        return False
    return True


def _legendre(a: int, q: int) -> int:
    a %= q
    if a == 0:
        return 0
    return 1 if pow(a, (q - 1) // 2, q) == 1 else -1


def paley_hadamard(n: int) -> torch.Tensor:
    """Unnormalized +-1 Hadamard matrix of order `n = q + 1` (q prime, q = 3 mod 4) by Paley I."""
    q = n - 1
    if q < 3 or q % 4 != 3 or any(q % p == 0 for p in range(2, int(q**0.5) + 1)):
        raise ValueError(f"Paley construction I needs n = q + 1 with q a prime = 3 mod 4, got n={n}")
    jac = torch.tensor([[_legendre(j - i, q) for j in range(q)] for i in range(q)], dtype=torch.float64)
    s = torch.zeros(n, n, dtype=torch.float64)
    s[0, 1:] = 1.0
    s[1:, 0] = -1.0
    s[1:, 1:] = jac
    h = torch.eye(n, dtype=torch.float64) + s
    if not torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64)):
        raise RuntimeError(f"Paley construction of order {n} is not Hadamard")
    return h


def sylvester_hadamard(n: int) -> torch.Tensor:
    """Unnormalized +-1 Sylvester-Hadamard matrix of order `n = 2^k`: `H[i, j] = (-1)^popcount(i & j)`."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"Sylvester construction needs a power of two, got n={n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@lru_cache(maxsize=32)
def _hadamard_cached(d: int) -> torch.Tensor:
    m, p = _split_order(d)
    s = sylvester_hadamard(p)
    if m == 1:
        h = s
    else:
        kron = torch.kron(paley_hadamard(m), s)  # row a * p + b
        order = torch.arange(d).view(m, p).T.reshape(-1)  # new row b * m + a takes old row a * p + b
        h = kron[order]
    return h / float(d) ** 0.5


def hadamard(d: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Normalized Hadamard matrix `[d, d]` (orthogonal, entries +-1/sqrt(d)); see module docstring."""
    return _hadamard_cached(d).to(dtype).clone()


def bit_reversal_indices(d: int) -> torch.Tensor:
    """Index `perm` with `(x @ P)[..., j] = x[..., perm[j]]` (low-bit reversal inside 2^k blocks)."""
    m, p = _split_order(d)
    k = p.bit_length() - 1
    rev = torch.tensor([int(format(j, f"0{k}b")[::-1], 2) if k else 0 for j in range(p)], dtype=torch.long)
    return (torch.arange(m).view(m, 1) * p + rev.view(1, p)).reshape(-1)


def permutation_matrix(perm: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Matrix `P` with `x @ P == x[..., perm]`, i.e. `P[perm[j], j] = 1`."""
    d = perm.numel()
    mat = torch.zeros(d, d, dtype=dtype)
    mat[perm, torch.arange(d)] = 1.0
    return mat


def bit_reversal(d: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Bit-reversal permutation matrix `P` `[d, d]` (symmetric, an involution)."""
    return permutation_matrix(bit_reversal_indices(d), dtype)


def block_hadamard(d: int, group_size: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Block-diagonal `I_{d/G} (x) hadamard(G)`: rotates each quantization group on its own."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 or d % group_size:
        raise ValueError(f"group_size={group_size!r} must be a positive divisor of head_dim d={d}")
    return torch.kron(torch.eye(d // group_size, dtype=torch.float64), _hadamard_cached(group_size)).to(dtype)


def random_orthogonal(d: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Haar-random orthogonal `[d, d]` from a seeded Gaussian: QR with the signs of `diag(R)` fixed."""
    if isinstance(d, bool) or not isinstance(d, int) or d <= 0:
        raise ValueError(f"d={d!r} must be a positive integer")
    gen = torch.Generator().manual_seed(int(seed))
    a = torch.randn(d, d, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    sign = torch.sign(torch.diagonal(r))
    sign[sign == 0] = 1.0
    return (q * sign).to(dtype)


def eigenbasis(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(U, eigenvalues)` of a symmetric matrix in float64: columns of `U` descending by eigenvalue.

    Sign convention: each column's entry of largest magnitude (first one on ties) is positive,
    so the basis is deterministic for a given matrix. `cov == U @ diag(eig) @ U.T`.
    """
    if cov.ndim != 2 or cov.shape[0] != cov.shape[1]:
        raise ValueError(f"covariance must be square [d, d], got shape {tuple(cov.shape)}")
    c = cov.to(torch.float64)
    if not torch.isfinite(c).all():
        raise ValueError("covariance contains non-finite values")
    c = (c + c.T) / 2
    eig, vec = torch.linalg.eigh(c)
    order = torch.argsort(eig, descending=True, stable=True)
    eig, vec = eig[order], vec[:, order]
    idx = vec.abs().argmax(dim=0)
    sign = torch.sign(vec[idx, torch.arange(vec.shape[1])])
    sign[sign == 0] = 1.0
    return vec * sign, eig


def build_rotation(
    kind: str,
    d: int,
    *,
    cov: torch.Tensor | None = None,
    group_size: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Rotation `R` `[d, d]` of a named kind (row-vector convention `x_rot = x @ R`).

    Kinds: `identity`; `hadamard` (`H`, QuaRot); `hp` (`H.P`); `block_hadamard` (per group,
    Saw-INT4; needs `group_size`); `random` (seeded Haar, TurboQuant-style); `u` (`U`, the
    eigenbasis alone); `uh` (`U.H`); `up` (`U.P`); `uhp` (`U.H.P`, OSCAR); `raw_uhp` (`U.H.P` whose
    `cov` is the raw second moment `K^T K` or `V^T V`; the caller passes that matrix). Kinds with
    `U` need `cov`, the target covariance (`C_Q` for keys, `C_S` for values in OSCAR).
    """
    if kind not in ROTATION_KINDS:
        raise ValueError(f"unknown rotation kind {kind!r}; valid kinds are {ROTATION_KINDS}")
    if kind in NEEDS_COVARIANCE:
        if cov is None:
            raise ValueError(f"rotation kind {kind!r} needs a target covariance `cov`")
        if tuple(cov.shape) != (d, d):
            raise ValueError(f"covariance of shape {tuple(cov.shape)} does not match head_dim d={d}")
    if kind == "identity":
        r = torch.eye(d, dtype=torch.float64)
    elif kind == "hadamard":
        r = hadamard(d)
    elif kind == "hp":
        r = hadamard(d) @ bit_reversal(d)
    elif kind == "block_hadamard":
        if group_size is None:
            raise ValueError("rotation kind 'block_hadamard' needs group_size")
        r = block_hadamard(d, group_size)
    elif kind == "random":
        r = random_orthogonal(d, seed)
    else:
        u, _ = eigenbasis(cov)  # type: ignore[arg-type]
        if kind == "u":
            r = u
        elif kind == "uh":
            r = u @ hadamard(d)
        elif kind == "up":
            r = u @ bit_reversal(d)
        else:
            r = u @ hadamard(d) @ bit_reversal(d)
    return r.to(dtype)


def orthogonality_error(r: torch.Tensor) -> float:
    """`max |R^T R - I|` in float64."""
    r64 = r.to(torch.float64)
    return float((r64.T @ r64 - torch.eye(r.shape[-1], dtype=torch.float64)).abs().max())


__all__ = [
    "NEEDS_COVARIANCE",
    "ROTATION_KINDS",
    "bit_reversal",
    "bit_reversal_indices",
    "block_hadamard",
    "build_rotation",
    "eigenbasis",
    "hadamard",
    "is_hadamard_order",
    "orthogonality_error",
    "paley_hadamard",
    "permutation_matrix",
    "random_orthogonal",
    "sylvester_hadamard",
]
