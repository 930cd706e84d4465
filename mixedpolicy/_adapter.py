"""The three things a framework can give mixedpolicy, each a small interface of its own.

- `ArrayOps`: the array operations the core's algorithms need (cast, finiteness test,
  select...), on that framework's arrays and containers;
- `ModelAdapter`: putting a `PolicyMap` on that framework's models, taking it off,
  and listing what each layer got;
- `OptimizerAdapter`: wrapping that framework's optimizers with a loss scale.

A registry entry (`mixedpolicy._registry`) names the ones its framework has and no
more: Keras computes on its backend's arrays, so it has no `ArrayOps`; numpy has
no models; optax has only optimizers. Every method of an interface is abstract, so an
implementation that misses one fails when it is created, not at its first call.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, ClassVar, Iterable


class ArrayOps(abc.ABC):
    """One framework's arrays: what the loss scales and the casts run on."""

    #: The name users and error messages see ("torch", "jax", ...).
    name: ClassVar[str]

    @abc.abstractmethod
    def is_array(self, x: Any) -> bool:
        """Is `x` an array (tensor) of this framework?"""

    @abc.abstractmethod
    def leaves(self, tree: Any) -> Iterable[Any]:
        """The leaves of a container of arrays, in this framework's pytree sense."""

    @abc.abstractmethod
    def tree_map(self, fn: Callable[[Any], Any], tree: Any) -> Any:
        """Applies `fn` to every leaf, keeping the container structure."""

    def structure(self, tree: Any) -> Any:
        """The container structure of `tree` without its leaves, comparable with ``==``: two
        trees of one structure (the same keys, types and nesting) compare equal."""
        return _skeleton(tree)

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

    def half_dtype(self) -> str:
        """The half-precision dtype of this framework's default device: float16, where a
        framework's arrays live on a TPU bfloat16 (jmp's ``half_dtype``)."""
        return "float16"

    def complex_parts(self, x: Any) -> tuple | None:
        """(real, imaginary, join) of a complex array: its parts, floating arrays of this framework,
        and ``join(real, imag)`` making the complex array of two such parts; None for any other leaf
        (a framework without complex arrays keeps this default). A complex gradient is unscaled and
        checked as its two parts."""
        return None

    @abc.abstractmethod
    def all_finite(self, tree: Any) -> Any:
        """A boolean scalar array: are all floating and complex leaves free of inf and NaN? No host sync."""

    @abc.abstractmethod
    def where(self, cond: Any, a: Any, b: Any) -> Any:
        """Elementwise select between two arrays of one dtype."""

    @abc.abstractmethod
    def zeros_like(self, x: Any) -> Any:
        """Zeros of `x`'s shape, dtype and device."""

    @abc.abstractmethod
    def full_like(self, x: Any, value: float) -> Any:
        """`value` in `x`'s shape, dtype and device."""


class ModelAdapter(abc.ABC):
    """One framework's models: how a `PolicyMap` is put on them and read back."""

    #: whether `apply_policy` runs a policy's fp8 matmuls (`Policy.float8_recipe`) on this
    #: framework's own fp8 path; where not, fp8 policies are refused before anything changes
    runs_float8 = False

    @abc.abstractmethod
    def is_model(self, obj: Any) -> bool:
        """Is `obj` a model (layer, module) this adapter puts policies on?"""

    @abc.abstractmethod
    def apply_policy(self, model: Any, policy_map: Any) -> Any:
        """Puts a `PolicyMap` onto a model; returns the model (or its policy-carrying copy)."""

    @abc.abstractmethod
    def remove_policy(self, model: Any) -> Any:
        """Undoes `apply_policy`; returns the model."""

    @abc.abstractmethod
    def describe(self, model: Any) -> list:
        """The per-layer rows (`LayerPolicy`) of a model."""

    def range_stats(self, model: Any, loss_fn: Any, batches: list, scales: tuple, activations: bool) -> dict:
        """(layer path, kind) -> stats vector (`mixedpolicy.ranges.layout`) over `batches`,
        for `mixedpolicy.inspect_gradients`."""
        raise TypeError(f"inspect_gradients does not support {type(model).__name__} models yet; it "
                        f"takes torch.nn.Module, Flax NNX, Equinox, Keras 3 models and JAX pytrees.")


class OptimizerAdapter(abc.ABC):
    """One framework's optimizers: the loss-scale wrapper that fits its idiom."""

    #: True where `wrap_optimizer` takes the framework's own keyword options (Keras:
    #: ``name``, ``dynamic``); the factory refuses extra arguments for the others.
    takes_optimizer_options: ClassVar[bool] = False

    #: The frameworks (registry rows, "function" for a `PolicyFunction`) whose models this
    #: framework's optimizers cannot see: a wrapper made without ``policy=`` that scales nothing
    #: warns while a live one of them computes in float16 (`api.float16_models`).
    blind_to: ClassVar[tuple] = ()

    @abc.abstractmethod
    def is_optimizer(self, obj: Any) -> bool:
        """Is `obj` an optimizer this adapter wraps?"""

    @abc.abstractmethod
    def wrap_optimizer(self, optimizer: Any, loss_scale: Any, axis_name: Any = None, **options: Any) -> Any:
        """Wraps an optimizer with a loss scale.

        `axis_name` names the replica axis to agree on skipped steps over, for
        frameworks whose replicas are named axes (JAX); others refuse it.
        """

    def optimizer_from_config(self, config: dict, custom_objects: Any = None) -> Any:
        """Rebuilds this framework's wrapper from a config, or None if it is not one of its."""
        return None

    def follow_policies(self, wrapper: Any, policies: tuple) -> None:
        """Told the policies a wrapper made without a scale of its own follows (where they chose
        no scaling): a framework that checks a scaling wrapper's variables checks them here too."""

    def update_refusal(self, optimizer: Any, policy: Any) -> str | None:
        """Why `optimizer` does not carry out `policy`'s update rounding and optimizer state
        dtype (with the optimizer that does), or None where it does. By default no optimizer
        of the framework is known to."""
        return (f"mixedpolicy knows no {type(optimizer).__module__.split('.')[0]} optimizer that "
                f"does this yet; the inner optimizer would round to nearest and keep its state "
                f"in the variables' dtype")

    def with_updates(self, optimizer: Any, policy: Any) -> Any:
        """`optimizer`, carrying out `policy`'s update rounding where this framework's adapter
        adds it (once `update_refusal` found nothing wrong); by default the optimizer itself."""
        return optimizer

    def warn_arithmetic(self, optimizer: Any, policies: tuple) -> None:
        """Warns where `optimizer`'s own arithmetic under `policies` cannot train (e.g. a
        coefficient that rounds to 1 in the variables' dtype); by default nothing is known."""

    def policies_of(self, optimizer: Any) -> tuple[Any, str] | None:
        """(the policies the optimizer's variables are trained under, where that was read),
        or None where the framework cannot tell (the global policy then decides)."""
        return None


def _skeleton(tree: Any) -> Any:
    """Nested dicts, lists and tuples with each leaf replaced by None (the numpy backend's trees)."""
    if isinstance(tree, dict):
        return (type(tree), tuple((k, _skeleton(v)) for k, v in tree.items()))
    if isinstance(tree, (list, tuple)):
        return (type(tree), tuple(_skeleton(v) for v in tree))
    return None
