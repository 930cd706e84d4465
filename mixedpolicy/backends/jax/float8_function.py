"""fp8 matmuls in a plain JAX function ``f(params, *inputs)``: its jaxpr, with each weight matmul in fp8.

A plain function has no ``nnx.Linear`` to hook, so the function is traced to its jaxpr
(``jax.make_jaxpr``, under whatever transformation calls it) and the jaxpr is evaluated again
equation by equation, each ``dot_general`` that multiplies a weight by an activation going
through the same fp8 matmul as the NNX hook (float8.py: torchao's ``tensorwise`` recipe,
e4m3 operands and e5m2 output gradients by default). A weight is a leaf of ``params`` (the
first positional argument), or one cast, transposed or reshaped from it, or one sliced from a
stack of them by ``jax.lax.scan`` or by indexing (not gathered rows of it: an embedding
lookup is an activation). The built-in rules of the layer adapters hold per matmul:
the last weight matmul of the function (the output head), and those whose weight is not a
multiple of 16 in both its contracted and its kept size, stay in the compute dtype, as do
products of two activations (attention's scores and mixing) and of two weights.

Nested programs are followed: ``jax.jit`` and ``closed_call`` inline, ``jax.lax.scan``,
``jax.lax.cond``/``switch`` and ``jax.checkpoint`` rebuilt through their public functions with
rewritten bodies. What other primitives hold (``custom_jvp``/``custom_vjp`` rules, ``while``
loops) runs as it was. The scale is per tensor of the whole batch, also where the function is
called under ``jax.vmap`` (float8_matmul.py folds the mapped axis back in). Traced at every
call, eager ones too, it must be traceable as ``jax.jit`` needs it.

Under ``delayed`` scaling each fp8 matmul has Keras's six state arrays (its inputs', its
weight's and its output gradient's scale and amax history), which the caller holds and passes
in (`init_state` makes them): a tuple of dicts in the order the matmuls run, the "gradient" of
each array its next value, as the NNX layers' `Float8Meta` move (under ``jax.vmap`` too: the
batch enters one amax). A matmul whose state could not move once per call (inside ``scan`` or
``cond``) is refused.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from mixedpolicy.backends.jax.float8_matmul import delayed, matmul
from mixedpolicy.float8 import DELAYED_STATE, Float8Recipe, too_small_to_gain

_P = jcore.primitives
_DOT = _P.dot_general_p
_INLINE = {p for p in (getattr(_P, "jit_p", None), getattr(_P, "pjit_p", None), _P.closed_call_p,
                       getattr(_P, "call_p", None)) if p is not None}
# ops after which a weight is still a weight: its dtype, layout or shape changed, or a part of
# it taken (one layer of a stack, q of a fused qkv); a gather of its rows (an embedding lookup)
# is an activation
_KEEPS_WEIGHT = {"convert_element_type", "transpose", "reshape", "squeeze", "expand_dims", "copy",
                 "copy_p", "reduce_precision", "slice", "dynamic_slice"}


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def call(fn: Any, recipe: Float8Recipe, args: tuple, kwargs: dict, *, builtin_rules: bool = True,
         auto_filter: bool = False, state: Any = None, init: bool = False) -> Any:
    """``fn(*args, **kwargs)`` with its weight matmuls in fp8 (see the module docstring);
    without `builtin_rules` every one (the head and any size too), with `auto_filter` none that
    `mixedpolicy.float8.too_small_to_gain` calls too small (the `PolicyMap` settings). Under
    ``delayed`` scaling `state` holds the matmuls' scales and histories; with `init` the fresh
    state is returned instead of the output.

    Raises:
      TypeError: a delayed call without its state.
      ValueError: a state of another shape, or a delayed matmul that cannot keep one.
    """
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    dynamic = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
    n_params = len(jax.tree_util.tree_leaves(args[0])) if args else 0

    def flat(*values: Any) -> Any:
        full = list(leaves)
        for i, value in zip(dynamic, values):
            full[i] = value
        a, k = jax.tree_util.tree_unflatten(tree, full)
        return fn(*a, **k)

    values = [leaves[i] for i in dynamic]
    closed, shape = jax.make_jaxpr(flat, return_shape=True)(*values)
    weights = [i < n_params for i in dynamic]
    plan = _Plan(recipe, builtin_rules, auto_filter)
    plan.walk(closed.jaxpr, weights)
    if not plan.order:
        warnings.warn(f"Received the fp8 function {getattr(fn, '__name__', fn)!r}, in which no matmul "
                      f"multiplies a leaf of params (its first positional argument) by an activation, so "
                      f"nothing runs in fp8. Pass the parameters first, by position: f(params, *inputs).",
                      stacklevel=3)
    if recipe.recipe == "delayed":
        plan.states = _delayed_states(fn, plan, recipe, state, init)
        if init:
            return plan.states
    outs, _ = _Evaluator(plan).run(closed.jaxpr, closed.consts, values, weights)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), outs)


def init_state(recipe: Float8Recipe, count: int) -> tuple:
    """Fresh delayed-scaling state for `count` matmuls: scales 1, histories of zeros."""
    def one() -> dict:
        return {name: jnp.ones((), jnp.float32) if name.endswith("scale") else
                jnp.zeros((recipe.amax_history_len,), jnp.float32) for name in DELAYED_STATE}
    return tuple(one() for _ in range(count))


def _delayed_states(fn: Any, plan: Any, recipe: Float8Recipe, state: Any, init: bool) -> Any:
    """The state of each chosen matmul by its equation, checked; the fresh state under `init`."""
    name = getattr(fn, "__name__", fn)
    chosen = [(eqn, nested) for eqn, takes, nested in plan.listed() if takes]
    for eqn, nested in chosen:
        if nested:
            raise ValueError(f"Received the delayed-scaling fp8 function {name!r} with a weight matmul inside "
                             f"{nested}: its scales and amax history must move once a call, and there it "
                             f"runs once per iteration or branch. Use float8_recipe='tensorwise' (no state), "
                             f"or an NNX model, whose stacked layers keep a state each.")
    fresh = init_state(recipe, len(chosen))
    if init or (not chosen and state is None):  # nothing in fp8 (already warned): no state to hold
        return fresh if init else {}
    fix = (f"make it with state = fn.init_float8(params, *inputs) and pass fn(params, *inputs, "
           f"float8_state=state); its \"gradient\" is the next state")
    if state is None:
        raise TypeError(f"Received no float8_state for the delayed-scaling fp8 function {name!r}, whose "
                        f"{len(chosen)} fp8 matmuls keep scales and amax histories: {fix}.")
    if jax.tree_util.tree_structure(state) != jax.tree_util.tree_structure(fresh) or any(
            jnp.shape(a) != jnp.shape(b) for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(fresh))):
        raise ValueError(f"Received a float8_state that does not fit the function {name!r}: expected "
                         f"{len(chosen)} dicts of {', '.join(DELAYED_STATE)} (scales of shape (), "
                         f"histories of shape ({recipe.amax_history_len},)); {fix}.")
    return {id(eqn): meta for (eqn, _), meta in zip(chosen, state)}


def _weight_operand(eqn: Any, marks: list) -> int | None:
    """0 or 1: the operand of a ``dot_general`` that is the weight, where exactly one is and the
    product has no batch dimensions; else None."""
    (_, _), (batch_l, batch_r) = eqn.params["dimension_numbers"]
    if batch_l or batch_r or marks[0] == marks[1]:
        return None
    return 0 if marks[0] else 1


def _sizes(eqn: Any, side: int) -> tuple[int, int]:
    """(contracted, kept) size of operand `side` of a ``dot_general``."""
    shape = eqn.invars[side].aval.shape
    contract = eqn.params["dimension_numbers"][0][side]
    k = int(np.prod([shape[d] for d in contract]))
    return k, int(np.prod(shape)) // max(k, 1)


class _Plan:
    """Which weight matmuls run in fp8: every eligible one but the last (the head)."""

    def __init__(self, recipe: Float8Recipe, rules: bool = True, auto_filter: bool = False):
        self.recipe, self.order, self.chosen = recipe, [], None
        self.rules, self.auto_filter = rules, auto_filter
        self.nested: list = []  # the loops and branches being walked ("scan", "cond")
        self.states: Any = None  # delayed: equation id -> its state (dict)

    def walk(self, jaxpr: Any, marks: list) -> list:
        env = dict(zip(jaxpr.invars, marks))
        for eqn in jaxpr.eqns:
            ins = [env.get(v, False) if isinstance(v, jcore.Var) else False for v in eqn.invars]
            outs = self._eqn(eqn, ins)
            env.update(zip(eqn.outvars, outs))
        return [env.get(v, False) if isinstance(v, jcore.Var) else False for v in jaxpr.outvars]

    def _eqn(self, eqn: Any, ins: list) -> list:
        name, params = eqn.primitive.name, eqn.params
        if eqn.primitive is _DOT:
            side = _weight_operand(eqn, ins)
            if side is not None:  # a weight matmul: the last one is the head, whatever its size
                k, n = _sizes(eqn, side)
                takes = not self.rules or (k % 16 == 0 and n % 16 == 0)
                takes = takes and k > 0 and n > 0 and not (
                    self.auto_filter and too_small_to_gain(self.recipe.recipe, k, n))
                self.order.append((eqn, takes, self.nested[-1] if self.nested else None))
            return [False]
        if eqn.primitive in _INLINE:
            return self.walk(_open(_called(params)), ins)
        if name == "scan":
            self.nested.append("a jax.lax.scan")
            self.walk(params["jaxpr"].jaxpr, ins)
            self.nested.pop()
            return [False] * len(eqn.outvars)
        if name == "cond":
            self.nested.append("a jax.lax.cond")
            for branch in params["branches"]:
                self.walk(branch.jaxpr, ins[1:])
            self.nested.pop()
            return [False] * len(eqn.outvars)
        if name.startswith("remat"):
            return self.walk(params["jaxpr"], ins)
        keeps = name in _KEEPS_WEIGHT and ins and ins[0]
        return [bool(keeps)] * len(eqn.outvars)

    def listed(self) -> list:
        """(equation, in fp8, the loop or branch it sits in) for each weight matmul; the head
        (the last one) never in fp8 under the built-in rules."""
        last = len(self.order) - 1
        return [(e, takes and not (self.rules and i == last), nested) for i, (e, takes, nested) in enumerate(self.order)]

    def fp8(self, eqn: Any) -> bool:
        if self.chosen is None:
            self.chosen = {id(e) for e, takes, _ in self.listed() if takes}
        return id(eqn) in self.chosen


def _called(params: dict) -> Any:
    return params["jaxpr"] if "jaxpr" in params else params["call_jaxpr"]


def _open(jaxpr: Any) -> Any:
    return getattr(jaxpr, "jaxpr", jaxpr)


class _Evaluator:
    """Evaluates a jaxpr with the plan's matmuls in fp8, nested programs rebuilt."""

    def __init__(self, plan: _Plan):
        self.plan = plan

    def run(self, jaxpr: Any, consts: Any, args: list, marks: list) -> tuple[list, list]:
        env: dict = {}
        weight: dict = {}

        def read(v: Any) -> Any:
            return v.val if isinstance(v, jcore.Literal) else env[v]

        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        weight.update(zip(jaxpr.invars, marks))
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            in_marks = [weight.get(v, False) if isinstance(v, jcore.Var) else False for v in eqn.invars]
            outs, out_marks = self._eqn(eqn, ins, in_marks)
            env.update(zip(eqn.outvars, outs))
            weight.update(zip(eqn.outvars, out_marks))
        return [read(v) for v in jaxpr.outvars], [weight.get(v, False) if isinstance(v, jcore.Var) else False
                                                  for v in jaxpr.outvars]

    def _eqn(self, eqn: Any, ins: list, marks: list) -> tuple[list, list]:
        name, params = eqn.primitive.name, eqn.params
        n_out = len(eqn.outvars)
        if eqn.primitive is _DOT and self.plan.fp8(eqn):
            return [self._dot(eqn, *ins, weight_first=bool(marks[0]))], [False]
        if eqn.primitive in _INLINE:
            closed = _called(params)
            return self.run(_open(closed), getattr(closed, "consts", ()), ins, marks)
        if name == "scan":
            return self._scan(params, ins, marks), [False] * n_out
        if name == "cond":
            branches = [self._body(b.jaxpr, b.consts, marks[1:]) for b in params["branches"]]
            return list(jax.lax.switch(ins[0], branches, *ins[1:])), [False] * n_out
        if name.startswith("remat"):
            body = self._body(params["jaxpr"], (), marks)
            outs = jax.checkpoint(body, prevent_cse=params["prevent_cse"], policy=params["policy"])(*ins)
            return list(outs), [False] * n_out
        bound = eqn.primitive.get_bind_params(params)  # JAX < 0.10: (subfunctions, params)
        subfuns, bound = bound if isinstance(bound, tuple) else ((), bound)
        with getattr(getattr(eqn, "ctx", None), "manager", contextlib.nullcontext()):
            outs = eqn.primitive.bind(*subfuns, *ins, **bound)
        outs = list(outs) if eqn.primitive.multiple_results else [outs]
        keeps = name in _KEEPS_WEIGHT and marks and marks[0]
        return outs, [bool(keeps)] * n_out

    def _body(self, jaxpr: Any, consts: Any, marks: list) -> Any:
        return lambda *args: tuple(self.run(jaxpr, consts, list(args), marks)[0])

    def _scan(self, params: dict, ins: list, marks: list) -> list:
        n_consts, n_carry = params["num_consts"], params["num_carry"]
        consts, carry, xs = ins[:n_consts], ins[n_consts:n_consts + n_carry], ins[n_consts + n_carry:]
        body = self._body(params["jaxpr"].jaxpr, params["jaxpr"].consts, marks)

        def step(c: tuple, x: tuple) -> tuple:
            outs = body(*consts, *c, *x)
            return tuple(outs[:n_carry]), tuple(outs[n_carry:])

        carry_out, ys = jax.lax.scan(step, tuple(carry), tuple(xs), length=params["length"],
                                     reverse=params["reverse"], unroll=params["unroll"])
        return [*carry_out, *ys]

    def _dot(self, eqn: Any, lhs: Any, rhs: Any, weight_first: bool = False) -> Any:
        """The ``dot_general`` as ``(M, K) @ (K, N)`` through the fp8 matmul, in its own layout."""
        (contract_l, contract_r), _ = eqn.params["dimension_numbers"]
        free_l = [d for d in range(lhs.ndim) if d not in contract_l]
        free_r = [d for d in range(rhs.ndim) if d not in contract_r]
        k = int(np.prod([lhs.shape[d] for d in contract_l]))
        a = jnp.transpose(lhs, (*free_l, *contract_l)).reshape(-1, k)
        b = jnp.transpose(rhs, (*contract_r, *free_r)).reshape(k, -1)
        r, side = self.plan.recipe, 0 if weight_first else 1
        if self.plan.states is None:
            out = matmul(a, b, r.forward_dtype, r.backward_dtype, str(a.dtype), str(b.dtype), side)
        else:  # Keras's names: "inputs" the activation, "kernel" the weight, whichever side it is
            meta = self.plan.states[id(eqn)]
            first, second = ("kernel", "inputs") if weight_first else ("inputs", "kernel")
            names = [f"float8_{operand}_{what}" for operand in (first, second, "outputs_grad")
                     for what in ("scale", "amax_history")]
            out = delayed((r.forward_dtype, r.backward_dtype, r.margin, str(a.dtype), str(b.dtype), side), a, b,
                          tuple(meta[n] for n in names))
        shape = (*(lhs.shape[d] for d in free_l), *(rhs.shape[d] for d in free_r))
        return out.reshape(shape).astype(eqn.outvars[0].aval.dtype)
