"""What `mixedpolicy bench` can run, and the checks that stop bad options before any run."""

from __future__ import annotations

import importlib.util
from typing import NamedTuple

from mixedpolicy.bench.models import MODELS
from mixedpolicy.bench.recipes import BASELINES, MEMORY_RECIPES, memory_policy, model_part
from mixedpolicy.bench.runners import FRAMEWORKS, runner

__all__ = ["BASELINES", "FRAMEWORKS", "MODELS", "POLICIES", "PURE", "RunSpec", "memory_policy", "model_part"]

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
#: Pure half precision (variables and math in the half dtype), run on request: the native
#: side is the framework's own pure-precision training (``module.to(dtype)``, Flax's
#: ``param_dtype``, Keras's "bfloat16"/"float16" dtype policy, variables made in the dtype).
PURE = ("bfloat16", "float16")
#: fp8 recipes each framework's own tools train with, which the bench compares against:
#: torchao's Float8Linear on torch, Keras's float8 quantization on Keras, on Flax NNX (which has
#: no fp8 layer) the tensorwise dot_general its users write by hand; TensorFlow has no fp8
#: set-up to compare with (its fp8 rows are skipped)
FLOAT8_RECIPES = {"torch": ("tensorwise", "rowwise", "rowwise_with_gw_hp"), "keras-jax": ("delayed",),
                  "keras-torch": ("delayed",), "keras-tensorflow": ("delayed",), "jax": ("tensorwise",)}


def mp_float8(policy: str) -> bool:
    """Whether a bench policy name runs matmuls in fp8."""
    import mixedpolicy as mp

    return policy not in BASELINES and mp.Policy(policy).float8_recipe is not None


def runs(framework: str, policy: str) -> bool:
    """Whether the bench runs `policy` on `framework`: every float policy everywhere; an fp8 policy
    where the framework's own tools train with its recipe (`FLOAT8_RECIPES`); an update recipe
    where ours trains the bench's SGD with it (`MEMORY_RECIPES`)."""
    import mixedpolicy as mp

    if memory_policy(policy):
        p = mp.Policy(policy)
        if framework not in MEMORY_RECIPES:
            return False
        roundings, states = MEMORY_RECIPES[framework]
        return ((p.update_rounding == "nearest" or p.update_rounding in roundings)
                and p.optimizer_state_dtype in states + (p.variable_dtype,))
    recipe = mp.Policy(policy).float8_recipe if policy not in BASELINES else None
    return recipe is None or (recipe.recipe in FLOAT8_RECIPES.get(framework, ())
                              and (recipe.recipe != "delayed" or recipe.margin == 0))



class RunSpec(NamedTuple):
    """One (framework, policy) run, as handed to its worker process."""

    framework: str
    policy: str
    model: str
    batch_size: int
    steps: int         # training steps for the quality figures
    repeats: int       # interleaved timing pairs
    warmup: int
    device: str
    weights: str        # path of the shared initial weights (.npz)
    seed: int
    min_block_s: float = 0.0  # a timed block has enough steps to last this long (see worker.run)
    data: str = ""      # path of the shared digits split (.npz, see data.save); "" makes it here
    dataset: str = "digits"  # or "synthetic" (made in the worker from the seed, see data.synthetic)
    compile: bool = False    # torch.compile / Keras jit_compile=True / tf.function(jit_compile=True)
    threads: int = 1         # intra-op threads of the worker on a CPU (0: the frameworks' own defaults)


def run_label(run: dict) -> str:
    """A run's framework as tables and plots show it ("torch (compiled)")."""
    return run["framework"] + (" (compiled)" if run.get("compile") else "")


def loss_figure(framework: str) -> str:
    """The file of a run label's loss curves ("torch (compiled)": loss_torch_compiled.png)."""
    return "loss_" + "_".join(framework.replace("(", "").replace(")", "").split()) + ".png"


def missing_packages(framework: str) -> list[str]:
    """The packages `framework`'s runner needs that are not installed (none is imported)."""
    return [p for p in runner(framework).packages if importlib.util.find_spec(p) is None]


