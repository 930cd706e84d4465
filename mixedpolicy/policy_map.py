"""`PolicyMap`: a default policy plus per-layer overrides.

How a layer's policy is chosen, first rule that applies wins:

1. an override key that matches the layer itself:
   a. an exact path (``"encoder.layers.0.norm"``);
   b. a glob on the path (``"encoder.*.norm"``; ``*`` also crosses separators).
      When several globs match, the one with the most literal characters wins;
   c. a layer class (``torch.nn.LayerNorm``); a subclass matches, and the class
      that comes first in the layer's MRO wins.
   Two globs that tie and give different policies are an error naming both keys.
2. a built-in rule for the layer's kind (layer_kinds.py: normalisation layers compute, and keep
   their variables, in float32; losses compute and output float32; each when the
   policy around them computes in half precision; layers the model declares it keeps in
   float32 (transformers' ``_keep_in_fp32_modules``) keep float32 weights where the policy's
   are half precision; under an fp8 policy, embeddings,
   norms, the output head, matmuls whose dimensions are not multiples of 16 and layers
   with no fp8 path keep the source precision, ``policy.source``); disable with
   ``builtin_rules=False``, or override one layer with a key of rule 1;
3. the override that matched the nearest enclosing layer (an override on a block
   covers everything inside it);
4. the map's default, or when it has none, the global policy at resolve time.

Paths use each framework's own naming: ``named_modules()`` in PyTorch (less wrappers' segments),
``layer.path`` in Keras, the pytree path in JAX.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import warnings
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

from mixedpolicy.float8 import too_small_to_gain
# the layer kinds and their built-in rules (layer_kinds.py), importable from here as before
from mixedpolicy.layer_kinds import (EMBEDDING, FLOAT8_KEPT as _FLOAT8_KEPT, HEAD, KEEP_FLOAT32,  # noqa: F401
                                     KEEP_FLOAT32_OVER_FLOAT16, LOSS, NO_FLOAT8, NORMALIZATION, SMALL_MATMUL,
                                     builtin_rule)
from mixedpolicy.scope import global_policy
from mixedpolicy._dtypes import show
from mixedpolicy.policy import Policy, as_policy

_GLOB_CHARS = frozenset("*?[")


def _check_layers(layers: Any, what: str, expected: str) -> None:
    if not isinstance(layers, (list, tuple)) or not all(isinstance(info, LayerInfo) for info in layers):
        raise TypeError(f"Received {what} of type {type(layers).__name__} ({layers!r:.80}); expected a list "
                        f"of LayerInfo {expected}.")


class LayerInfo(NamedTuple):
    """What an adapter tells the map about one layer.

    Attributes:
      path: the layer's path in its framework's own naming ("" for the root).
      type: the layer's class.
      kind: ``"normalization"``, ``"loss"``, ``"keep_float32"`` or
        ``"keep_float32_over_float16"`` (the model keeps the layer in float32), or one fp8
        keeps in the source precision (``"embedding"``, ``"head"``, ``"small_matmul"``,
        ``"no_float8"``), or ``None``: for the built-in rules (layer_kinds.py).
      aliases: other names an exact key may use for this layer (Keras: ``layer.name``,
        the name a Keras user sees, beside its path). A path key wins over an alias.
      matmul: ``(in_features, out_features)`` of a layer that can run in fp8, where known
        (for ``float8_auto_filter``).
    """

    path: str
    type: type
    kind: str | None = None
    aliases: tuple = ()
    matmul: tuple | None = None


class _ResolutionFields(NamedTuple):
    policy: Policy
    source: str


class Resolution(_ResolutionFields):
    """The policy chosen for a layer and where it came from: a ``(policy, source)`` pair.

    Attributes:
      policy: the chosen policy.
      source: where it came from, in words (what `describe` prints).
      origin: which rule of the precedence chose it, as a value adapters test (never the
        words): ``"key"`` (a key matching the layer itself), ``"rule"`` (a built-in rule),
        ``"inherited"`` (a key matching an enclosing layer), ``"default"`` (the map's
        default) or ``"global"`` (the global policy). Not part of the pair, so a
        Resolution still equals ``(policy, source)``.
    """

    origin: str

    def __new__(cls, policy: Policy, source: str, origin: str = "") -> "Resolution":
        self = super().__new__(cls, policy, source)
        self.origin = origin
        return self

    def __getnewargs__(self) -> tuple:
        return (self.policy, self.source, self.origin)


def _is_glob(key: str) -> bool:
    return any(c in _GLOB_CHARS for c in key)


def _check_glob(key: str) -> None:
    """Refuses a glob whose character sets are unclosed or empty ('[', '[z-a]')."""
    i = 0
    while i < len(key):
        if key[i] == "[":
            j = i + 1
            if j < len(key) and key[j] == "!":
                j += 1
            if j < len(key) and key[j] == "]":
                j += 1
            end = key.find("]", j)
            if end < 0:
                raise ValueError(
                    f"Received override key {show(key)}, a glob whose '[' at position {i} is never "
                    f"closed; expected a set such as 'layers.[0-3].norm', or escape a literal "
                    f"bracket as '[[]'.")
            body = key[i + 1:end].lstrip("!")
            for k in range(len(body) - 2):
                if body[k + 1] == "-" and body[k] > body[k + 2]:
                    raise ValueError(
                        f"Received override key {show(key)}, whose range "
                        f"'{body[k]}-{body[k + 2]}' is reversed and matches nothing; expected "
                        f"'{body[k + 2]}-{body[k]}'.")
            i = end
        i += 1


def _literal_chars(pattern: str) -> int:
    return sum(c not in _GLOB_CHARS for c in pattern)


@dataclasses.dataclass(frozen=True, init=False)
class PolicyMap:
    """A default policy plus per-layer overrides (see the module docstring for precedence).

    Args:
      default: the policy of every layer no override reaches; ``None`` follows the
        global policy in force when the map is applied.
      overrides: a mapping from a layer path, a glob on paths or a layer class to
        a policy (a `Policy` or anything `Policy` accepts).
      builtin_rules: apply the built-in rules (normalisation and losses in float32, and the
        layers a model keeps in float32; layer_kinds.py).
      float8_auto_filter: under an fp8 policy, also keep in the source precision the
        matmuls too small for fp8 to outrun bf16 (per tensor measured on an H200, per row
        torchao's H100 thresholds: `mixedpolicy.float8.too_small_to_gain`). Off by default, as
        in torchao and Keras, which put every eligible matmul in fp8.

    Raises:
      TypeError: a key is neither a string nor a class, or a value is not a policy.
      ValueError: a key is blank, or a value names an unknown policy.

    >>> m = PolicyMap("mixed_bfloat16", {"head": "float32"})
    >>> m.resolve([LayerInfo("", object), LayerInfo("head", object)])
    Resolution(policy=Policy('float32'), source="map key 'head'")
    """

    default: Policy | None
    overrides: tuple[tuple[Any, Policy], ...]
    builtin_rules: bool
    float8_auto_filter: bool

    def __init__(self, default: Any = None, overrides: Mapping[Any, Any] | None = None,
                 *, builtin_rules: bool = True, float8_auto_filter: bool = False):
        if overrides is None:
            overrides = {}
        if not isinstance(overrides, Mapping):
            raise TypeError(f"Received overrides of type {type(overrides).__name__}; "
                            f"expected a dict such as {{'encoder.*.norm': 'float32'}}.")
        pairs = []
        for key, value in overrides.items():
            if isinstance(key, str):
                if not key.strip() and key != "":
                    raise ValueError(f"Received the blank override key {show(key)}; expected a layer "
                                     f"path (\"\" for the root), a glob or a layer class.")
                if _is_glob(key):
                    _check_glob(key)
            elif isinstance(key, type) and key.__module__ == "builtins":
                raise TypeError(
                    f"Received override key {key.__name__!r}, a Python built-in type, which is "
                    f"no layer class; expected a layer class such as torch.nn.LayerNorm or "
                    f"keras.layers.Dense, a layer path or a glob.")
            elif not isinstance(key, type):
                raise TypeError(
                    f"Received override key {show(key)} of type {type(key).__name__}; expected "
                    f"a layer path ('encoder.norm'), a glob ('encoder.*.norm') or a layer "
                    f"class (torch.nn.LayerNorm, keras.layers.BatchNormalization).")
            pairs.append((key, as_policy(value, what=f"overrides[{show(key, 60) if isinstance(key, str) else _key_text(key)}]")))
        for name, flag in (("builtin_rules", builtin_rules), ("float8_auto_filter", float8_auto_filter)):
            if not isinstance(flag, bool):
                raise TypeError(f"Received {name}={flag!r}; expected True or False.")
        object.__setattr__(self, "default", None if default is None else as_policy(default, what="default"))
        object.__setattr__(self, "overrides", tuple(pairs))
        object.__setattr__(self, "builtin_rules", builtin_rules)
        object.__setattr__(self, "float8_auto_filter", float8_auto_filter)

    def with_default(self, default: Any) -> "PolicyMap":
        """This map with another default (the same overrides and rules)."""
        new = object.__new__(PolicyMap)
        new.__dict__.update(self.__dict__, default=None if default is None else as_policy(default, what="default"))
        return new

    # -- matching -------------------------------------------------------------
    def _match(self, layer: LayerInfo) -> tuple[Any, Policy] | None:
        """The override key that matches this layer itself, or None."""
        for key, policy in self.overrides:
            if isinstance(key, str) and not _is_glob(key) and key == layer.path:
                return key, policy
        for key, policy in self.overrides:
            if isinstance(key, str) and not _is_glob(key) and key in layer.aliases:
                return key, policy
        globs = [(_literal_chars(k), k, p) for k, p in self.overrides
                 if isinstance(k, str) and _is_glob(k) and fnmatch.fnmatchcase(layer.path, k)]
        if globs:
            return _best(globs, layer, "globs")
        mro = getattr(layer.type, "__mro__", (layer.type,))
        classes = [(-mro.index(k), k, p) for k, p in self.overrides
                   if isinstance(k, type) and k in mro]
        if classes:
            return _best(classes, layer, "classes")
        return None

    def resolve(self, chain: Sequence[LayerInfo]) -> Resolution:
        """Chooses the policy of the last layer in `chain`.

        Args:
          chain: the layers from the outermost model down to the layer to resolve.

        Returns:
          A `Resolution`: the policy and a short text saying where it came from.

        Raises:
          TypeError: `chain` is not a list of `LayerInfo`.
          ValueError: two override keys tie for the layer with different policies.
        """
        _check_layers(chain, "a chain", "from the root model down to the layer to resolve")
        if not chain:
            raise ValueError("Received an empty chain; expected the layers from the root model down to the layer.")
        layer = chain[-1]
        own = self._match(layer)
        if own is not None:
            return Resolution(own[1], f"map key {_key_text(own[0])}", "key")
        base = self._inherited(chain[:-1])
        recipe = base.policy.float8_recipe
        if self.builtin_rules and layer.kind is not None:
            ruled = builtin_rule(layer.kind, base.policy)
            if ruled is not None:
                return Resolution(ruled, f"built-in rule: {layer.kind}", "rule")
            if recipe is not None and layer.kind in _FLOAT8_KEPT:
                source = base.policy.source
                return Resolution(source, f"built-in rule: fp8 keeps {_FLOAT8_KEPT[layer.kind]} in {source}", "rule")
        if (self.float8_auto_filter and recipe is not None and layer.matmul and min(layer.matmul) > 0
                and too_small_to_gain(recipe.recipe, *layer.matmul)):
            source = base.policy.source
            return Resolution(source, f"float8_auto_filter: {layer.matmul[0]} -> {layer.matmul[1]} is too small "
                                      f"to gain from {recipe.recipe} fp8; kept in {source}", "rule")
        return base

    def _inherited(self, ancestors: Sequence[LayerInfo]) -> Resolution:
        for ancestor in reversed(ancestors):
            match = self._match(ancestor)
            if match is not None:
                return Resolution(match[1], f"map key {_key_text(match[0])} (inherited from {ancestor.path!r})", "inherited")
        if self.default is not None:
            return Resolution(self.default, "map default", "default")
        return Resolution(global_policy(), "global policy", "global")

    def warn_unmatched(self, layers: Iterable[LayerInfo]) -> None:
        """Warns about each override key that matches none of `layers`, naming the nearest paths."""
        layers = layers if isinstance(layers, (str, bytes, Mapping)) or not isinstance(layers, Iterable) else list(layers)
        _check_layers(layers, "layers", "(the model's layers, as its adapter lists them)")
        paths = [layer.path for layer in layers]
        names = {alias for layer in layers for alias in layer.aliases}
        for key, _ in self.overrides:
            if isinstance(key, type):
                if not any(key in getattr(layer.type, "__mro__", ()) for layer in layers):
                    warnings.warn(f"PolicyMap key {_key_text(key)} matches no layer: the model has no layer "
                                  f"of that class, so the override has no effect.", UserWarning, stacklevel=3)
                continue
            if not (any(fnmatch.fnmatchcase(p, key) for p in paths) if _is_glob(key) else key in paths or key in names):
                near = difflib.get_close_matches(key, paths, n=3, cutoff=0.4) or paths[:3]
                warnings.warn(f"PolicyMap key {show(key)} matches no layer path, so the override "
                              f"has no effect. {_class_named(key, layers) or f'Nearest paths: {near}.'}",
                              UserWarning, stacklevel=3)


def _class_named(key: str, layers: Any) -> str:
    """Where `key` is the name of some layers' class (``"LayerNorm"``), how to name the class."""
    for layer in layers:
        cls = next((c for c in getattr(layer.type, "__mro__", ()) if c.__name__ == key), None)
        if cls is not None:
            named = [other.path for other in layers if cls in getattr(other.type, "__mro__", ())]
            return (f"{key!r} is the name of a layer class (layers {named[:5]}), and a string key is a "
                    f"path or a glob on paths: to name the class, make the class itself the key "
                    f"({_key_text(cls)}).")
    return ""


def _key_text(key: Any) -> str:
    if isinstance(key, type):
        return f"{key.__module__}.{key.__qualname__}"
    return repr(key)


def _best(candidates: list[tuple[int, Any, Policy]], layer: LayerInfo, what: str) -> tuple[Any, Policy]:
    candidates.sort(key=lambda c: c[0], reverse=True)
    rank, key, policy = candidates[0]
    for other_rank, other_key, other_policy in candidates[1:]:
        if other_rank == rank and other_policy != policy:
            raise ValueError(
                f"Ambiguous PolicyMap for layer {layer.path!r}: the {what} {_key_text(key)} "
                f"({policy.name}) and {_key_text(other_key)} ({other_policy.name}) match it "
                f"equally well. Add an exact-path key for {layer.path!r}, or make one key "
                f"more specific.")
    return key, policy


def as_policy_map(policy: Any = None, overrides: Mapping[Any, Any] | None = None) -> PolicyMap:
    """The map `apply_policy` uses: a `PolicyMap` as given, else one built from a policy and overrides.

    Raises:
      TypeError: a `PolicyMap` was given together with separate overrides.
    """
    if isinstance(policy, PolicyMap):
        if overrides:
            raise TypeError("Received a PolicyMap and separate overrides; put the overrides "
                            "into the PolicyMap, or pass a plain policy with overrides=.")
        return policy
    return PolicyMap(None if policy is None else as_policy(policy, what="policy"), overrides)
