"""Plain dtype names: the only dtype vocabulary the core speaks.

Every dtype the core handles is one of four strings: ``"float16"``,
``"bfloat16"``, ``"float32"`` and ``"float64"``. Users may bring the spellings of
other libraries (``"f16"``, ``"half"``, ``"bf16"``, ``"fp32"``, ``"full"``) or a
framework's dtype object (``torch.bfloat16``, ``jnp.float16``, ``tf.float32``,
``np.dtype("float64")``); :func:`canonical_dtype` turns each into its plain name
without importing the framework the object came from.
"""

from __future__ import annotations

from typing import Any

FLOATING_DTYPES = ("float16", "bfloat16", "float32", "float64")
HALF_DTYPES = ("float16", "bfloat16")
#: the 8-bit floating formats gradients may travel in (never stored or computed in)
FLOAT8_DTYPES = ("float8_e5m2", "float8_e4m3fn")
#: the AdaPrec study's table codecs: N bits a value (a sign and an index into a table of
#: 2**(N-1) magnitudes sent with the tensor); N divides 8, so values pack whole into bytes
TABLE_CODECS = ("table-1", "table-2", "table-4", "table-8")
#: every dtype (or codec) a `Policy` may reduce gradients in across replicas
REDUCE_DTYPES = FLOATING_DTYPES + FLOAT8_DTYPES + TABLE_CODECS

# Spellings accepted for each dtype: Keras/numpy names, jmp's contractions and the
# short forms people type. Every spelling an error message suggests is listed here.
_ALIASES = {
    "float16": ("float16", "f16", "fp16", "half"),
    "bfloat16": ("bfloat16", "bf16"),
    "float32": ("float32", "f32", "fp32", "full", "single"),
    "float64": ("float64", "f64", "fp64", "double"),
}
_BY_ALIAS = {alias: name for name, aliases in _ALIASES.items() for alias in aliases}
_FLOAT8_ALIASES = {
    "float8_e5m2": ("float8_e5m2", "e5m2", "fp8_e5m2", "f8e5m2", "f8_e5m2"),
    "float8_e4m3fn": ("float8_e4m3fn", "e4m3fn", "e4m3", "fp8_e4m3", "f8e4m3fn", "f8_e4m3fn"),
}
_FLOAT8_BY_ALIAS = {alias: name for name, aliases in _FLOAT8_ALIASES.items() for alias in aliases}


class DType(str):
    """A floating dtype's plain name (a ``str``) that also equals that dtype as a numpy, JAX,
    PyTorch or TensorFlow object: jmp users write ``policy.compute_dtype == jnp.float16``,
    PyTorch users ``== torch.bfloat16``, and a plain string would answer False silently.
    Against a string it compares as the string does, and hashes as it.

    >>> import numpy as np
    >>> DType("float16") == np.float16, DType("float16") == "float16", DType("float16") == "f16"
    (True, True, False)
    """

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            return str.__eq__(self, other)
        if is_dtype_object(other):
            try:
                return canonical_reduce_dtype(other) == str.__str__(self)  # the 8-bit floats too
            except (TypeError, ValueError):  # a dtype, not a floating one
                return False
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = str.__hash__


def _represent_as_string(dumper: Any, value: DType) -> Any:
    return dumper.represent_str(str.__str__(value))


def _teach_yaml(yaml: Any) -> None:
    """YAML writes a `DType` as the string it is (its safe dumper refuses str subclasses:
    a policy's dtype in a Lightning hparams.yaml would stop the run)."""
    for dumper in (yaml.SafeDumper, yaml.Dumper):
        dumper.add_representer(DType, _represent_as_string)