def installed_frameworks() -> list[str]:
    return [f for f in FRAMEWORKS if not missing_packages(f)]


def _split(value: str, what: str, valid: tuple, sep: str = ",") -> list[str]:
    items = [v.strip() for v in value.split(sep) if v.strip()]
    if not items:
        raise ValueError(f"Received an empty --{what}; expected a comma-separated list of: "
                         f"{', '.join(valid)}.")
    unknown = [v for v in items if v not in valid]
    if unknown:
        raise ValueError(f"Received --{what} {', '.join(map(repr, unknown))}, which "
                         f"{'is' if len(unknown) == 1 else 'are'} not valid; expected any of: "
                         f"{', '.join(valid)}.")
    return list(dict.fromkeys(items))


def resolve_frameworks(value: str | None) -> list[str]:
    """The frameworks to run: all installed ones by default; a named one must be installed."""
    if value is None:
        found = installed_frameworks()
        if not found:
            raise ValueError(f"No framework of {', '.join(FRAMEWORKS)} is installed; install one, "
                             f"for example `pip install \"mixedpolicy[torch]\"`.")
        return found
    chosen = _split(value, "frameworks", FRAMEWORKS)
    for framework in chosen:
        missing = missing_packages(framework)
        if missing:
            raise ValueError(f"Received --frameworks {framework}, but {', '.join(missing)} "
                             f"{'is' if len(missing) == 1 else 'are'} not installed. Install it "
                             f"(`pip install \"mixedpolicy[all]\"`), or choose among the installed "
                             f"ones: {', '.join(installed_frameworks()) or 'none'}.")
    return chosen


def _policy_items(value: str) -> list[str]:
    """--policies split into policies: at ";" where there is one, else at commas, where a
    jmp-grammar part (``key=value``) after another stays in the same policy, so
    ``mixed_bfloat16,p=f32,c=bf16,float8=tensorwise`` names two policies."""
    if ";" in value:
        return [v.strip() for v in value.split(";") if v.strip()]
    items: list[str] = []
    for token in (t.strip() for t in value.split(",")):
        if token and "=" in token and items and "=" in items[-1]:
            items[-1] += "," + token
        elif token:
            items.append(token)
    return items


def resolve_policies(value: str) -> list[str]:
    """--policies in any spelling mixedpolicy accepts ("16-mixed", "bf16-true", "f32"...), as
    the bench's canonical names: the mixed policies, float32 and the pure half-precision ones."""
    import mixedpolicy as mp

    valid = POLICIES + PURE + BASELINES
    items = _policy_items(value)
    names = []
    for item in items:
        if item in valid:
            names.append(item)
            continue
        try:
            policy = mp.Policy(item)
        except (ValueError, TypeError) as err:
            raise ValueError(f"Received --policies {item!r}, which names no policy: {err} The bench "
                             f"runs {', '.join(valid)} (any spelling mixedpolicy reads, such as "
                             f"'16-mixed' or 'p=f32,c=bf16'), fp8 policies and update recipes over "
                             f"them (see mixedpolicy bench --help).") from None
        if policy.float8_recipe is not None and policy.source.name in POLICIES:
            names.append(policy.name)  # fp8 over a mixed or float32 source: run where it has a path
            valid += (policy.name,)
            continue
        if not policy.updates_as_the_optimizer_does and model_part(policy.name) in POLICIES + PURE:
            names.append(policy.name)  # an update recipe over a bench policy: run where ours has it
            valid += (policy.name,)
            continue
        if policy.name not in valid:
            raise ValueError(f"Received --policies {item!r} ({policy.name}); the bench runs policies that "
                             f"each framework can also train with its own tools: choose among "
                             f"{', '.join(valid)} (any spelling), or an fp8 policy over one of "
                             f"{', '.join(POLICIES)} ('float8_from_mixed_bfloat16' on Keras, "
                             f"'p=f32,c=bf16,float8=tensorwise' on torch), or an update recipe over "
                             f"one of them ('bfloat16_stochastic' on torch, JAX and Keras).")
        names.append(policy.name)
    return _split(";".join(names), "policies", valid, sep=";")


