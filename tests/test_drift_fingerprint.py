"""The replica-drift fingerprint: its definition (three int64 checksums of int16 words), computed by column
sums, catches a one-ulp change of any single element and a swap of two, and gives equal tensors equal values."""

from __future__ import annotations

import pytest
import torch

import ars_opd.training.drift as drift
from ars_opd.training.drift import fingerprint, tensor_fingerprint

P = drift._MODULUS


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread, as the engine's CPU workers run (ddp.threads_per_worker): the fingerprint's many
    small row adds spend most of their time handing work between threads on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _definition(tensors) -> torch.Tensor:
    """[Σu_i, Σu_i·((i mod 65521) + 1), Σu_i·((i² mod 65521) + 1)] over each tensor's int16 words, summed over
    the tensors: the module docstring, spelled out."""
    total = torch.zeros(3, dtype=torch.int64)
    for t in tensors:
        flat = t.detach().contiguous().reshape(-1)
        if flat.element_size() == 1:
            flat = flat.to(torch.int16)
        u = flat.view(torch.int16).to(torch.int64)
        i = torch.arange(u.numel(), dtype=torch.int64)
        total += torch.stack([u.sum(), (u * (i % P + 1)).sum(), (u * (i * i % P + 1)).sum()])
    return total


def _cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sizes = (1, 7, P // 2, P // 2 + 1, P, P + 3, 3 * P - 1, 200_003)  # floats: 2 words each
    return [torch.randn(n, generator=g) for n in sizes] + [
        torch.randn(33, 77, generator=g).t(),  # not contiguous
        torch.randn(5, generator=g).double(),
        torch.randn(P + 9, generator=g).bfloat16(),
        torch.tensor([True, False, True]),
        torch.randint(-128, 127, (10,), dtype=torch.int8, generator=g),
        torch.tensor(3.0),
        torch.full((4 * P,), -1.0),
        torch.empty(0),
    ]


def test_fingerprint_is_its_definition_on_every_shape_and_dtype(monkeypatch):
    cases = _cases()
    for t in cases:
        assert torch.equal(tensor_fingerprint([t]), _definition([t])), (t.shape, t.dtype)
    assert torch.equal(tensor_fingerprint(cases), _definition(cases))
    assert torch.equal(tensor_fingerprint([]), torch.zeros(3, dtype=torch.int64))
    monkeypatch.setattr(drift, "BLOCK_ROWS", 2)  # several int32 blocks per tensor, as a > 2**15-row tensor has
    assert torch.equal(tensor_fingerprint(cases), _definition(cases))


def test_cpu_column_sums_equal_the_accelerator_reduction():
    g = torch.Generator().manual_seed(1)
    grid = torch.randint(-(2**15), 2**15, (37, P), dtype=torch.int16, generator=g)
    assert torch.equal(drift.column_sums(grid), grid.sum(0, dtype=torch.int32))
    extreme = torch.full((2**15, 8), -(2**15), dtype=torch.int16)  # the block's worst case: no overflow
    assert int(extreme.sum(0, dtype=torch.int64)[0]) == -(2**30)
    assert torch.equal(drift.column_sums(extreme).to(torch.int64), extreme.sum(0, dtype=torch.int64))


def _positions(n: int) -> list[int]:
    """Every word-row boundary, the tail, both ends and a stride through the rest."""
    edges = {0, 1, n - 1, n - 2}
    for row in range(1, 2 * n // P + 1):
        edges |= {row * P // 2 - 1, row * P // 2, row * P // 2 + 1}
    return sorted(i for i in edges | set(range(0, n, 997)) if 0 <= i < n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_one_ulp_change_of_any_single_element_is_caught(dtype):
    t = torch.randn(2 * P + 1234, generator=torch.Generator().manual_seed(2)).to(dtype)
    t[5] = 0.0  # the smallest step away from zero too
    base = tensor_fingerprint([t])
    up, down = torch.tensor(float("inf"), dtype=dtype), torch.tensor(float("-inf"), dtype=dtype)
    for i in _positions(t.numel()):
        for direction in (up, down):
            u = t.clone()
            u[i] = torch.nextafter(t[i], direction)
            assert not torch.equal(u, t)
            assert tensor_fingerprint([u])[0] != base[0], (i, direction)  # the plain sum alone sees it


def test_a_swap_of_two_different_elements_is_caught():
    g = torch.Generator().manual_seed(3)
    t = torch.randn(256, 1024, generator=g)  # a power-of-two row length, as real weights have
    base = tensor_fingerprint([t])
    flat = t.reshape(-1)
    pairs = [(0, 1), (0, flat.numel() - 1), (100, 100 + 1024), (5, 5 + 64 * 1024), (P // 2 - 1, P // 2)]
    pairs += [(int(i), int(j)) for i, j in torch.randint(0, flat.numel(), (200, 2), generator=g)]
    for i, j in pairs:
        if i == j or flat[i] == flat[j]:
            continue
        u = flat.clone()
        u[i], u[j] = flat[j], flat[i]
        fp = tensor_fingerprint([u])
        assert fp[0] == base[0] and not torch.equal(fp, base), (i, j)  # same sum; the weighted sums see the move
    # two elements whose words' changes cancel (0x3F800010, 0x3F81000F): the linear sum alone misses the swap
    pair = torch.tensor([0x3F800010, 0x3F81000F], dtype=torch.int32).view(torch.float32)
    u = flat.clone()
    u[[10, 4000]] = pair
    v = u.clone()
    v[[10, 4000]] = pair.flip(0)
    a, b = tensor_fingerprint([u]), tensor_fingerprint([v])
    assert a[:2].tolist() == b[:2].tolist() and a[2] != b[2]
    rows = t.clone()
    rows[[3, 200]] = t[[200, 3]]  # two whole rows
    assert not torch.equal(tensor_fingerprint([rows]), base)
    # where it is blind, by construction: two words whose positions agree modulo 65521
    u = flat.clone().view(torch.int16)
    w = flat.view(torch.int16)
    u[7], u[7 + P] = w[7 + P], w[7]
    assert tensor_fingerprint([u.view(torch.float32)]).tolist() == base.tolist()


def test_equal_tensors_give_equal_fingerprints_whatever_the_layout_or_threads():
    g = torch.Generator().manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(300, 400), torch.nn.Linear(400, 30))
    twin = torch.nn.Sequential(torch.nn.Linear(300, 400), torch.nn.Linear(400, 30))
    twin.load_state_dict(model.state_dict())
    opts = [torch.optim.AdamW(m.parameters()) for m in (model, twin)]
    x = torch.randn(8, 300, generator=g)
    for m, opt in zip((model, twin), opts):
        m(x).square().sum().backward()
        opt.step()
    first = fingerprint(model, opts[0])
    torch.set_num_threads(2)  # integer sums: no dependence on the order of the additions
    assert torch.equal(fingerprint(twin, opts[1]), first)
    torch.set_num_threads(1)
    assert not torch.equal(first, torch.zeros(6, dtype=torch.int64))
    t = torch.randn(500, 300, generator=g)
    assert torch.equal(tensor_fingerprint([t.t()]), tensor_fingerprint([t.t().contiguous()]))
    assert torch.equal(tensor_fingerprint([t]), tensor_fingerprint([t.clone()]))
