"""How gradients travel between replicas in each reduce dtype: the codec rules, in one place.

A `Policy`'s ``reduce_dtype`` names the codec; the engines (DDP communication hooks,
``psum`` / ``all_gather`` in JAX) move the bytes. The rules every backend follows:

- ``float32`` / ``float64``: the gradient as it is, summed by the engine;
- ``bfloat16``: cast, summed by the engine in bfloat16, cast back (DDP's
  ``bf16_compress_hook``);
- ``float16``: divided by the replica count *before* the cast, so the sum of
  replicas cannot overflow, summed in float16, cast back (DDP's ``fp16_compress_hook``);
- ``float8_e5m2`` / ``float8_e4m3fn``: each replica multiplies its tensor by a
  power-of-two scale chosen from its own largest magnitude (so the largest value
  lands just under the format's maximum), casts to the 8-bit format, and sends the
  8-bit tensor and its float32 scale; every replica gathers all of them and sums
  the decoded values in float32. Eight-bit values are never accumulated in 8 bits.
  Magnitudes above about 2.98e38 (where no power-of-two scale keeps the format's top
  value within float32) arrive as inf: the step is then skipped, never silently wrong;
- ``table-N`` (N = 1, 2, 4, 8; the AdaPrec study's Table-N): each value becomes a sign bit
  and an (N-1)-bit index into a table of ``2**(N-1)`` magnitudes, the ``99*k/2**(N-1)``-th
  percentiles of the tensor's |values| (k = 1 ... 2**(N-1); Table-1 is the sign and the
  99th percentile), each value rounded to the nearest magnitude; the codes are packed
  ``8/N`` to a byte and sent with the float32 table, gathered, decoded and summed in
  float32. A tensor of zeros stays zero; one that is not all finite sends a NaN table,
  so every replica sees NaN and skips the step.

`wire_bytes` counts what one replica sends for one tensor; `encode_float8` and
`decode_float8` are the reference (numpy and ml_dtypes) the backends are tested against.

>>> wire_bytes(1000, "float32"), wire_bytes(1000, "bfloat16"), wire_bytes(1000, "float8_e5m2")
(4000, 2000, 1004)
"""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np

from mixedpolicy._dtypes import FLOAT8_DTYPES, REDUCE_DTYPES, TABLE_CODECS

#: bytes per element on the wire
ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2,
            "float8_e5m2": 1, "float8_e4m3fn": 1}
#: the largest finite value of each 8-bit format
FLOAT8_MAX = {"float8_e5m2": 57344.0, "float8_e4m3fn": 448.0}
#: bytes of the per-tensor scale an 8-bit tensor travels with
SCALE_BYTES = 4


def _reduce_dtype(reduce_dtype: Any, among: tuple = REDUCE_DTYPES) -> str:
    """`reduce_dtype` if it is one of `among`; else a TypeError (not a string) or ValueError."""
    if not isinstance(reduce_dtype, str) or reduce_dtype not in among:
        raise (ValueError if isinstance(reduce_dtype, str) else TypeError)(
            f"Received reduce_dtype={reduce_dtype!r:.60} of type {type(reduce_dtype).__name__}; "
            f"expected one of {list(among)}.")
    return reduce_dtype


def _bits(bits: Any) -> int:
    """`bits` if it is a table-N codec's N (1, 2, 4 or 8); else a TypeError or ValueError."""
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or bits not in (1, 2, 4, 8):
        raise (ValueError if isinstance(bits, (int, np.integer)) and not isinstance(bits, bool) else TypeError)(
            f"Received bits={bits!r:.60} of type {type(bits).__name__}; expected 1, 2, 4 or 8 (the N of "
            f"a table-N codec: N bits a value, packed whole into bytes).")
    return int(bits)


def is_float8(reduce_dtype: str) -> bool:
    """Is `reduce_dtype` one of the 8-bit float formats (sent with a scale)?"""
    return _reduce_dtype(reduce_dtype) in FLOAT8_DTYPES


