"""Which policies the bench treats apart: the baselines beside the policies and the update
recipes (stochastic rounding, a state dtype) that only ours carries. Imports no runner, so the
runners and `spec` both take it from here."""

from __future__ import annotations

#: Baselines beside the policies: "tf32" is float32 with TF32 math allowed (GPUs from
#: Ampere on; the same as float32 on a CPU), the speed-up a GPU gives for free.
BASELINES = ("tf32",)

#: update recipes (rounding, optimizer state dtype) ours trains the bench's SGD with, by framework:
#: the rule around torch's optimizer, the optax rule on JAX and the rule inside Keras's optimizer
#: (8-bit state too: any optax or Keras optimizer's moments); TensorFlow has none, so its rows of
#: such policies are left out
MEMORY_RECIPES = {"torch": (("stochastic", "kahan"), ("float32", "bfloat16")),
                  **{f: (("stochastic", "kahan"), ("float32", "bfloat16", "int8"))
                     for f in ("jax", "keras-jax", "keras-torch", "keras-tensorflow")}}


def memory_policy(policy: str) -> bool:
    """Whether a bench policy name asks the optimizer for an update recipe (docs/memory.md)."""
    import mixedpolicy as mp

    return policy not in BASELINES and not mp.Policy(policy).updates_as_the_optimizer_does


def model_part(policy: str) -> str:
    """The policy's name without its optimizer part ("bfloat16_stochastic" -> "bfloat16"): what
    the model runs under, and the framework's own side trains with."""
    import mixedpolicy as mp

    if not memory_policy(policy):
        return policy
    p = mp.Policy(policy)
    return mp.Policy(p, update_rounding="nearest", optimizer_state_dtype=p.variable_dtype).name
