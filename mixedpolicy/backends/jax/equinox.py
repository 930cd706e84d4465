"""Policies on Equinox modules: immutable pytrees, so `apply_policy` returns a new one.

Equinox layers take no compute ``dtype``, so a policy acts as jmp's casts do, on
each module, as Haiku's per-module jmp policies do. `apply_policy` rebuilds the
module tree with every module wrapped in a `PolicyModule` and its arrays in the
module's variable dtype. A `PolicyModule`'s ``__call__`` (and any other method
of the module it wraps) casts that module's own floating arrays and floating
inputs to its compute dtype, runs it, and casts floating outputs to the output
dtype where that differs from the compute dtype (elsewhere outputs leave as the
layers make them, as in Flax). Every module casting its own inputs keeps a float32
override or a float32 norm from feeding the wrong dtype to the next layer. The
casts sit inside the call, so gradients with respect to the float32 parameters
come back float32, under ``eqx.filter_jit`` / ``jax.jit`` or not; casts to a
dtype an array already has cost nothing.

Under an fp8 policy (``tensorwise``) each chosen ``eqx.nn.Linear`` computes ``weight @ x``
through the fp8 matmul of float8_matmul.py, whose scales see the whole batch although the
layer sees one example under ``jax.vmap``; the built-in rules keep embeddings, norms, the last
``Linear`` (the head) and sizes that are not multiples of 16 in the source precision, as on NNX.

Layer paths are attribute paths joined with dots (``"layers.0"``, ``"attn.query_proj"``),
as ``jax.tree_util`` names them. ``eqx.nn.State`` arguments and results (BatchNorm
statistics) pass through uncast, as do integer, boolean and key arrays.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax

from mixedpolicy._adapter import ModelAdapter
from mixedpolicy.backends.jax.arrays import Kept, cast_leaf, dtype_name, restore_leaf
from mixedpolicy.backends.jax.float8_matmul import matmul
from mixedpolicy.float8 import Float8Recipe
from mixedpolicy.table import NOT_APPLIED, LayerPolicy
from mixedpolicy.policy import Policy
from mixedpolicy.layer_plan import plan
from mixedpolicy.policy_map import EMBEDDING, HEAD, NO_FLOAT8, NORMALIZATION, SMALL_MATMUL, LayerInfo, PolicyMap

_NORMS = tuple(getattr(eqx.nn, n) for n in ("LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm")
               if hasattr(eqx.nn, n))


def _kind(module: Any, head: Any) -> str | None:
    """The built-in rules' kind of a module: norms; and what fp8 keeps in the source precision."""
    if isinstance(module, _NORMS):
        return NORMALIZATION
    if isinstance(module, eqx.nn.Embedding):
        return EMBEDDING
    if _runs_float8(module):
        if module is head:
            return HEAD
        return SMALL_MATMUL if any(n % 16 for n in _matmul_sizes(module)) else None
    own = [x for _, x in _children(module)[0] if not isinstance(x, eqx.Module)]
    return NO_FLOAT8 if any(hasattr(x, "dtype") for x in own) else None


def _runs_float8(module: Any) -> bool:
    return type(module) is eqx.nn.Linear


def _matmul_sizes(module: Any) -> tuple:
    """(in, out) of an ``eqx.nn.Linear`` ("scalar" is a size of 1)."""
    return tuple(1 if n == "scalar" else int(n) for n in (module.in_features, module.out_features))


def _head(model: Any) -> Any:
    """The output head: the last ``eqx.nn.Linear`` in attribute order (None if there is none)."""
    found = [m for m, _ in _walk(model, "", ()) if _runs_float8(m)]
    return found[-1] if found else None