def resolve_compile(value: str) -> list[bool]:
    """--compile's values in run order: "off", "on" or both."""
    return [v == "on" for v in _split(value, "compile", ("off", "on"))]


def resolve_model(value: str) -> str:
    """A built-in model's name, or a user's ``MODULE:FACTORY`` (its module is imported later,
    by `user_model_info`, once the Keras backend it builds on is known)."""
    if ":" in value:
        module, _, factory = value.rpartition(":")
        if not module or not factory.isidentifier():
            raise ValueError(f"Received --model {value!r}; expected one of: {', '.join(MODELS)}, or "
                             f"MODULE:FACTORY, e.g. mypackage.models:make_model or models.py:make_model.")
        return value
    if value not in MODELS:
        raise ValueError(f"Received --model {value!r}; expected one of: {', '.join(MODELS)}, or your own "
                         f"MODULE:FACTORY (see mixedpolicy bench --help).")
    return value


class UserModelInfo(NamedTuple):
    """What the bench learnt from a user's factory before any run."""

    frameworks: list     # where it runs
    weights: dict        # the initial weights every worker loads (a Keras model's first build)
    own_data: bool       # the factory brings its batches (else: digits' features to 10 logits)


def user_frameworks(model: str, chosen: list[str], policies: list[str] = (), flag: str = "--frameworks") -> list[str]:
    """The frameworks a user's model runs on (see `user_model_info`)."""
    return user_model_info(model, chosen, policies, flag).frameworks


def user_model_info(model: str, chosen: list[str], policies: list[str] = (),
                    flag: str = "--frameworks") -> UserModelInfo:
    """Calls a user's factory once and checks what it returns, before any run.

    The framework is inferred from the model (a torch.nn.Module: torch; a Flax NNX module:
    jax; a Keras model: every Keras backend installed, or those `chosen` names: the module is
    imported on the first of them, so a factory module that imports Keras at its top builds on
    the backend asked for). A bare model must map digits' (2, 64) features to (2, 10) logits;
    a dict's model is run on its first batch and its loss must be a finite number. A Flax NNX
    factory must take Flax's ``dtype`` (and, for pure policies, ``param_dtype``) keyword
    arguments: the hand-written side is built with them.

    Raises:
      ValueError: the factory cannot be loaded, raises, returns none of these or breaks the
        contract; --frameworks names another framework; an NNX factory cannot build the
        hand-written side of one of `policies`.
    """
    import os
    import sys

    from mixedpolicy.bench import user_model

    backends = [runner(f).keras_backend for f in chosen if runner(f).keras_backend]
    if backends and "keras" not in sys.modules:  # a Keras model, built on the backend asked for
        os.environ["KERAS_BACKEND"] = backends[0]
    try:
        factory = user_model.load_factory(model)
    except ImportError as err:
        raise ValueError(str(err)) from None
    try:
        built = factory()
    except Exception as err:  # the user's code: whatever it raises, said with the fix
        raise ValueError(f"Received --model {model}, whose factory raised {type(err).__name__}: {err}; it must "
                         f"build the model when called with no arguments.") from None
    setup = user_model.unpack(built, model)
    from mixedpolicy._registry import framework_of

    found = framework_of(setup.model)  # the table's row that claims the model, not a guess by name
    if found == "keras":
        inferred = [f for f in FRAMEWORKS if runner(f).framework.startswith("keras-")]
        inferred = [f for f in inferred if f in chosen] if chosen else [
            f for f in inferred if all(importlib.util.find_spec(p) for p in runner(f).packages)]
        name = "Keras"
    elif found == "torch":
        inferred, name = ["torch"], "torch"
    elif found == "flax" and _is_nnx(setup.model):
        inferred, name = ["jax"], "jax"
    elif flag == "--framework":  # mixedpolicy inspect
        raise ValueError(f"Received --model {model}, whose factory returns a {type(setup.model).__name__}; "
                         f"inspect --model reads a user's torch.nn.Module, Flax NNX module or Keras 3 model, "
                         f"alone or as a dict's 'model'. In your own code mp.inspect_gradients also reads an "
                         f"Equinox model and a JAX pytree of parameters (a linen module's), docs/inspect.md.")
    else:
        why = {"flax": " (a Flax linen module has no state of its own to train: wrap it with nnx.bridge or write "
                       "it with flax.nnx)",
               "equinox": " (an Equinox model has no framework-made mixed precision to time against: "
                          "mp.apply_policy and mp.LossScaleOptimizer train it in your own loop)",
               "tensorflow": " (a tf.Module has no framework-made training loop to time against: write it as "
                             "a Keras 3 model, or train it under mp.apply_policy in your own loop)"}.get(found, "")
        raise ValueError(f"Received --model {model}, whose factory returns a {type(setup.model).__name__}; the "
                         f"bench runs a user's torch.nn.Module, Flax NNX module or Keras 3 model, alone or as "
                         f"a dict's 'model'{why}.")
    wrong = [f for f in chosen if f not in inferred]
    if wrong or not inferred:
        valid = "one or more of keras-jax, keras-torch, keras-tensorflow" if name == "Keras" else inferred[0]
        raise ValueError(f"Received {flag} {','.join(chosen)} for --model {model}, a {name} model; "
                         f"leave {flag} out or pass {valid}.")
    if setup.batches is None:
        _check_logits(model, setup.model, inferred[0])
    else:
        _check_own_data(model, setup, inferred[0])
    if inferred == ["jax"]:
        from mixedpolicy.bench.runners.nnx_user import user_native_kwargs

        for policy in policies:
            if runs("jax", policy):  # an fp8 row does not run on JAX
                user_native_kwargs(factory, "float32" if policy == "tf32" else policy)
    weights = {}
    if name == "Keras":  # every backend starts from this build's weights
        from mixedpolicy.bench.runners.keras import user_weights

        weights = user_weights(setup.model)
    return UserModelInfo(inferred, weights, setup.batches is not None)


