"""Stochastic rounding into bfloat16 on torch: the counter-based hash the optax and Keras rules
draw their bits from, and the rounding of a flat float32 buffer with it.

On a GPU the hash and the rounding of a chunk run as one kernel that ``torch.compile`` writes
(`round_flat_`); elsewhere, and where no compiler is at hand, as a few int32 ops per chunk: on a
CPU numpy's uint32 ops on the tensors' own memory (torch's CPU integer kernels cost two to three
times as much a pass there, with one thread), torch's where its threads share a large chunk. All
compute the same bits: the hash is integer arithmetic, exact in any order.
"""

from __future__ import annotations

import functools
import itertools
import logging
from typing import Any, Iterator

log = logging.getLogger("mixedpolicy")

# murmur3's finaliser and the golden-ratio step: the counter-based hash the optax and Keras rules
# use, so one model rounds alike on torch, optax and Keras. Here in int32 arithmetic, whose
# products wrap modulo 2**32 as the rules' masked arithmetic does (right shifts masked to be
# logical), over all of a step's parameters at once: a handful of ops per step, not per parameter
_MASK, _GOLDEN, _M1, _M2, _VARIABLE, _SEED = 0xFFFFFFFF, 0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35, 668265261, 0x5EED
_SLICED = {"cpu"}  # devices where a parameter's terms are added slice by slice (small ops are cheap)
_CHUNK = 1 << 24  # elements hashed at once: bounds the int32 temporaries (and keeps indices < 2**31)
_NUMPY_UP_TO = 1 << 20  # a CPU chunk hashed by numpy (single-threaded) when torch has several threads


def _int32(value: int) -> int:
    """The int32 with the bits of the uint32 `value`."""
    value &= _MASK
    return value - (1 << 32) if value >= 1 << 31 else value


# murmur3's 32-bit finaliser as (right shift, the mask that makes it logical, the factor after)
_FINALISER = ((16, 0xFFFF, _int32(_M1)), (13, 0x7FFFF, _int32(_M2)), (16, 0xFFFF, None))


def _mix_(h: Any, tmp: Any) -> Any:
    """murmur3's 32-bit finaliser, in place on an int32 tensor (`tmp`: scratch of its size)."""
    import torch

    for shift, mask, factor in _FINALISER:
        h.bitwise_xor_(torch.bitwise_right_shift(h, shift, out=tmp).bitwise_and_(mask))  # a logical shift
        if factor is not None:
            h.mul_(factor)
    return h


def random_bits16_all(sizes: list, indices: list, step: Any, device: Any = None, seed: int = _SEED) -> list:
    """16 random bits per element of each of several flat tensors (int32, one tensor each);
    `step` a Python int or an integer tensor on `device` (read there). No host sync and no copy
    from the host: what does not change from step to step is built once per device."""
    return [bits for h, chunk_sizes in _bits_by_chunk(sizes, indices, step, device, seed)
            for bits in h.split(chunk_sizes)]


def _bits_by_chunk(sizes: list, indices: list, step: Any, device: Any = None, seed: int = _SEED) -> Iterator:
    """`random_bits16_all`'s bits as they are made: (one int32 tensor for consecutive
    parameters, their sizes), chunk after chunk."""
    import torch

    if torch.is_tensor(step):
        step_term = step.to(device=device, dtype=torch.int32) * _int32(_GOLDEN)
    else:
        step_term = _int32(int(step) * _GOLDEN)  # an int32 scalar: added as a kernel argument
    where = torch.device(device or "cpu")
    sliced = where.type in _SLICED
    for total, chunk_sizes, terms, on_device in _chunks(tuple(sizes), tuple(indices), str(where), seed, _CHUNK,
                                                        sliced):
        if _by_numpy(where, step, total):
            yield torch.from_numpy(_hash_numpy(total, terms, _int32(int(step) * _GOLDEN)).view("int32")), chunk_sizes
            continue
        h = torch.arange(total, dtype=torch.int32, device=where).mul_(_int32(_GOLDEN))
        tmp = torch.empty_like(h)  # one scratch tensor for both finalisers
        for stage in (0, 1):  # the element's hash input, then the finalised value plus the start
            if sliced:  # a CPU: each parameter's term added to its slice (an op each)
                for offset, size, term in zip(*terms[stage]):
                    piece = h[offset:offset + size]
                    piece.add_(term).add_(step_term) if torch.is_tensor(step_term) else piece.add_(
                        _int32(term + step_term))
            else:  # one op for all: the terms repeated to each element
                shift, counts = on_device[stage], on_device[2]
                h.add_(shift.add(step_term).repeat_interleave(counts, output_size=total))
            _mix_(h, tmp)
        yield h.bitwise_and_(0xFFFF), chunk_sizes


