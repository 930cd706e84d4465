"""The interface every framework adapter implements.

An adapter is thin and final: the array operations the core's algorithms need
(cast, finiteness test, select), and how to put a policy on a model and a loss
scale on an optimizer of its framework. No adapter subclasses another. Because
every method is abstract, an adapter that misses one fails when it is created,
not at its first call.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, ClassVar, Iterable


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
            f"apply_policy, or use the pure policy {dtype!r} if half-precision weights are intended.")


class Adapter(abc.ABC):
    """One framework's implementation of what the core needs."""

    #: The name users and error messages see ("torch", "jax", ...).
    name: ClassVar[str]
    #: The top-level module that must already be in ``sys.modules`` before an object
    #: is tested against this adapter; mixedpolicy never imports a framework to check.
    module: ClassVar[str]
    #: False for an adapter whose framework computes on another framework's arrays
    #: (Keras on its backend's): its array operations work on those, and the registry
    #: leaves them to their own framework's adapter.
    owns_arrays: ClassVar[bool] = True
    #: True for an adapter whose `wrap_optimizer` takes the framework's own keyword
    #: options (Keras: ``name``, ``dynamic``); others get a TypeError naming the fix.
    takes_optimizer_options: ClassVar[bool] = False

    # -- arrays ---------------------------------------------------------------
    @abc.abstractmethod
    def is_array(self, x: Any) -> bool:
        """Is `x` an array (tensor) of this framework?"""

    @abc.abstractmethod
    def leaves(self, tree: Any) -> Iterable[Any]:
        """The leaves of a container of arrays, in this framework's pytree sense."""

    @abc.abstractmethod
    def tree_map(self, fn: Callable[[Any], Any], tree: Any) -> Any:
        """Applies `fn` to every leaf, keeping the container structure."""

    @abc.abstractmethod
    def asarray(self, value: Any, dtype: str, like: Any = None) -> Any:
        """A scalar or array of `dtype` ("float32", "int32", "bool"...), on `like`'s device."""

    @abc.abstractmethod
    def floating_dtype(self, x: Any) -> str | None:
        """The plain dtype name of a floating array, or None for anything else."""

    @abc.abstractmethod
    def cast(self, x: Any, dtype: str) -> Any:
        """Casts a floating array to `dtype`; integer, boolean and non-arrays pass unchanged."""

    def cast_tree(self, tree: Any, dtype: str) -> Any:
        """Casts the floating leaves of a container of arrays to `dtype`."""
        return self.tree_map(lambda x: self.cast(x, dtype), tree)

    @abc.abstractmethod
    def all_finite(self, tree: Any) -> Any:
        """A boolean scalar array: are all floating leaves free of inf and NaN? No host sync."""

    @abc.abstractmethod
    def where(self, cond: Any, a: Any, b: Any) -> Any:
        """Elementwise select between two arrays of one dtype."""

    @abc.abstractmethod
    def zeros_like(self, x: Any) -> Any:
        """Zeros of `x`'s shape, dtype and device."""

    @abc.abstractmethod
    def full_like(self, x: Any, value: float) -> Any:
        """`value` in `x`'s shape, dtype and device."""

    # -- models and optimizers ------------------------------------------------
    @abc.abstractmethod
    def role_of(self, obj: Any) -> str | None:
        """``"model"``, ``"optimizer"`` or None: what `obj` is to this framework."""

    @abc.abstractmethod
    def apply_policy(self, model: Any, policy_map: Any) -> Any:
        """Puts a `PolicyMap` onto a model of this framework; returns the model."""

    @abc.abstractmethod
    def remove_policy(self, model: Any) -> Any:
        """Undoes `apply_policy` on a model of this framework; returns the model."""

    @abc.abstractmethod
    def describe(self, model: Any) -> list:
        """The per-layer rows (`LayerPolicy`) of a model of this framework."""

    @abc.abstractmethod
    def wrap_optimizer(self, optimizer: Any, loss_scale: Any, axis_name: Any = None) -> Any:
        """Wraps an optimizer of this framework with a loss scale.

        `axis_name` names the replica axis to agree on skipped steps over, for
        frameworks whose replicas are named axes (JAX); others reject it.
        """

    def optimizer_from_config(self, config: dict, custom_objects: Any = None) -> Any:
        """Rebuilds this framework's LossScaleOptimizer from a config, or None if it is not one."""
        return None

    def sync_global_policy(self, policy: Any) -> None:
        """Mirrors mixedpolicy's global policy into the framework's own, where it has one.

        Most frameworks have no global dtype policy, so nothing is mirrored.
        """