def _is_nnx(model) -> bool:
    from flax import nnx  # imported already: the model is Flax's

    return isinstance(model, nnx.Module)


def _check_own_data(model: str, setup, framework: str) -> None:
    """A dict's model on its first batch, through the loss the bench will train with: it must
    run and give a finite number."""
    import math

    from mixedpolicy.bench.runners import load

    try:
        value = load(framework).check_user(setup)
    except Exception as err:  # the user's model or loss: whatever it raises, said with the contract
        raise ValueError(f"Received --model {model}, whose model and loss fail on its first batch: "
                         f"{type(err).__name__}: {err}. The bench calls the model on a batch's inputs (a "
                         f"dict by name, a tuple positionally, else as one argument; a Keras model takes "
                         f"any of them as one argument) and then loss(outputs, targets).") from None
    if not math.isfinite(value):
        raise ValueError(f"Received --model {model}, whose loss on its first batch is {value}; the bench "
                         f"trains from a finite loss (check the model's initial weights and the targets).")


def _check_logits(model: str, built, framework: str) -> None:
    """A user's model must map a batch of digits' 64 float32 features to 10 logits: tried
    on two zero samples before any run, so a mismatch is said here, not in a worker."""
    import numpy as np

    x = np.zeros((2, 64), np.float32)
    try:
        if framework == "torch":
            import torch

            where = next(iter(built.parameters()), torch.empty(0)).device  # a factory may place it on a GPU
            with torch.no_grad():
                out = built(torch.from_numpy(x).to(where))
        else:
            out = built(x)
        shape = tuple(np.shape(out))
    except Exception as err:  # the user's model: whatever it raises, said with the contract
        raise ValueError(f"Received --model {model}, whose model fails on a batch of digits' features, "
                         f"float32 of shape (2, 64): {type(err).__name__}: {err}. The bench trains it on "
                         f"digits: 64 features in, 10 logits out.") from None
    if shape != (2, 10):
        raise ValueError(f"Received --model {model}, whose model maps a (2, 64) batch to shape {shape}; the "
                         f"bench trains it on digits and expects (2, 10): 10 logits per sample.")
