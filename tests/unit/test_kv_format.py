"""The KV cache's row formats against independent references: fp8 e4m3 against the format's own definition (every
one of its 256 codes, and torch's saturating cast), int8 rows against a float64 quantizer written here."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tokenmill.model import kv_format


def _e4m3_value(bits: int) -> float:
    """The OCP fp8 e4m3 (``fn``: no infinities, S.1111.111 the only NaN) value of a byte, from its definition."""
    sign = -1.0 if bits & 0x80 else 1.0
    exponent, mantissa = (bits >> 3) & 0xF, bits & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def test_fp8_rows_decode_as_the_format_defines_every_code() -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    got = kv_format.decode(codes, torch.float64).tolist()
    want = [_e4m3_value(b) for b in range(256)]
    for b, (g, w) in enumerate(zip(got, want)):
        assert (math.isnan(g) and math.isnan(w)) or g == w, b


def test_fp8_rows_round_to_the_nearest_code_and_saturate() -> None:
    grid = np.array(sorted({v for v in map(_e4m3_value, range(256)) if not math.isnan(v)}))
    x = torch.cat([torch.randn(4000) * 40, torch.tensor([500.0, -1e6, 448.0, 1e-4, -3e-3])])
    got = kv_format.decode(kv_format.encode(x, torch.float8_e4m3fn), torch.float64).numpy()
    clipped = np.clip(x.double().numpy(), -448, 448)
    nearest = np.abs(clipped[:, None] - grid[None, :]).min(axis=1)
    assert np.all(np.abs(got - clipped) <= nearest + 1e-12)  # a nearest code (ties either way)
    assert got[-5] == 448.0 and got[-4] == -448.0


@pytest.mark.parametrize("head_dim", [64, 128, 7])
def test_int8_rows_hold_codes_and_their_scale(head_dim: int) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    x = torch.randn(5, 3, head_dim, generator=gen) * torch.tensor([0.01, 1.0, 300.0])[None, :, None]
    x[0, 0] = 0.0  # a zero row: scale 0, codes 0
    rows = kv_format.encode(x, torch.int8)
    assert rows.shape == (5, 3, kv_format.row_width(head_dim, torch.int8)) == (5, 3, head_dim + 4)
    assert kv_format.head_dim_of(rows) == head_dim
    xd = x.double().numpy()
    scale = np.abs(xd).max(axis=-1, keepdims=True) / 127  # the float64 reference
    codes = np.where(scale > 0, np.rint(xd / np.where(scale > 0, scale, 1)), 0)
    stored_scale = rows[..., head_dim:].contiguous().view(torch.float32).double().numpy()
    np.testing.assert_allclose(stored_scale, scale, rtol=1e-6)
    got_codes = rows[..., :head_dim].numpy().astype(np.int64)
    assert np.abs(got_codes - codes).max() <= 1  # fp32 division against float64: a tie may go the other way
    assert (got_codes == codes).mean() > 0.999
    assert np.abs(got_codes).max() == 127 and (got_codes[0, 0] == 0).all() and stored_scale[0, 0] == 0
    back = kv_format.decode(rows, torch.float64).numpy()
    assert np.all(np.abs(back - xd) <= scale * 0.5 * (1 + 1e-5) + 1e-30)  # half a code


def test_wider_formats_are_the_values_themselves() -> None:
    x = torch.randn(4, 2, 16)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert torch.equal(kv_format.encode(x, dtype), x.to(dtype))
        assert kv_format.row_width(16, dtype) == 16 == kv_format.head_dim_of(x.to(dtype))
    cache = torch.zeros(3, 16, dtype=torch.float8_e4m3fn)
    assert kv_format.as_storage(cache).dtype == torch.uint8
    assert kv_format.as_storage(cache).data_ptr() == cache.data_ptr()  # a view, not a copy
