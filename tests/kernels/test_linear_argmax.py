import pytest
import torch

from draftheads.kernels.linear_argmax import linear_argmax


@pytest.mark.parametrize("rows,chunk", [(5, 1024), (5, 2), (123, 7), (0, 4)])
def test_chunked_argmax_equals_the_whole_product(rows, chunk):
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(rows, 16, generator=g), torch.randn(123, 16, generator=g)
    got, want = linear_argmax(h, w, chunk), (h @ w.T).argmax(-1)
    bad = (got != want).nonzero().flatten().tolist()
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert not bad, f"rows {bad}: got {got[bad].tolist()}, want {want[bad].tolist()}"