def _by_numpy(where: Any, step: Any, total: int) -> bool:
    """Hash this chunk with numpy? On a CPU, for a Python step or one on the CPU (read there for
    nothing: Keras's iterations), eagerly (not while dynamo traces), where torch's kernels run
    on one thread or the chunk is small enough for one to do it."""
    import torch

    return (where.type == "cpu" and (not torch.is_tensor(step) or step.device.type == "cpu")
            and not torch.compiler.is_compiling() and (torch.get_num_threads() == 1 or total <= _NUMPY_UP_TO))


def _hash_numpy(total: int, terms: tuple, step_term: int) -> Any:
    """`_bits_by_chunk`'s bits of one chunk in numpy uint32 arithmetic, which wraps as the hash's
    does and shifts logically (no masks): the same bits, fewer and cheaper passes on a CPU."""
    import numpy as np

    h = np.arange(total, dtype=np.uint32)
    h *= np.uint32(_GOLDEN)
    tmp = np.empty_like(h)
    for stage in (0, 1):
        for offset, size, term in zip(*terms[stage]):
            h[offset:offset + size] += np.uint32((term + step_term) & _MASK)
        for shift, _, factor in _FINALISER:  # murmur3's finaliser
            h ^= np.right_shift(h, shift, out=tmp)
            if factor is not None:
                h *= np.uint32(factor & _MASK)
    h &= np.uint32(0xFFFF)
    return h


@functools.lru_cache(maxsize=16)
def _chunks(sizes: tuple, indices: tuple, device: str, seed: int, chunk: int, sliced: bool) -> tuple:
    """The parameters in chunks of at most `chunk` elements (a larger one alone), each as (its
    elements, its parameters' sizes, the hash's per-parameter terms without the step's as
    (offsets, sizes, terms) for each stage, and unless `sliced` the terms, sizes and offsets as
    tensors on `device`): int32 arithmetic wraps as the hash's uint32 arithmetic does."""
    import torch

    chunks, i = [], 0
    while i < len(sizes):
        j, total = i + 1, sizes[i]
        while j < len(sizes) and total + sizes[j] <= chunk:
            total, j = total + sizes[j], j + 1
        # start_p = step * golden + base_p; element k of parameter p hashes k * golden + start_p,
        # over the chunk its flat position times golden plus (start_p - offset_p * golden), mod 2**32
        bases = [(index * _VARIABLE + seed) & 0x7FFFFFFF for index in indices[i:j]]
        offsets = [0, *itertools.accumulate(sizes[i:j - 1])]
        shifts, starts = [_int32(b - o * _GOLDEN) for b, o in zip(bases, offsets)], [_int32(b) for b in bases]
        terms = ((offsets, sizes[i:j], shifts), (offsets, sizes[i:j], starts))
        on_device = None if sliced else (
            *torch.tensor([shifts, starts], dtype=torch.int32).to(device), torch.tensor(sizes[i:j]).to(device),
            torch.tensor(offsets, dtype=torch.int32).to(device))
        chunks.append((total, list(sizes[i:j]), terms, on_device))
        i = j
    return tuple(chunks)


