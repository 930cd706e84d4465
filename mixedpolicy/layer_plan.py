"""The layer walk every model adapter shares: resolve each layer, check it, then warn once.

An adapter lists its model's layers, parents first, each with its chain of `LayerInfo`
from the root (`dotted_chains` builds the chains from dotted paths such as
``"encoder.layers.0"``); `plan` resolves each layer's policy against the `PolicyMap`,
refuses half-precision master weights, warns about override keys that matched no
layer, and hands back one `PlannedLayer` per layer: what the adapter then puts on
the model in its framework's own way. Flax linen, which builds its layers only when
called, resolves each layer at its first call instead (``PolicyMap.resolve``).

The engines that reduce gradients resolve each variable the same way: `layer_chain` is
the one chain builder, `reduce_dtypes_at` the reduce dtype of each variable by its path.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, NamedTuple, Sequence

from mixedpolicy._dtypes import refuse_uncarried
from mixedpolicy.policy import Policy, as_policy
from mixedpolicy.policy_map import LayerInfo, PolicyMap, Resolution, _key_text
from mixedpolicy.scope import global_policy


class PlannedLayer(NamedTuple):
    """One layer's place in the plan.

    Attributes:
      layer: the framework's layer (module) object.
      chain: the `LayerInfo` of the layers from the root down to this one.
      resolution: its resolved policy, and where it came from.
      parent_policy: the policy resolved for its parent; None for the root.
    """

    layer: Any
    chain: tuple
    resolution: Resolution
    parent_policy: Policy | None

    @property
    def path(self) -> str:
        return self.chain[-1].path

    @property
    def info(self) -> LayerInfo:
        return self.chain[-1]

    @property
    def policy(self) -> Policy:
        return self.resolution.policy

    @property
    def changes_policy(self) -> bool:
        """Does the policy change here: the root, or a layer whose policy is not its parent's?"""
        return self.parent_policy is None or self.parent_policy != self.policy


#: variables(layer, path) -> (full variable path, plain dtype name or None) of its own variables
Variables = Callable[[Any, str], Iterable[tuple[str, Any]]]
#: adjust(layer, chain, resolution, parent PlannedLayer or None) -> the resolution to use
Adjust = Callable[[Any, Sequence[LayerInfo], Resolution, "PlannedLayer | None"], Resolution]


def dotted_chains(layers: Iterable[tuple[str, Any, LayerInfo]]) -> list[tuple[Any, list[LayerInfo]]]:
    """(layer, chain) for (dotted path, layer, info) triples listed parents first."""
    chains: dict[str, list[LayerInfo]] = {}
    out = []
    for path, layer, info in layers:
        parent = path.rpartition(".")[0] if path else None
        chains[path] = (chains.get(parent, []) if parent is not None else []) + [info]
        out.append((layer, chains[path]))
    return out


def _check_reduce(step: PlannedLayer, engine: str, carried: tuple[str, ...]) -> None:
    if step.policy.reduce_dtype != step.policy.variable_dtype:  # (the variable dtype always travels)
        refuse_uncarried([step.policy.reduce_dtype], f"the policy {step.policy.name} for {engine} layer "
                         f"{step.path or '(root)'!r}", engine, carried)


def plan(policy_map: PolicyMap, layers: Iterable[tuple[Any, Sequence[LayerInfo]]], *,
         variables: Variables | None = None, fix: str = "", adjust: Adjust | None = None,
         reduce_engine: tuple[str, tuple[str, ...]] | None = None) -> list[PlannedLayer]:
    """Resolves every layer of a model, checks it, and warns about unmatched keys.

    Args:
      policy_map: the map to resolve against.
      layers: (layer, chain) pairs, parents first; a chain ends with the layer's own info.
      variables: the floating variables a layer holds itself, for the master-weight check.
      fix: how to create variables in float32 in this framework (for that check's message).
      adjust: a framework's last word on a resolution (a layer that cannot take a
        policy of its own follows its parent).
      reduce_engine: (name, carried) for a framework whose replicas reduce in only some
        dtypes: a policy whose reduce dtype is neither its variable dtype nor in
        `carried` is then refused before anything changes.

    Raises:
      ValueError: a mixed policy would train half-precision master weights, two keys
        tie for a layer with different policies, or a reduce dtype cannot be carried.
    """
    layers = [(layer, tuple(chain)) for layer, chain in layers]
    planned: dict[str, PlannedLayer] = {}
    out = []
    for layer, chain in layers:
        parent = planned.get(chain[-2].path) if len(chain) > 1 else None
        resolution = policy_map.resolve(chain)
        if adjust is not None:
            resolution = adjust(layer, chain, resolution, parent)
        step = PlannedLayer(layer, tuple(chain), resolution, parent.policy if parent is not None else None)
        if reduce_engine is not None:
            _check_reduce(step, *reduce_engine)
        for where, dtype in (variables(layer, step.path) if variables is not None else ()):
            check_master_weights(where, dtype, step.policy, fix)
        planned[step.path] = step
        out.append(step)
    policy_map.warn_unmatched(chain[-1] for _, chain in layers)
    return out


def join(path: str, name: str) -> str:
    """A variable's full path: `name` under the layer at `path` ("" is the root)."""
    return f"{path}.{name}" if path else name


