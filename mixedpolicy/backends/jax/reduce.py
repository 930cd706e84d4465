"""Reducing gradients across JAX replicas in a policy's ``reduce_dtype``.

`all_reduce(grads, axis_name, policy)` is called inside ``shard_map`` or ``pmap``, where
the replicas are the named axis: ``psum`` carries float32/bfloat16/float16, and
``all_gather`` carries the 8-bit tensors and their scales, summed in float32 after the
exchange (`mixedpolicy.codecs` gives the rules). Each leaf keeps its own dtype; a
`PolicyMap` gives each leaf the policy of its path (``"dense.kernel"`` inherits from the
layer ``"dense"``; a key may also name leaves, ``"*.bias"``), so a layer's gradients
travel in its own reduce dtype.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mixedpolicy.codecs import (float8_scale, is_float8, pack_codes, table_bits, table_codes, table_quantiles,
                                table_values, unpack_codes, wire_bytes)
from mixedpolicy.layer_plan import attribute_type_at, check_class_keys, reduce_dtypes_at


def _gather_invariant() -> Any:
    """JAX's all_gather whose result shard_map knows to be the same on every replica (so
    ``out_specs=P()`` accepts it): public where JAX exports it, else JAX's own internal
    one, else the plain all_gather (then pass ``check_vma=False`` to shard_map)."""
    found = getattr(jax.lax, "all_gather_invariant", None)
    if found is None:
        try:
            from jax._src.lax.parallel import all_gather_invariant as found
        except ImportError:
            found = jax.lax.all_gather
    return found


def _path(keys: tuple) -> str:
    parts = []
    for k in keys:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


def _reduce_dtypes(grads: Any, policy: Any, model: Any = None) -> tuple[list, list, Any]:
    """(leaves, their reduce dtypes, treedef)."""
    if model is None:
        check_class_keys(policy, "mp.jax.all_reduce without model=",
                         "or pass model= (the module the gradients belong to)")
    flat, treedef = jax.tree_util.tree_flatten_with_path(grads)
    leaves = [leaf for _, leaf in flat]
    for keys, leaf in flat:
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)):
            raise TypeError(f"Received gradients whose leaf {_path(keys) or '(the root)'!r} is a "
                            f"{type(leaf).__name__} ({leaf!r:.40}); expected a pytree of arrays (the "
                            f"gradients jax.grad returns).")
    dtypes = reduce_dtypes_at(policy, [_path(keys) for keys, _ in flat], [type(leaf) for leaf in leaves],
                              type_at=None if model is None else attribute_type_at(model))
    return leaves, dtypes, treedef


def _reduce_leaf(g: Any, reduce_dtype: str, axis_name: Any, count: Any, mean: bool,
                 residual: Any = None) -> tuple[Any, Any]:
    """(the reduced leaf, the new residual: what this replica's codec dropped, or None)."""
    if jnp.iscomplexobj(g):  # in its own dtype, exactly: the reduce dtypes and codecs are real ones
        total = jax.lax.psum(g, axis_name)
        n = count.astype(total.real.dtype)
        return (jax.lax.complex(total.real / n, total.imag / n) if mean else total), residual
    if not jnp.issubdtype(g.dtype, jnp.floating):
        return g, residual
    if residual is not None:  # error feedback: last step's rounding goes out with this one
        g = g.astype(jnp.float32) + residual
    n = count.astype(g.dtype)
    bits = table_bits(reduce_dtype)
    if bits is not None:
        x = g.astype(jnp.float32).reshape(-1)
        total, local = _table_sum(x, bits, axis_name)
        out, local = (total / count if mean else total).reshape(g.shape), local.reshape(g.shape)
    elif is_float8(reduce_dtype):
        x = g.astype(jnp.float32)
        amax = jnp.max(jnp.abs(x)) if g.size else jnp.float32(0)
        scale = float8_scale(jnp, amax, reduce_dtype).astype(jnp.float32)
        q = (x * scale).astype(getattr(jnp, reduce_dtype))
        gather = _gather_invariant()
        qs = gather(q, axis_name)
        scales = gather(scale, axis_name)
        total = jnp.sum(qs.astype(jnp.float32) / scales.reshape((-1,) + (1,) * g.ndim), axis=0)
        out, local = total / count if mean else total, q.astype(jnp.float32) / scale
    elif reduce_dtype == "float16":  # divided before the cast: the sum cannot overflow
        sent = (g / n).astype(jnp.float16)
        total = jax.lax.psum(sent, axis_name).astype(g.dtype)
        out, local = total if mean else total * n, sent.astype(g.dtype) * n
    else:
        sent = g.astype(jnp.dtype(reduce_dtype))
        total = jax.lax.psum(sent, axis_name).astype(g.dtype)
        out, local = total / n if mean else total, sent.astype(g.dtype)
    new_residual = None if residual is None else (g.astype(jnp.float32) - local.astype(jnp.float32))
    return out.astype(g.dtype) if residual is None else out, new_residual


def _table_sum(flat: Any, bits: int, axis_name: Any) -> tuple[Any, Any]:
    """(the float32 sum over replicas of `flat`, each replica's sent as table-N codes; what
    this replica's codes decode to)."""
    a = jnp.abs(flat)
    finite = jnp.all(jnp.isfinite(flat))
    q = jnp.asarray(table_quantiles(bits), jnp.float32)
    table = jnp.percentile(jnp.where(jnp.isfinite(a), a, 0.0), q) if flat.size else jnp.zeros_like(q)
    table = jnp.where(finite, table, jnp.nan).astype(jnp.float32)  # NaN: every replica skips
    codes, _ = table_codes(jnp, flat, table, bits)
    gather = _gather_invariant()
    all_packed, all_tables = gather(pack_codes(jnp, codes, bits), axis_name), gather(table, axis_name)
    total = sum(table_values(jnp, unpack_codes(jnp, all_packed[r], bits, flat.size), all_tables[r], bits)
                for r in range(all_packed.shape[0]))
    return total, table_values(jnp, codes, table, bits)


def replica_count(axis_name: Any) -> Any:
    """The number of replicas over `axis_name` (float32), or a clear error where it names no
    mapped axis: a wrong type, or a call outside the ``shard_map`` / ``pmap`` that binds it."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise TypeError(f"Received axis_name={axis_name!r}; expected the name (a non-empty str), or a "
                        f"tuple of names, of the shard_map / pmap axis the replicas run over.")
    try:
        return jax.lax.psum(jnp.float32(1.0), axis_name)
    except NameError as err:
        raise ValueError(f"Received axis_name={axis_name!r}, which no enclosing shard_map or pmap binds "
                         f"({err}). Call all_reduce inside the mapped step, with the axis name given there "
                         f"(jax.shard_map(..., axis_names={{{names[0]!r}}}) or jax.pmap(..., "
                         f"axis_name={names[0]!r})).") from None


def all_reduce(grads: Any, axis_name: Any, policy: Any = None, *, mean: bool = True,
               residual: Any = None, model: Any = None) -> Any:
    """Reduces a gradient pytree over the replicas of `axis_name` in the policy's reduce dtype.

    Call it inside ``shard_map`` or ``pmap``, where `axis_name` is bound.

    Args:
      grads: a pytree of gradients (a complex leaf is reduced in its own dtype; integer and
        boolean leaves pass unchanged).
      axis_name: the replica axis (a name or a tuple of names).
      policy: a `Policy`, its name, or a `PolicyMap` resolved by each leaf's path;
        None uses the global policy.
      mean: the mean over replicas (as DDP averages), else the sum.
      residual: error feedback (off by default): a float32 pytree like `grads`, what the
        codecs dropped at the last step (zeros at the first, ``jax.tree.map(jnp.zeros_like,
        grads)``); it is added to this step's gradients before they are encoded.
      model: the Flax NNX or Equinox module the gradients belong to (gradient paths are
        read as attribute paths inside it), so that a `PolicyMap`'s layer-class keys name
        its layers as in `apply_policy`; a map with class keys that decide a reduce dtype
        is refused without it.

    Returns:
      The reduced gradients, each leaf in its own dtype; with `residual`, the pair
      (reduced gradients in float32, the new residual to pass at the next step).

    Raises:
      TypeError: `policy` is none of those, `residual` is not shaped like `grads`, or
        `axis_name` is not a name.
      ValueError: `policy` has layer-class keys that decide a reduce dtype, and no `model`;
        `axis_name` is bound by no enclosing ``shard_map`` or ``pmap``.
    """
    from mixedpolicy.scope import global_policy

    leaves, dtypes, treedef = _reduce_dtypes(grads, global_policy() if policy is None else policy, model)
    residuals = [None] * len(leaves)
    if residual is not None:
        residuals, rtree = jax.tree_util.tree_flatten(residual)
        if rtree != treedef:
            raise TypeError(f"Received a residual of structure {rtree}; expected one like the "
                            f"gradients, {treedef} (start with jax.tree.map(jnp.zeros_like, grads)).")
    count = replica_count(axis_name)
    pairs = [_reduce_leaf(g, d, axis_name, count, mean, r) for g, d, r in zip(leaves, dtypes, residuals)]
    out = jax.tree_util.tree_unflatten(treedef, [p[0] for p in pairs])
    if residual is None:
        return out
    return out, jax.tree_util.tree_unflatten(treedef, [p[1] for p in pairs])


def bytes_per_step(grads: Any, policy: Any = None, *, model: Any = None) -> int:
    """Bytes one replica sends to reduce `grads` once (floating leaves; scales included; a complex
    leaf in its own dtype; `model` as for `all_reduce`)."""
    from mixedpolicy.scope import global_policy

    leaves, dtypes, _ = _reduce_dtypes(grads, global_policy() if policy is None else policy, model)
    return sum(int(g.size) * g.dtype.itemsize if jnp.iscomplexobj(g) else wire_bytes(int(g.size), d)
               for g, d in zip(leaves, dtypes) if jnp.issubdtype(jnp.asarray(g).dtype, jnp.inexact))