def random_bits16(shape: tuple, step: int, index: int, device: Any = None, seed: int = _SEED) -> Any:
    """16 random bits per element (int32 in [0, 65536)): the hash of the element's position, the
    step, the parameter's index and the seed that the optax and Keras rules draw."""
    size = 1
    for d in shape:
        size *= int(d)
    return random_bits16_all([size], [index], step, device, seed)[0].reshape(shape)


def stochastic_round_bfloat16(x: Any, bits16: Any) -> Any:
    """float32 `x` rounded into bfloat16 up or down with the probability of its remainder."""
    import torch

    pattern = x.float().view(torch.int32)
    cut = (pattern + bits16) & -65536  # 0xFFFF0000 as int32
    return cut.view(torch.float32).to(torch.bfloat16)  # exact: the low half is zero


def _mix(h: Any) -> Any:
    """`_mix_` without the scratch tensor, as one expression a compiler fuses."""
    for shift, mask, factor in _FINALISER:
        h = h ^ ((h >> shift) & mask)
        if factor is not None:
            h = h * factor
    return h


def _round_chunk_(x: Any, offsets: Any, shifts: Any, starts: Any, step_term: int) -> None:
    """Rounds the float32 values whose bits are the int32 tensor `x` (one chunk of parameters, at
    `offsets`) in place, each parameter's bits its own hash: the hash and the rounding in one
    pass over `x`, where ``_bits_by_chunk`` writes the chunk's bits in a few."""
    import torch

    k = torch.arange(x.numel(), dtype=torch.int32, device=x.device)
    p = torch.bucketize(k, offsets, out_int32=True, right=True) - 1  # the parameter of each element
    h = _mix(k * _int32(_GOLDEN) + shifts[p] + step_term)
    h = _mix(h + starts[p] + step_term)
    x.copy_((x + (h & 0xFFFF)) & -65536)  # 0xFFFF0000 as int32


@functools.lru_cache(maxsize=1)
def _compiled() -> Any:
    """`_round_chunk_` compiled once for every chunk size and step (None where torch cannot
    compile for the GPU: no Triton)."""
    import torch

    try:
        from torch.utils._triton import has_triton
    except ImportError:  # pragma: no cover - every torch this package supports has it
        return None
    return torch.compile(_round_chunk_, dynamic=True, fullgraph=True) if has_triton() else None


_FUSED = {"cuda"}  # devices where a chunk is rounded by the compiled kernel


def round_flat_(flat: Any, sizes: list, indices: list, step: int, device: Any) -> None:
    """Rounds the float32 buffer `flat` (the parameters of `sizes`, numbered `indices`, one after
    another) in place to values bfloat16 holds exactly, up or down with the probability of each
    remainder, with the bits the hash gives these parameters at `step`."""
    import torch

    where = torch.device(device or "cpu")
    fused = _compiled() if where.type in _FUSED else None
    start = 0
    if fused is not None:
        step_term = _int32(int(step) * _GOLDEN)
        try:
            for total, _, _, on_device in _chunks(tuple(sizes), tuple(indices), str(where), _SEED, _CHUNK, False):
                fused(flat[start:start + total].view(torch.int32), on_device[3], on_device[0], on_device[1],
                      step_term)
                start += total
            return
        except Exception as error:  # a compiler that fails here (a missing toolchain): the ops below
            _FUSED.discard(where.type)
            log.warning("mixedpolicy: torch.compile could not build or run the stochastic-rounding kernel on %s "
                        "(%s: %s); rounding with separate ops, slower and the same bits", where, type(error).__name__,
                        error)
    rounded, start = start, 0  # the chunks the kernel rounded before it failed stay as they are
    for h, _ in _bits_by_chunk(sizes, indices, step, where):
        if start >= rounded:
            flat[start:start + h.numel()].view(torch.int32).add_(h).bitwise_and_(-65536)
        start += h.numel()