def check_master_weights(where: str, dtype: str | None, policy: Any, fix: str) -> None:
    """Refuses a mixed policy over a variable already in half precision.

    Such a policy keeps variables in float32 and computes in half precision; over
    half-precision variables it would silently train half-precision master weights.

    Args:
      where: the variable's path, for the message.
      dtype: the variable's plain dtype name.
      policy: the policy about to be applied to its layer.
      fix: how to create the variables in float32 in this framework.

    Raises:
      ValueError: the variable is float16 or bfloat16 under such a policy.
    """
    if dtype in ("float16", "bfloat16") and policy.variable_dtype == "float32" \
            and policy.compute_dtype != policy.variable_dtype:
        raise ValueError(
            f"Received a model whose variable {where!r} is already {dtype}, but the policy "
            f"{policy.name} keeps variables in float32 and computes in {policy.compute_dtype}: "
            f"applying it would silently train half-precision master weights. {fix} before "
            f"apply_policy, or use the pure policy {dtype!r} if half-precision weights are intended. "
            f"If they are not trained (a LoRA model's base), keep them under the pure policy and "
            f"give the trained layers the mixed one: PolicyMap({dtype!r}, {{'*.lora': {policy.name!r}}}) "
            f"(torch keeps frozen parameters, requires_grad=False, as they are).")


#: type_at(layer path) -> the class of the layer at that path, or None where none is known
TypeAt = Callable[[str], "type | None"]


def attribute_type_at(model: Any) -> TypeAt:
    """type_at(dotted path) -> the class of the object at that path inside `model` (a module of
    Flax NNX, Equinox or ``tf.Module``: attributes, list and dict items), None where it leads nowhere."""
    def at(path: str) -> type | None:
        obj = model
        for part in path.split(".") if path else ():
            try:
                obj = getattr(obj, part)
            except AttributeError:
                try:
                    obj = obj[int(part) if part.isdigit() else part]
                except (TypeError, KeyError, IndexError):
                    return None
        return type(obj)
    return at


def layer_chain(path: str, leaf_type: Any = object, *, sep: str = ".", root: bool = True,
                type_at: TypeAt | None = None) -> list[LayerInfo]:
    """The chain `PolicyMap.resolve` reads for a variable (or gradient leaf) at `path`.

    The layers that hold it, from the root ``""`` (where `root`) down to its own layer,
    each with its class from `type_at` (``object`` where none is known), then the leaf
    itself (of `leaf_type`), so that a glob such as ``"*.bias"`` can name it. Every engine
    that resolves per-variable dtypes builds its chain here.
    """
    layer = path.rpartition(sep)[0]
    parts = layer.split(sep) if layer else []
    chain = []
    for j in range(0 if root else 1, len(parts) + 1):
        prefix = sep.join(parts[:j])
        chain.append(LayerInfo(prefix, (type_at(prefix) if type_at is not None else None) or object))
    chain.append(LayerInfo(path, leaf_type))
    return chain


def check_class_keys(policy: Any, engine: str, fix: str) -> None:
    """Refuses a `PolicyMap` whose layer-class keys would decide reduce dtypes where `engine`
    sees variables by path only (no layer classes): such a key would match nothing there.

    A map whose policies all reduce in one dtype passes: its class keys cannot change a
    reduce dtype.
    """
    if not isinstance(policy, PolicyMap):
        return
    classes = [k for k, _ in policy.overrides if isinstance(k, type)]
    dtypes = {p.reduce_dtype for p in (policy.default or global_policy(), *(p for _, p in policy.overrides))}
    if classes and len(dtypes) > 1:
        raise ValueError(
            f"Received a PolicyMap with the layer-class keys {[_key_text(k) for k in classes]} for "
            f"reducing gradients through {engine}, which sees each variable by its path only: "
            f"a class key would match no variable there, and the reduce dtypes "
            f"{sorted(dtypes)} would not land where the map says. Key those layers by path or glob "
            f"(describe(model) prints the paths), {fix}.")


def reduce_dtypes_at(policy: Any, paths: Sequence[str], leaf_types: Sequence[type] | None = None, *,
                     sep: str = ".", root: bool = True, type_at: TypeAt | None = None) -> list[str]:
    """The reduce dtype of each gradient leaf, by its path (``"dense.kernel"``).

    `policy` is a `Policy`, a name, or a `PolicyMap`; a map resolves each leaf as the last
    link of its `layer_chain`, so a leaf inherits its layer's policy (``"dense"``), a glob
    may name leaves (``"*.bias"``) and, where `type_at` gives the layers' classes, a class
    key names layers as it does in `apply_policy`. Engines share this: torch modules, JAX
    pytrees (dotted), Keras and TensorFlow variables (``sep="/"``, the paths `describe`
    shows for Keras, which has no root of its own).
    """
    if not isinstance(policy, PolicyMap):
        return [as_policy(policy).reduce_dtype] * len(paths)
    return [policy.resolve(layer_chain(path, leaf_types[i] if leaf_types is not None else object,
                                       sep=sep, root=root, type_at=type_at)).policy.reduce_dtype
            for i, path in enumerate(paths)]