def table_bits(reduce_dtype: str) -> int | None:
    """N of a ``table-N`` codec, else None."""
    return int(reduce_dtype.split("-")[1]) if _reduce_dtype(reduce_dtype) in TABLE_CODECS else None


def table_quantiles(bits: int) -> np.ndarray:
    """The percentiles (0-100) whose |values| make a table-N codec's table, ascending."""
    levels = 2 ** (_bits(bits) - 1)
    return 99.0 * np.arange(1, levels + 1) / levels


def wire_bytes(numel: int, reduce_dtype: str) -> int:
    """Bytes one replica sends for a tensor of `numel` elements in `reduce_dtype`.

    Raises:
      TypeError: `numel` is not a whole number >= 0, or `reduce_dtype` not a string.
      ValueError: `reduce_dtype` is not one a policy can reduce in.
    """
    try:
        if isinstance(numel, bool) or operator.index(numel) < 0:
            raise TypeError
    except TypeError:
        raise TypeError(f"Received numel={numel!r:.60} of type {type(numel).__name__}; expected the "
                        f"tensor's number of elements, a whole number >= 0 (tensor.numel()).") from None
    _reduce_dtype(reduce_dtype)
    bits = table_bits(reduce_dtype)
    if bits is not None:
        return -(-numel * bits // 8) + 4 * 2 ** (bits - 1)
    return numel * ITEMSIZE[reduce_dtype] + (SCALE_BYTES if is_float8(reduce_dtype) else 0)


def float8_scale_exponent(amax: float, reduce_dtype: str) -> int:
    """The power of two e such that ``amax * 2**e`` is at most the format's maximum and
    more than half of it (within float32's powers of two); 0 for a tensor of zeros (or one that is not finite: it is sent
    as it is, and the receivers see its inf/NaN, so every replica skips the step)."""
    _reduce_dtype(reduce_dtype, FLOAT8_DTYPES)
    if not (amax > 0 and math.isfinite(amax)):
        return 0
    # within float32's normal powers of two, so the scale itself is finite and exact
    return max(-126, min(126, math.floor(math.log2(FLOAT8_MAX[reduce_dtype] / amax))))


def encode_float8(x: np.ndarray, reduce_dtype: str) -> tuple[np.ndarray, np.float32]:
    """The reference encoder: (the 8-bit tensor, its float32 scale)."""
    import ml_dtypes

    x = np.asarray(x, np.float32)
    amax = float(np.max(np.abs(x))) if x.size else 0.0
    scale = np.float32(2.0 ** float8_scale_exponent(amax, reduce_dtype))
    return (x * scale).astype(getattr(ml_dtypes, reduce_dtype)), scale


def decode_float8(q: np.ndarray, scale: Any) -> np.ndarray:
    """The reference decoder: float32 values of an 8-bit tensor sent with `scale`."""
    with np.errstate(over="ignore"):  # see the module docstring: inf, and the step is skipped
        return np.asarray(q).astype(np.float32) / np.float32(scale)


def encode_table(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """The reference table-N encoder: (the codes packed 8/N to a uint8, the float32 table)."""
    bits = _bits(bits)
    x = np.asarray(x, np.float32).reshape(-1)
    a = np.abs(x)
    if not np.all(np.isfinite(x)):
        table = np.full(2 ** (bits - 1), np.nan, np.float32)
    elif x.size == 0:
        table = np.zeros(2 ** (bits - 1), np.float32)
    else:
        table = np.percentile(a, table_quantiles(bits)).astype(np.float32)
    codes, _ = table_codes(np, x, table, bits)
    return pack_codes(np, codes, bits), table


def decode_table(packed: np.ndarray, table: np.ndarray, bits: int, numel: int) -> np.ndarray:
    """The reference table-N decoder: the float32 values."""
    return table_values(np, unpack(np.asarray(packed, np.uint8), bits, numel), np.asarray(table, np.float32),
                        _bits(bits))


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """N-bit codes (uint8) packed 8/N to a byte, the first code in the lowest bits."""
    return pack_codes(np, np.asarray(codes, np.uint8).reshape(-1), _bits(bits))


def unpack(packed: np.ndarray, bits: int, numel: int) -> np.ndarray:
    """The first `numel` N-bit codes of `pack`'s bytes."""
    return unpack_codes(np, np.asarray(packed, np.uint8), _bits(bits), numel)


# The table-N kernels, written once for an array namespace `xp`: numpy, jax.numpy, or torch's
# backend's `ARRAY_NAMESPACE` (torch with the array API's `astype(x, dtype)` and `pad(x, width)`,
# backends/torch/arrays.py); the backends' reduce hooks call them on the device, the reference
# functions above on the host.

def table_codes(xp: Any, flat: Any, table: Any, bits: int) -> tuple[Any, Any]:
    """(each value's N-bit code, uint8: its sign bit over the index of the nearest magnitude in
    `table`; the index alone), for a 1-D float32 `flat`."""
    index = xp.astype(nearest_index(xp, table, xp.abs(flat)), "uint8")
    return (xp.astype(xp.signbit(flat), "uint8") << (bits - 1)) | index, index


def table_values(xp: Any, codes: Any, table: Any, bits: int) -> Any:
    """The float32 values N-bit `codes` stand for, with `table`'s magnitudes."""
    codes = xp.astype(codes, "int32")
    sign = xp.where((codes >> (bits - 1)) == 1, -1.0, 1.0)
    return xp.astype(sign, "float32") * table[codes & ((1 << (bits - 1)) - 1)]


def pack_codes(xp: Any, codes: Any, bits: int) -> Any:
    """`pack` for `xp`: 1-D uint8 codes packed 8/N to a byte."""
    per = 8 // bits
    lanes = xp.astype(xp.pad(codes, (0, -codes.shape[0] % per)), "int32").reshape(-1, per)
    packed = lanes[:, 0]
    for j in range(1, per):
        packed = packed | (lanes[:, j] << (bits * j))
    return xp.astype(packed, "uint8")


def unpack_codes(xp: Any, packed: Any, bits: int, numel: int) -> Any:
    """`unpack` for `xp`: the first `numel` N-bit codes (uint8) of packed bytes."""
    wide = xp.astype(packed, "int32")
    lanes = [(wide >> (bits * j)) & ((1 << bits) - 1) for j in range(8 // bits)]
    return xp.astype(xp.stack(lanes, 1).reshape(-1)[:numel], "uint8")


def float8_scale(xp: Any, amax: Any, reduce_dtype: str) -> Any:
    """`float8_scale_exponent`'s power-of-two scale, computed where `amax` lives (no host sync),
    for an array namespace `xp` (see `table_codes`): 1 for a tensor of zeros or one that is not finite."""
    ok = xp.isfinite(amax) & (amax > 0)
    exponent = xp.floor(xp.log2(FLOAT8_MAX[reduce_dtype] / xp.where(ok, amax, xp.ones_like(amax))))
    exponent = xp.where(ok, xp.clip(exponent, -126, 126), xp.zeros_like(exponent))
    exponent = xp.astype(exponent, "int32")
    return xp.ldexp(xp.ones_like(amax), exponent)  # exact (XLA's exp2 is not: 2**115 off by 4 ulp)


def nearest_index(xp: Any, table: Any, a: Any) -> Any:
    """The index of the table entry nearest each |value| (ties: the lower), for an array
    namespace `xp` (see `table_codes`). Neighbours are compared by their differences, which
    float32 computes exactly for close values, where a float32 midpoint can round onto a value
    and misplace it."""
    last = table.shape[0] - 1
    hi = xp.searchsorted(table, a)
    hi = xp.clip(hi, 0, last)
    lo = xp.clip(hi - 1, 0, last)
    return xp.where(xp.abs(a - table[lo]) <= xp.abs(table[hi] - a), lo, hi)