def show(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut short for an error message (a 1 MB string is not echoed whole)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def canonical_dtype(value: object, *, what: str = "dtype") -> str:
    """Returns the plain name of a floating dtype given in any supported spelling.

    Args:
      value: a string such as ``"bf16"`` or ``"float32"``, or a dtype object of
        numpy, ml_dtypes, JAX, PyTorch or TensorFlow.
      what: how the value is named in an error message.

    Returns:
      One of ``"float16"``, ``"bfloat16"``, ``"float32"``, ``"float64"``.

    Raises:
      ValueError: the value names a dtype that is not floating, or no dtype.
      TypeError: the value is neither a string nor a dtype object.

    >>> canonical_dtype("bf16")
    'bfloat16'
    >>> canonical_dtype("half")
    'float16'
    """
    if value is float or (isinstance(value, str) and value.strip().lower() == "float"):
        raise ValueError(
            f"Received {what}={show(value)}, which is ambiguous: numpy reads `float` as float64, "
            f"PyTorch and Keras read it as float32. Write 'float32' or 'float64'.")
    name = _dtype_name(value, what)
    key = name.strip().lower()
    if key in _BY_ALIAS:
        return _BY_ALIAS[key]
    valid = ", ".join(f"{n!r}" for n in FLOATING_DTYPES)
    float8 = ""
    if key in _FLOAT8_BY_ALIAS or key in ("fp8", "float8", "f8"):
        float8 = (" 8-bit floats hold no variables and run no math but matmuls: say which matmuls "
                  "run in fp8 with float8_recipe= (Policy('mixed_bfloat16', "
                  "float8_recipe='tensorwise')) or a name such as 'float8_from_mixed_bfloat16'.")
    raise ValueError(
        f"Received {what}={show(value)}, which is not a floating dtype mixedpolicy "
        f"supports (Unknown dtype). Expected one of {valid} (short forms such as 'f16', 'bf16', "
        f"'f32', 'half' and 'full' are accepted too). Integer and boolean tensors "
        f"are never cast, so they need no policy.{float8}"
    )


def _is_array(value: object) -> bool:
    """An array or scalar value (it has a shape and a dtype), not a dtype: numpy reads a JAX
    array or a numpy scalar as its dtype, which would make ``Policy(x)`` mean ``x.dtype``."""
    return not isinstance(value, type) and hasattr(value, "shape") and hasattr(value, "dtype")


def is_dtype_object(value: object) -> bool:
    """True for a dtype object of numpy, ml_dtypes, JAX, PyTorch or TensorFlow (not a name)."""
    if value is None or isinstance(value, (str, bytes, bool, int, float, list, tuple, dict)):
        return False
    if _is_array(value):
        return False
    kind = type(value)
    if (kind.__name__ == "dtype" and kind.__module__.startswith("torch")) or hasattr(value, "as_numpy_dtype"):
        return True  # torch.dtype, tf.DType
    try:
        import numpy as np

        np.dtype(value)  # type: ignore[call-overload]  # any object numpy reads as a dtype
    except (TypeError, ValueError):
        return False
    return True


def _dtype_name(value: object, what: str) -> str:
    """Reads a dtype's name from a string or a framework dtype object, duck-typed."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or value is None:
        raise TypeError(
            f"Received {what}={show(value)} of type {type(value).__name__}; expected a "
            f"dtype name such as 'float32' or 'bfloat16', or a dtype object."
        )
    if _is_array(value):
        raise TypeError(
            f"Received {what}={show(value)}, an array of type {type(value).__name__} and shape "
            f"{tuple(getattr(value, 'shape'))}, where a dtype was expected. To use the array's "
            f"dtype, pass its .dtype (x.dtype); otherwise a name such as 'float32' or 'bfloat16'."
        )
    # torch.dtype prints as "torch.float16" and has no .name.
    text = str(value)
    if text.startswith("torch."):
        return text[len("torch."):]
    # numpy dtypes, tf.DType and jnp dtype instances carry .name.
    name = getattr(value, "name", None)
    if isinstance(name, str):
        return name
    # Scalar types (np.float16, jnp.bfloat16, ml_dtypes.bfloat16) go through numpy,
    # which the core depends on anyway.
    try:
        import numpy as np

        return np.dtype(value).name  # type: ignore[call-overload]  # any object numpy reads
    except TypeError:
        pass
    raise TypeError(
        f"Received {what}={show(value)} of type {type(value).__name__}; expected a dtype "
        f"name such as 'float32' or 'bfloat16', or a dtype object of numpy, JAX, "
        f"PyTorch or TensorFlow."
    )


def canonical_float8_dtype(value: object, *, what: str) -> str:
    """The plain name of an 8-bit float format (``"e4m3"`` -> ``"float8_e4m3fn"``).

    Raises:
      ValueError: the value names no 8-bit float format.
    """
    name = _dtype_name(value, what).strip().lower()
    if name in _FLOAT8_BY_ALIAS:
        return _FLOAT8_BY_ALIAS[name]
    raise ValueError(f"Received {what}={show(value)}; expected an 8-bit float format, "
                     f"{' or '.join(repr(d) for d in FLOAT8_DTYPES)} (short 'e5m2', 'e4m3').")


def canonical_reduce_dtype(value: object, *, what: str = "reduce_dtype") -> str:
    """Returns the plain name of a dtype gradients may be reduced in: a floating dtype
    (any spelling `canonical_dtype` takes), an 8-bit float, ``"float8_e5m2"`` or
    ``"float8_e4m3fn"`` (short ``"e5m2"``, ``"e4m3"``), or a table codec ``"table-N"``.

    Raises:
      ValueError: the value names no such dtype (plain ``"fp8"`` is ambiguous).
      TypeError: the value is neither a string nor a dtype object.

    >>> canonical_reduce_dtype("e5m2"), canonical_reduce_dtype("bf16")
    ('float8_e5m2', 'bfloat16')
    """
    name = _dtype_name(value, what).strip().lower()
    if name in _FLOAT8_BY_ALIAS:
        return _FLOAT8_BY_ALIAS[name]
    if name.startswith("table"):
        bits = name[len("table"):].lstrip("-_ ")
        if f"table-{bits}" in TABLE_CODECS:
            return f"table-{bits}"
        raise ValueError(
            f"Received {what}={show(value)}; the table codecs take 1, 2, 4 or 8 bits a value "
            f"({', '.join(TABLE_CODECS)}), so that values pack whole into bytes.")
    if name in ("fp8", "float8", "f8", "8"):
        raise ValueError(
            f"Received {what}={show(value)}, which is ambiguous: 8-bit floats come as "
            f"'float8_e5m2' (wider range, for gradients) and 'float8_e4m3fn' (finer steps). "
            f"Name one of them.")
    try:
        return canonical_dtype(value, what=what)
    except ValueError:
        valid = ", ".join(repr(n) for n in REDUCE_DTYPES)
        raise ValueError(f"Received {what}={show(value)}, which is not a dtype gradients can be "
                         f"reduced in. Expected one of {valid}.") from None


def refuse_uncarried(reduce_dtypes: Any, subject: str, engine: str, carried: tuple, why: str = "") -> None:
    """The one refusal of a reduce dtype an engine cannot carry: `subject` (what asked for it),
    the dtypes `engine` cannot carry among `reduce_dtypes`, what it carries (`carried`; none:
    only each variable's own dtype, which the caller lets through) and the engines that carry
    every reduce dtype."""
    refused = [d for d in dict.fromkeys(reduce_dtypes) if d not in carried]
    if not refused:
        return
    can = f"it carries {', '.join(carried)}" if carried else "its replicas reduce in the variable dtype only"
    raise ValueError(
        f"Received {subject}: its gradients would be reduced across replicas in {', '.join(refused)}, which "
        f"mixedpolicy cannot carry through {engine} ({can}{why}; PyTorch DDP (mp.torch.register) and JAX "
        f"(mp.jax.all_reduce) carry every reduce dtype). Choose another reduce_dtype, or none, there; "
        f"nothing was applied.")


#: At most this many elements are checked for inf and NaN by one reduction (`finite_groups`).
FINITE_GROUP_ELEMENTS = 1 << 22

#: An array of more elements than this is checked by a reduction of its own: copying it into a
#: group would cost more than the kernels it saves (`finite_groups`).
FINITE_ALONE_ELEMENTS = 1 << 16


def finite_groups(arrays: Any, size: Any, key: Any = None, alone: int | None = None,
                  up_to: int | None = None) -> list:
    """`arrays` in groups that one finiteness reduction checks together (over their values
    concatenated): one dtype to a group, at most `FINITE_GROUP_ELEMENTS` elements, in their order
    within a dtype. An array of more than `FINITE_ALONE_ELEMENTS` elements, or one whose
    ``size(x)`` is None (unknown until run time), is a group by itself.

    A compiler runs each array's reduction as kernels of their own (XLA:CPU three), whose fixed
    cost was a third of a small model's step; a group of small arrays is one fused pass over a
    small copy. A large array is read in place: concatenated, its copy doubled the check's memory
    traffic (GPT-2 small's AdamW update on an H100: 0.8 ms added where 0.4 ms reads it).
    `alone` and `up_to`, where given, stand for the two limits (a backend's own)."""
    alone = FINITE_ALONE_ELEMENTS if alone is None else alone
    up_to = FINITE_GROUP_ELEMENTS if up_to is None else up_to
    groups: list = []
    open_group: dict = {}
    for x in arrays:
        n = size(x)
        if n is None or n > alone:
            groups.append([x])
            continue
        kind = x.dtype if key is None else key(x)
        group, total = open_group.get(kind, (None, 0))
        if group is None or total + n > up_to:
            group, total = [], 0
            groups.append(group)
        group.append(x)
        open_group[kind] = (group, total + n)
    return groups


def host_leaves_finite(leaves: Any, own: Any = None) -> bool:
    """Are the host-side floating and complex leaves among `leaves` (Python floats, numpy floating
    arrays and scalars, ml_dtypes' bfloat16 among them) free of inf and NaN, each checked in its own dtype
    (a float64 1e300 is finite)? Leaves `own` (the caller's framework's tensors, checked on the
    device) and integers are not looked at; another array-like leaf no framework here reads (a
    Keras variable, which holds its backend's array) is read on the host, not passed as finite.

    Raises:
      TypeError: such a leaf cannot be read as an array, or a leaf is a string.
    """
    import numpy as np

    for leaf in leaves:
        if own is not None and own(leaf):
            continue
        if isinstance(leaf, (str, bytes)):  # jmp's all_finite fails on one too (jnp.isfinite of a string)
            raise TypeError(f"Received the {type(leaf).__name__} {leaf[:40]!r} among the leaves; expected arrays and "
                            f"numbers, e.g. the gradients all_finite(grads) checks. Pass the tree of arrays, not a "
                            f"name or a path.")
        if not (isinstance(leaf, (float, np.ndarray, np.generic))) and hasattr(leaf, "__array__") \
                and hasattr(leaf, "dtype") and not isinstance(leaf, type):
            try:
                leaf = np.asarray(leaf)
            except Exception as e:
                raise TypeError(f"Received a {type(leaf).__module__}.{type(leaf).__name__} among the leaves, "
                                f"which cannot be read as an array here ({e}); pass the arrays it holds "
                                f"(a Keras variable's .value).") from None
        if isinstance(leaf, (float, complex)) or (isinstance(leaf, (np.ndarray, np.generic)) and (
                np.dtype(leaf.dtype).name in FLOATING_DTYPES or np.dtype(leaf.dtype).kind == "c")):
            if not bool(np.isfinite(leaf).all()):
                return False
    return True