def _float8_linear(linear: Any, x: Any, recipe: Float8Recipe) -> Any:
    """``eqx.nn.Linear.__call__`` with ``weight @ x`` in fp8: `x` of shape (in,) or () ("scalar")."""
    n_in, n_out = _matmul_sizes(linear)
    if x.shape not in ((n_in,), ()) or (x.shape == () and linear.in_features != "scalar"):
        raise ValueError(f"Received an input of shape {x.shape} for the fp8 eqx.nn.Linear "
                         f"{n_in} -> {n_out}; expected one example of shape ({n_in},): call it "
                         f"under jax.vmap over the batch, as for the plain layer.")
    w = linear.weight.reshape(n_out, n_in)
    a = x.reshape(1, n_in)
    out = matmul(a, w.T, recipe.forward_dtype, recipe.backward_dtype, str(a.dtype), str(w.dtype), 1)
    out = out.reshape(n_out) + linear.bias if linear.use_bias else out.reshape(n_out)
    return out.reshape(()) if linear.out_features == "scalar" else out


def _join(path: str, keys: tuple) -> str:
    """`path` extended by a key path, dotted: ("blocks", [0], .linear) -> "blocks.0.linear"."""
    tail = jax.tree_util.keystr(keys, simple=True, separator=".")
    return f"{path}.{tail}" if path and tail else path or tail


def _kept_whole(x: Any) -> bool:
    """A layer (a callable module) or a state key: never flattened into its parent's arrays."""
    return isinstance(x, eqx.Module) and (callable(x) or isinstance(x, eqx.nn.StateIndex))


def _children(module: Any) -> tuple[list, Any]:
    """(key path, leaf) pairs of `module`'s own arrays and its layers (kept whole), and the treedef.

    A module without ``__call__`` that holds arrays for its parent counts as part of
    the parent; a ``StateIndex`` (BatchNorm's key into ``eqx.nn.State``) is kept as it is.
    """
    return jax.tree_util.tree_flatten_with_path(module, is_leaf=lambda x: x is not module and _kept_whole(x))


def _cast(tree: Any, dtype: str) -> Any:
    """Casts floating arrays of inputs or outputs; modules and ``eqx.nn.State`` stay as they are."""
    keep = (eqx.Module, eqx.nn.State)
    return jax.tree_util.tree_map(lambda x: x if isinstance(x, keep) else cast_leaf(x, dtype),
                                  tree, is_leaf=lambda x: isinstance(x, keep))


