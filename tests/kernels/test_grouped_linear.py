"""hybrid.kernels.grouped_linear: each group of rows times its own weight, the numbers of a
dense linear of those rows (fp32, and bf16 by the linear's own path), a group without
rows skipped with no gradient, and a mismatch of counts one error."""

import pytest
import torch

from hybrid.kernels.grouped_linear import grouped_linear
from hybrid.kernels.linear import linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_group_is_its_dense_linear_and_an_empty_group_takes_no_gradient(dtype):
    torch.manual_seed(0)
    counts = [3, 0, 5, 1]
    x = torch.randn(9, 16, dtype=dtype, requires_grad=True)
    weights = [torch.randn(8, 16, dtype=dtype, requires_grad=True) for _ in counts]
    y = grouped_linear(x, counts, weights)
    starts = [0, 3, 3, 8]
    want = torch.cat([linear(x[s: s + n], w) for s, n, w in zip(starts, counts, weights) if n])
    assert torch.equal(y, want)
    y.sum().backward()
    assert weights[1].grad is None and all(w.grad is not None for i, w in enumerate(weights)
                                           if i != 1)
    assert torch.equal(weights[2].grad, (torch.ones(5, 8, dtype=dtype).t() @ x[3:8]).to(dtype))


def test_no_rows_at_all_and_a_mismatch():
    w = [torch.randn(4, 6), torch.randn(4, 6)]
    assert grouped_linear(torch.randn(0, 6), [0, 0], w).shape == (0, 4)
    with pytest.raises(ValueError, match="2 groups of 3 rows for 2 weights and 4 rows"):
        grouped_linear(torch.randn(4, 6), [1, 2], w)
