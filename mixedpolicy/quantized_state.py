"""8-bit block-quantized optimizer state (a policy's ``optimizer_state_dtype="int8"``): the code
maps and the kernels, written once over an array namespace (numpy, ``jax.numpy``).

A moment is cut into blocks of `BLOCK` consecutive values; each block keeps its largest
magnitude (float32) and one byte per value, the index of the nearest entry of a 256-entry map
of the values in [-1, 1] (or [0, 1]) that the block's values divided by that magnitude are
rounded to. The maps are dynamic, as the 8-bit optimizers' (bitsandbytes, torchao) are:
finely spaced near the block's largest magnitude and reaching seven decades below it, so a
second moment's small entries (which divide the update) are not zeroed as a linear int8 grid
would zero them. A moment with no negative entry (Adam's second moment) uses the unsigned
map, twice as fine. Only moments of at least `MIN_SIZE` values whose size is a multiple of
`BLOCK` are quantized (torchao's rule); smaller ones keep their dtype: 2.03 bytes per Adam
parameter for the two moments of a large layer, against 8 in float32.

>>> import numpy as np
>>> x = np.linspace(-1.0, 1.0, 4096, dtype=np.float32) ** 3
>>> codes, absmax = quantize(np, x, signed=True)
>>> codes.dtype, codes.shape, absmax.shape
(dtype('uint8'), (4096,), (16,))
>>> bool(np.abs(dequantize(np, codes, absmax, signed=True) - x).max() < 0.01)
True
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: values per block, each block with its own float32 largest magnitude
BLOCK = 256
#: moments smaller than this stay in their dtype (their bytes are not worth a block's scale)
MIN_SIZE = 4096
_DECADES = 7


def _magnitudes(per_decade_top: int) -> np.ndarray:
    """1 and, in each decade ``[10**-(k+1), 10**-k)`` (k = 0 ... 6), ``per_decade_top / 2**k``
    values at the centres of equal bins: fine near 1, coarse seven decades below."""
    out = [1.0]
    for k in range(_DECADES):
        n = per_decade_top >> k
        edges = np.linspace(10.0 ** -(k + 1), 10.0 ** -k, n + 1)
        out.extend((edges[:-1] + edges[1:]) / 2)
    return np.sort(np.asarray(out, np.float64))


def code_map(signed: bool) -> np.ndarray:
    """The 256 sorted float32 values codes stand for: zero, 128 positive magnitudes and 127
    negative ones (signed), or zero and 255 magnitudes (unsigned)."""
    if signed:
        pos = _magnitudes(64)  # 128 values
        values = np.concatenate([-pos[1:][::-1], [0.0], pos])
    else:
        values = np.concatenate([[0.0], _magnitudes(128)])  # 255 + zero
    assert values.size == 256, values.size
    return values.astype(np.float32)


_MAPS = {signed: code_map(signed) for signed in (True, False)}
_MIDPOINTS = {signed: ((m[:-1] + m[1:]) / 2).astype(np.float32) for signed, m in _MAPS.items()}


def quantizable(shape: tuple) -> bool:
    """Whether a moment of this shape is stored in 8 bits (else it keeps its dtype)."""
    size = int(np.prod(shape)) if shape else 1
    return size >= MIN_SIZE and size % BLOCK == 0


def quantize(xp: Any, x: Any, signed: Any) -> tuple[Any, Any]:
    """(codes, absmax): `x`'s uint8 codes in its own shape and the float32 largest magnitude of
    each block of `BLOCK` values. `signed` picks the map (a bool, or a boolean scalar array
    under a trace: then both maps are searched and one is selected)."""
    blocks = xp.reshape(xp.astype(x, xp.float32), (-1, BLOCK))
    absmax = xp.max(xp.abs(blocks), axis=1)
    safe = xp.where(absmax > 0, absmax, xp.ones_like(absmax))
    normed = blocks / safe[:, None]

    def codes(which: bool) -> Any:
        return xp.searchsorted(xp.asarray(_MIDPOINTS[which]), normed)

    if isinstance(signed, (bool, np.bool_)):
        idx = codes(bool(signed))
    else:
        idx = xp.where(signed, codes(True), codes(False))
    return xp.reshape(xp.astype(idx, xp.uint8), x.shape), absmax


def dequantize(xp: Any, codes: Any, absmax: Any, signed: Any) -> Any:
    """The float32 values `codes` and `absmax` (from `quantize`) stand for, in the codes' shape."""
    table = (xp.asarray(_MAPS[bool(signed)]) if isinstance(signed, (bool, np.bool_))
             else xp.where(signed, xp.asarray(_MAPS[True]), xp.asarray(_MAPS[False])))
    idx = xp.astype(xp.reshape(codes, (-1, BLOCK)), xp.int32)
    values = xp.take(table, idx) * absmax[:, None]
    return xp.reshape(values, codes.shape)