class PolicyModule(eqx.nn.StatefulLayer):
    """An Equinox module run under a policy; made by `mixedpolicy.apply_policy`.

    Calling it (or any method of the wrapped module, read through it) casts the
    module's own floating arrays and floating inputs to the compute dtype and,
    where the policy's output dtype differs, floating outputs to the output dtype.
    Its submodules are `PolicyModule`s too, each casting its own arrays. Other
    attributes read through to the module. Its ``is_stateful()`` is the module's
    (False for a module that is no ``StatefulLayer``), so ``eqx.nn.Sequential``
    passes state exactly as before.

    Attributes:
      module: the wrapped Equinox module (its arrays in the variable dtype).
      policy: its policy.
      source: where the policy came from (global, map key, built-in rule).
      casts: (array path within the module, dtype before) for each array cast.
      originals: the values of those arrays before the cast (kept aside, not a leaf),
        so `remove_policy` gives back every value not changed since.
    """

    module: Any
    policy: Policy = eqx.field(static=True)
    source: str = eqx.field(static=True)
    casts: tuple = eqx.field(static=True, default=())
    originals: Any = eqx.field(static=True, default=None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._run("__call__", args, kwargs)

    def is_stateful(self) -> bool:
        module = self.module
        return isinstance(module, eqx.nn.StatefulLayer) and module.is_stateful()

    def _run(self, method: str, args: tuple, kwargs: dict) -> Any:
        policy = self.policy
        leaves, treedef = _children(self.module)  # its own arrays; submodules cast theirs
        module = jax.tree_util.tree_unflatten(treedef, [
            x if isinstance(x, eqx.Module) else cast_leaf(x, policy.compute_dtype) for _, x in leaves])
        if method == "__call__" and isinstance(self.module, (eqx.nn.GRUCell, eqx.nn.LSTMCell)) and (
                len(args) > 1 or "hidden" in kwargs):
            # a recurrent cell's hidden state is the carry a scan threads through: passed as it
            # comes (as casting the cell's arrays by hand leaves it) and given back in its dtypes
            positional = len(args) > 1
            hidden = args[1] if positional else kwargs.pop("hidden")
            (first, rest), kwargs = _cast(((args[:1], args[2:]), kwargs), policy.compute_dtype)
            if positional:
                out = getattr(module, method)(*first, hidden, *rest, **kwargs)
            else:
                out = getattr(module, method)(*first, *rest, hidden=hidden, **kwargs)
            return jax.tree_util.tree_map(lambda new, old: new.astype(old.dtype), out, hidden)
        args, kwargs = _cast((args, kwargs), policy.compute_dtype)
        x = args[0] if args else kwargs.get("x")
        if policy.float8_recipe is not None and method == "__call__" and _runs_float8(module) and x is not None:
            out = _float8_linear(module, x, policy.float8_recipe)
        else:
            out = getattr(module, method)(*args, **kwargs)
        if policy.output_dtype == policy.compute_dtype:
            return out  # as the layers made it, e.g. float32 from a layer overridden to float32
        return _cast(out, policy.output_dtype)

    def __getattr__(self, name: str) -> Any:
        module = self.__dict__.get("module")
        if module is None or name.startswith("__"):
            raise AttributeError(name)
        value = getattr(module, name)
        if callable(value) and callable(getattr(type(module), name, None)):
            return _Method(self, name)  # a method: it runs under the policy too
        return value

    def __repr__(self) -> str:
        return f"PolicyModule({self.module!r}, policy={self.policy.name!r})"


class _Method:
    """A method of a wrapped module, read through its `PolicyModule`."""

    def __init__(self, owner: PolicyModule, name: str):
        self._owner, self._name = owner, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._owner._run(self._name, args, kwargs)


def _walk(module: Any, path: str, chain: tuple, head: Any = None) -> list:
    """(module, chain) for `module` and every module inside it, parents first."""
    sizes = _matmul_sizes(module) if _runs_float8(module) else None
    chain = (*chain, LayerInfo(path, type(module), _kind(module, head), matmul=sizes))
    out = [(module, chain)]
    for keys, leaf in _children(module)[0]:
        if isinstance(leaf, eqx.Module) and not isinstance(leaf, eqx.nn.StateIndex):
            out += _walk(leaf, _join(path, keys), chain, head)
    return out


def _layers(model: Any) -> list:
    return _walk(model, "", (), _head(model))


def _own_arrays(module: Any, path: str) -> list:
    return [(_join(path, keys), dtype_name(getattr(leaf, "dtype", None)))
            for keys, leaf in _children(module)[0] if not isinstance(leaf, eqx.Module)]


def apply_policy(model: Any, policy_map: PolicyMap) -> PolicyModule:
    model = remove_policy(model)
    steps = {step.path: step for step in plan(
        policy_map, _layers(model), variables=_own_arrays,
        fix="Create the module with float32 arrays (or cast them with jax.tree.map)")}
    for step in steps.values():  # refused before anything changes
        recipe = step.policy.float8_recipe
        if recipe is not None and recipe.recipe != "tensorwise" and _runs_float8(step.layer):
            where = ("keeps amax histories, which an Equinox module has no variables for: put the "
                     "policy on the loss function loss(model, ...) that vmaps the model, whose state the "
                     "caller holds (fn.init_float8, float8_state=; docs/float8.md), or pass "
                     "Policy(..., float8_recipe='tensorwise')" if recipe.recipe == "delayed" else
                     "runs on torch (torchao); pass Policy(..., float8_recipe='tensorwise')")
            raise ValueError(
                f"Received the fp8 recipe {recipe.recipe!r} for the eqx.nn.Linear at "
                f"{step.path or '(root)'!r}: on an Equinox model mixedpolicy runs 'tensorwise' "
                f"(current scaling, no state to keep); {recipe.recipe!r} {where}. Nothing was applied.")

    def rebuild(module: Any, path: str) -> PolicyModule:
        step = steps[path]
        policy = step.policy
        leaves, treedef = _children(module)
        new, casts, kept = [], [], {}
        for keys, leaf in leaves:
            if isinstance(leaf, eqx.nn.StateIndex):
                new.append(leaf)
                continue
            if isinstance(leaf, eqx.Module):
                new.append(rebuild(leaf, _join(path, keys)))
                continue
            dtype = dtype_name(getattr(leaf, "dtype", None))
            if dtype is not None and dtype != policy.variable_dtype:
                casts.append((_join("", keys), dtype))
                kept[_join("", keys)] = leaf
                leaf = cast_leaf(leaf, policy.variable_dtype)
            new.append(leaf)
        return PolicyModule(jax.tree_util.tree_unflatten(treedef, new), policy, step.resolution.source,
                            tuple(casts), Kept(kept) if kept else None)

    return rebuild(model, "")


def unwrapped(tree: Any) -> Any:
    """`tree` (a model, or gradients shaped as one) without its `PolicyModule` wrappers, leaves as
    they are: its paths are the layer paths `describe` prints."""
    if isinstance(tree, PolicyModule):
        tree = tree.module
    if not isinstance(tree, eqx.Module):
        return tree
    leaves, treedef = _children(tree)
    return jax.tree_util.tree_unflatten(treedef, [unwrapped(x) if isinstance(x, eqx.Module) else x
                                                  for _, x in leaves])


def remove_policy(model: Any) -> Any:
    """The module without its `PolicyModule` wrappers, arrays back in their dtypes."""
    if not isinstance(model, eqx.Module):
        return model
    casts = dict(model.casts) if isinstance(model, PolicyModule) else {}
    kept = model.originals.arrays if isinstance(model, PolicyModule) and model.originals else {}
    inner = model.module if isinstance(model, PolicyModule) else model
    leaves, treedef = _children(inner)
    new = []
    for keys, leaf in leaves:
        before = casts.get(_join("", keys))
        layer = isinstance(leaf, eqx.Module) and not isinstance(leaf, eqx.nn.StateIndex)
        path = _join("", keys)
        new.append(remove_policy(leaf) if layer
                   else restore_leaf(leaf, kept.get(path), before) if before else leaf)
    return jax.tree_util.tree_unflatten(treedef, new)


def describe(model: Any) -> list:
    rows = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, PolicyModule):
            module, policy, source = node.module, node.policy, node.source
        else:
            module, source = node, NOT_APPLIED
            own = {dtype_name(getattr(x, "dtype", None)) for _, x in _children(node)[0]} - {None}
            policy = Policy(own.pop() if len(own) == 1 else "float32")
        rows.append(LayerPolicy(path, type(module).__name__, policy, source, runs_float8=_runs_float8(module)))
        for keys, leaf in _children(module)[0]:
            if isinstance(leaf, eqx.Module) and callable(leaf):
                walk(leaf, _join(path, keys))

    walk(model, "")
    return rows


class EquinoxModels(ModelAdapter):
    """An Equinox module comes back rebuilt, each of its modules in a `PolicyModule`."""

    runs_float8 = True  # tensorwise: eqx.nn.Linear through float8_matmul.py, scales over the batch

    def is_model(self, obj: Any) -> bool:
        return isinstance(obj, eqx.Module)

    def apply_policy(self, model: Any, policy_map: PolicyMap) -> Any:
        return apply_policy(model, policy_map)

    def remove_policy(self, model: Any) -> Any:
        return remove_policy(model)

    def describe(self, model: Any) -> list:
        return describe(model)

    def range_stats(self, model: Any, loss_fn: Any, batches: list, scales: tuple, activations: bool) -> dict:
        from mixedpolicy.backends.jax.ranges import equinox_stats

        return equinox_stats(model, unwrapped, loss_fn, batches, scales)
