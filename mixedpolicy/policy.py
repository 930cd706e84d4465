"""`Policy`: which dtype variables are stored in, math runs in, and outputs leave in."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from mixedpolicy import _conversions, _in_force
from mixedpolicy._dtypes import DType, canonical_dtype, canonical_reduce_dtype, is_dtype_object, show
from mixedpolicy._names import canonical_name, read_name
from mixedpolicy._registry import cast_tree
from mixedpolicy.float8 import Float8Recipe, as_float8_recipe, check_source
from mixedpolicy import memory

@dataclasses.dataclass(frozen=True, init=False, repr=False)
class Policy:
    """A mixed-precision policy: the dtypes of variables, of math and of outputs.

    Names follow Keras: ``"float32"``, ``"float16"``, ``"bfloat16"``, ``"float64"``
    keep everything in one dtype; ``"mixed_float16"`` and ``"mixed_bfloat16"`` store
    variables in float32 and compute in half precision. jmp's grammar
    (``"params=float32,compute=bfloat16,output=float32"``, short ``"p=f32,c=bf16"``)
    and Lightning's precision strings (``"16-mixed"``, ``"bf16-true"``...) are
    accepted and normalised, so equal policies compare and hash equal.

    The dtype keywords override what the name says; a dtype the name leaves open
    follows jmp: variables default to float32, compute follows the variables and the
    output follows the compute dtype. The reduce dtype, the dtype gradients travel in
    between replicas, follows the variables (float32 for the mixed policies), so a
    policy without one reduces as the frameworks do by default.

    Args:
      name: a policy name of any of the families above, a dtype object (``np.float16``,
        ``jnp.bfloat16``, ``torch.bfloat16``: that dtype everywhere), or ``None`` to build
        the policy from the keywords alone; with no keywords either (``Policy()``), the
        policy in force (`global_policy`), as Keras's ``DTypePolicy(None)`` takes its global.
      compute_dtype: dtype the math runs in.
      output_dtype: dtype layer outputs are cast to. With these two, ``Policy(param, compute,
        output)`` reads as jmp's ``Policy(param_dtype, compute_dtype, output_dtype)``.
      variable_dtype: dtype variables (weights) are stored in.
      reduce_dtype: dtype gradients are reduced in across replicas: a floating dtype
        or ``"float8_e5m2"`` / ``"float8_e4m3fn"`` (sent with a per-tensor scale,
        summed in float32); in jmp's grammar ``reduce=`` / ``r=``.
      float8_recipe: run the matmul layers in fp8, scaled by this recipe (a name,
        ``"tensorwise"``, ``"delayed"``, ``"rowwise"``, ``"rowwise_with_gw_hp"``,
        ``"mxfp8"``, or a `Float8Recipe`); the other dtypes are the source precision.
        Keras's names ``"float8_from_mixed_bfloat16"`` (...) mean ``"delayed"``; in jmp's
        grammar ``float8=``.
      amax_history_len, margin: the ``"delayed"`` recipe's amax history (default 1024
        steps, Keras's) and headroom in powers of two (default 0).
      update_rounding: how an update is rounded into half-precision variables kept without
        a float32 master: ``"nearest"`` (default, what every optimizer does), ``"stochastic"``
        (bfloat16 variables) or ``"kahan"``; in jmp's grammar ``rounding=``.
      optimizer_state_dtype: what the optimizer keeps its state (moments) in: follows the
        variables by default (as torch's and optax's optimizers do); ``"float32"``,
        ``"bfloat16"`` or ``"int8"`` (8-bit block-quantized); in jmp's grammar ``state=``.
        The presets ``"bfloat16_stochastic"`` and ``"bfloat16_stochastic_int8"`` name the
        two common recipes. The `LossScaleOptimizer` following such a policy checks that its
        inner optimizer carries the recipe out (see docs/memory.md).

    Raises:
      ValueError: the name or a dtype is not one mixedpolicy knows.
      TypeError: an argument is of the wrong type.

    >>> p = Policy("mixed_bfloat16")
    >>> p.variable_dtype, p.compute_dtype, p.output_dtype
    ('float32', 'bfloat16', 'bfloat16')
    >>> Policy("bf16-mixed") == p
    True
    >>> Policy("p=f32,c=f16,o=f32")
    Policy('params=float32,compute=float16,output=float32')
    >>> Policy("mixed_bfloat16", reduce_dtype="bf16").reduce_dtype
    'bfloat16'
    >>> Policy("mixed_bfloat16", float8_recipe="tensorwise")
    Policy('params=float32,compute=bfloat16,output=bfloat16,float8=tensorwise')
    >>> Policy("float8_from_mixed_bfloat16").float8_recipe
    Float8Recipe('delayed', amax_history_len=1024, margin=0)
    >>> Policy("bfloat16", update_rounding="stochastic", optimizer_state_dtype="int8")
    Policy('bfloat16_stochastic_int8')
    """

    name: str
    compute_dtype: str
    variable_dtype: str
    output_dtype: str
    reduce_dtype: str
    float8_recipe: Float8Recipe | None
    update_rounding: str
    optimizer_state_dtype: str

    def __init__(self, name: Any = None, compute_dtype: Any = None, output_dtype: Any = None, *,
                 variable_dtype: Any = None, reduce_dtype: Any = None,
                 float8_recipe: Any = None, amax_history_len: int | None = None, margin: int | None = None,
                 update_rounding: Any = None, optimizer_state_dtype: Any = None):
        if name is None and all(v is None for v in (compute_dtype, output_dtype, variable_dtype, reduce_dtype,
                                                    float8_recipe, amax_history_len, margin, update_rounding,
                                                    optimizer_state_dtype)):
            name = _in_force.current() or "float32"  # nothing given: the policy in force (Keras's DTypePolicy(None))
        reduce: str | None = None
        compute: str | None
        output: str | None
        float8: Float8Recipe | None = None
        named: dict = {}  # the optimizer settings the name gives
        if isinstance(name, Policy):
            variable, compute, output = name.variable_dtype, name.compute_dtype, name.output_dtype
            float8 = name.float8_recipe
            if name.reduce_dtype != name.variable_dtype:
                reduce = name.reduce_dtype
            named = {"update_rounding": name.update_rounding}
            if name.optimizer_state_dtype != name.variable_dtype:
                named["optimizer_state_dtype"] = name.optimizer_state_dtype
        else:
            variable, compute, output, reduce, float8, named = read_name(name)
        if variable_dtype is not None:
            variable = canonical_dtype(variable_dtype, what="variable_dtype")
        if compute_dtype is not None:
            compute = canonical_dtype(compute_dtype, what="compute_dtype")
        if output_dtype is not None:
            output = canonical_dtype(output_dtype, what="output_dtype")
        if compute is None:
            compute = variable
        if reduce_dtype is not None:
            reduce = canonical_reduce_dtype(reduce_dtype, what="reduce_dtype")
        if output is None:
            output = compute
        if reduce is None:
            reduce = variable
        if float8_recipe is not None or amax_history_len is not None or margin is not None:
            float8 = as_float8_recipe(float8 if float8_recipe is None else float8_recipe,
                                      amax_history_len=amax_history_len, margin=margin)
        if float8 is not None:
            check_source(compute, variable)
        rounding = memory.canonical_rounding(update_rounding if update_rounding is not None
                                             else named.get("update_rounding", "nearest"))
        state = optimizer_state_dtype if optimizer_state_dtype is not None else named.get("optimizer_state_dtype")
        state = variable if state is None else memory.canonical_state_dtype(state, variable)
        memory.check(variable, rounding, state)
        object.__setattr__(self, "update_rounding", rounding)
        for field, value in (("optimizer_state_dtype", state), ("variable_dtype", variable),
                             ("compute_dtype", compute), ("output_dtype", output), ("reduce_dtype", reduce)):
            object.__setattr__(self, field, DType(value))  # equal to np.float16, torch.float16 too
        object.__setattr__(self, "float8_recipe", float8)
        object.__setattr__(self, "name", canonical_name(variable, compute, output, reduce, float8, rounding, state))

    def __repr__(self) -> str:
        return f"Policy({self.name!r})"

    def __str__(self) -> str:
        return self.name

    @property
    def param_dtype(self) -> str:
        """The variable dtype under jmp's and Flax's name for it."""
        return self.variable_dtype

    def with_output_dtype(self, output_dtype: Any) -> "Policy":
        """The same policy with another output dtype (jmp's method).

        >>> Policy("mixed_bfloat16").with_output_dtype("float32")
        Policy('params=float32,compute=bfloat16,output=float32')
        """
        return Policy(self, output_dtype=canonical_dtype(output_dtype, what="output_dtype"))

    @property
    def quantization_mode(self) -> str | None:
        """Keras's name for how the matmuls are quantized: ``"float8"`` under an fp8 recipe (Keras's
        ``QuantizedFloat8DTypePolicy``), else None (a plain ``DTypePolicy``'s)."""
        return None if self.float8_recipe is None else "float8"

    @property
    def needs_loss_scaling(self) -> bool:
        """True when the compute dtype is float16, whose range needs a loss scale."""
        return self.compute_dtype == "float16"

    @property
    def updates_as_the_optimizer_does(self) -> bool:
        """True when nothing is asked of the optimizer: nearest rounding, state in the variable
        dtype (what torch's, optax's and Keras's optimizers do by themselves)."""
        return memory.is_default(self.variable_dtype, self.update_rounding, self.optimizer_state_dtype)

    @property
    def source(self) -> "Policy":
        """The policy without its fp8 matmuls: what every other operation runs in."""
        return self if self.float8_recipe is None else _without_float8(self)

    # -- serialisation --------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        """Returns a JSON-ready dict of every field; `from_config` inverts it.

        >>> Policy.from_config(Policy("mixed_float16").get_config())
        Policy('mixed_float16')
        """
        config: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        config = {k: str.__str__(v) if isinstance(v, str) else v for k, v in config.items()}  # plain strings
        if self.float8_recipe is not None:
            config["float8_recipe"] = self.float8_recipe.get_config()
        return config

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "Policy":
        """Rebuilds a policy from `get_config()` output (or Keras's ``{"name": ...}``).

        Raises:
          TypeError: config is not a mapping.
          ValueError: config has unknown keys or names an unknown policy or dtype.
        """
        if not isinstance(config, Mapping):
            raise TypeError(f"Received config of type {type(config).__name__}; expected "
                            f"the dict returned by Policy.get_config().")
        if "class_name" in config and isinstance(config.get("config"), Mapping):
            config = config["config"]  # Keras's serialized form: {"class_name": ..., "config": {...}}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            hint = "" if set(config) & known else (" If they are layer paths, globs or classes, "
                    "give them as overrides: PolicyMap(default, overrides={...}) or "
                    "apply_policy(model, policy, overrides={...}).")
            raise ValueError(f"Received a policy config with unknown keys {unknown}; "
                             f"expected only {sorted(known)}.{hint}")
        dtypes = {k: config[k] for k in sorted(known - {"name"}) if k in config}
        if "name" not in config and not {"compute_dtype", "variable_dtype"} & set(dtypes):
            raise ValueError(f"Received the policy config {show(dict(config))}, which names no "
                             f"policy; expected the dict returned by Policy.get_config(), such "
                             f"as {Policy('mixed_float16').get_config()}.")
        if "name" not in config:
            return cls(None, **dtypes)
        named = cls(config["name"])
        built = cls(config["name"], **dtypes)
        if built != named:
            clash = {k: v for k, v in dtypes.items() if getattr(built, k) != getattr(named, k)}
            raise ValueError(
                f"Received a policy config whose name {show(config['name'])} contradicts its dtypes "
                f"({', '.join(f'{k}={getattr(built, k)!r}' for k in clash)}; the name means "
                f"{', '.join(f'{k}={getattr(named, k)!r}' for k in clash)}). Fix one of them; "
                f"Policy.get_config() writes consistent configs.")
        return built

    # -- conversions ----------------------------------------------------------
    @classmethod
    def from_keras(cls, dtype_policy: Any) -> "Policy":
        """Converts a Keras 3 ``DTypePolicy`` (or anything with its two dtype fields).

        Keras's fp8 policies (``float8_from_mixed_bfloat16``...) become the fp8 policy with
        the ``"delayed"`` recipe and their amax history; other quantized policies
        (``int8_from_...``) are refused: a Policy has no integer weights, and dropping them
        would change the model (`apply_policy` on a quantized Keras model keeps them).
        """
        if isinstance(dtype_policy, Mapping) and hasattr(dtype_policy, "default_policy"):  # a DTypePolicyMap
            if len(dtype_policy):
                raise ValueError(
                    f"Received a Keras DTypePolicyMap with per-layer entries ({', '.join(map(show, list(dtype_policy)[:3]))}"
                    f"{', ...' if len(dtype_policy) > 3 else ''}); a Policy is one policy for every layer, and "
                    f"taking its default alone would drop them. Put them in a mixedpolicy PolicyMap, applied "
                    f"with apply_policy(model, ...): mp.PolicyMap(mp.Policy.from_keras(m.default_policy), "
                    f"{{path: mp.Policy.from_keras(p) for path, p in m.items()}}) where its keys are layer "
                    f"paths (Keras matches a key as a regular expression and gives it to that layer alone; "
                    f"a PolicyMap key is a path whose sublayers inherit it, or a glob).")
            return cls.from_keras(dtype_policy.default_policy)  # (no entries: its default everywhere)
        mode = getattr(dtype_policy, "quantization_mode", None)
        if mode == "float8":
            return cls(str(dtype_policy.name), amax_history_len=getattr(dtype_policy, "amax_history_length", None))
        if mode is not None:
            raise ValueError(
                f"Received the quantized Keras policy {show(getattr(dtype_policy, 'name', dtype_policy))} "
                f"(quantization_mode={mode!r}); a mixedpolicy Policy sets variable and compute "
                f"dtypes only and has no integer weights; dropping them would change the model. The "
                f"policy those weights compute in is Policy.from_keras(keras.DTypePolicy("
                f"{show(getattr(dtype_policy, '_source_name', 'its source_name'))})); apply_policy on a model "
                f"quantized by model.quantize(...) keeps the integer weights and sets that, and describe "
                f"shows both.")
        return cls(None, **_conversions.dtypes_of(dtype_policy, "Keras DTypePolicy",
                                                  variable="variable_dtype", compute="compute_dtype"))

    @classmethod
    def from_jmp(cls, jmp_policy: Any) -> "Policy":
        """Converts a ``jmp.Policy`` (or anything with its three dtype fields)."""
        return cls(None, **_conversions.dtypes_of(jmp_policy, "jmp Policy", variable="param_dtype",
                                                  compute="compute_dtype", output="output_dtype"))

    def to_keras(self) -> Any:
        """Returns the equivalent ``keras.DTypePolicy`` (imports Keras)."""
        return _conversions.to_keras(self)

    def to_jmp(self) -> Any:
        """Returns the equivalent ``jmp.Policy`` (imports jmp and JAX)."""
        return _conversions.to_jmp(self)

    def to_fsdp(self) -> Any:
        """Returns FSDP2's ``MixedPrecisionPolicy``: parameters all-gathered and computed in
        the compute dtype, gradients reduce-scattered in the reduce dtype (imports torch).

        Raises:
          ValueError: an 8-bit reduce dtype, which FSDP2 cannot carry.
        """
        return _conversions.to_fsdp(self)

    # -- casting (jmp's vocabulary) -------------------------------------------
    def cast_to_compute(self, tree: Any) -> Any:
        """Casts the floating leaves of an array or container to the compute dtype."""
        return cast_tree(tree, self.compute_dtype)

    def cast_to_variable(self, tree: Any) -> Any:
        """Casts the floating leaves to the variable dtype (jmp: ``cast_to_param``)."""
        return cast_tree(tree, self.variable_dtype)

    cast_to_param = cast_to_variable

    def cast_to_output(self, tree: Any) -> Any:
        """Casts the floating leaves to the output dtype."""
        return cast_tree(tree, self.output_dtype)


def _without_float8(policy: Policy) -> Policy:
    reduce = policy.reduce_dtype if policy.reduce_dtype != policy.variable_dtype else None
    return Policy(None, variable_dtype=policy.variable_dtype, compute_dtype=policy.compute_dtype,
                  output_dtype=policy.output_dtype, reduce_dtype=reduce, update_rounding=policy.update_rounding,
                  optimizer_state_dtype=policy.optimizer_state_dtype)


def as_policy(value: Any, *, what: str = "policy") -> Policy:
    """Coerces a name, a Policy, a config dict or a Keras/jmp policy to `Policy`.

    Raises:
      TypeError/ValueError: the value is none of those, saying what was received.

    >>> as_policy("bf16-mixed")
    Policy('mixed_bfloat16')
    """
    if isinstance(value, Policy):
        return value
    if isinstance(value, str) or (type(value) is int and value in (16, 32, 64)):
        try:
            return Policy(value)  # an int: Lightning's 32 and 64 (16 refused as ambiguous)
        except (TypeError, ValueError) as err:
            if what == "policy":
                raise
            raise type(err)(f"In {what}: {err}") from None  # given for an override, say: for what
    if isinstance(value, Mapping):  # a config dict (a Keras DTypePolicyMap is a Mapping too)
        return Policy.from_keras(value) if hasattr(value, "default_policy") else Policy.from_config(value)
    if hasattr(value, "param_dtype") and hasattr(value, "compute_dtype"):
        return Policy.from_jmp(value)
    if hasattr(value, "variable_dtype") and hasattr(value, "compute_dtype"):
        return Policy.from_keras(value)
    if is_dtype_object(value):
        return Policy(value)
    raise TypeError(
        f"Received {what}={show(value)} of type {type(value).__name__}; expected a Policy, "
        f"a policy name such as 'mixed_float16', a floating dtype, a config dict, a Keras "
        f"DTypePolicy or a jmp Policy."
    )
