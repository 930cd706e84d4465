"""Policy names in every family: Keras, jmp's grammar, Lightning, Keras's fp8 names."""

from __future__ import annotations

from mixedpolicy._dtypes import (FLOATING_DTYPES, HALF_DTYPES, canonical_dtype, canonical_reduce_dtype,
                                 is_dtype_object, show)
from mixedpolicy.float8 import KERAS_SOURCES, Float8Recipe
from mixedpolicy.memory import PRESETS, is_default, preset_for

# Lightning's `precision=` strings, normalised to (variable, compute) dtypes.
_LIGHTNING = {
    "16-mixed": ("float32", "float16"),
    "bf16-mixed": ("float32", "bfloat16"),
    "32-true": ("float32", "float32"),
    "16-true": ("float16", "float16"),
    "bf16-true": ("bfloat16", "bfloat16"),
    "64-true": ("float64", "float64"),
    # Lightning's legacy aliases that no other family reads otherwise (it maps "32"/32 to
    # "32-true" and "64"/64 to "64-true")
    "32": ("float32", "float32"),
    "64": ("float64", "float64"),
}
# Lightning's Transformer Engine strings: fp8 matmuls under TE's default DelayedScaling (margin 0,
# an amax history of 1024, e4m3 forward and e5m2 backward: the "delayed" recipe's defaults) over
# weights in this dtype, everything else computing in it.
_LIGHTNING_FLOAT8 = {"transformer-engine": "bfloat16", "transformer-engine-float16": "float16"}
# Names two anchors read differently: refused, naming both readings and the unambiguous spellings.
_AMBIGUOUS = {
    "16": "Lightning reads precision='16' (or 16) as '16-mixed' (float32 variables, float16 "
          "compute); as a dtype it means float16 everywhere. Write '16-mixed' or "
          "'mixed_float16' for the first, 'float16' or '16-true' for the second.",
    "bf16": "Lightning reads precision='bf16' as 'bf16-mixed' (float32 variables, bfloat16 "
            "compute); jmp and the dtype short forms read 'bf16' as bfloat16 everywhere. Write "
            "'bf16-mixed' or 'mixed_bfloat16' for the first, 'bfloat16' or 'bf16-true' for the "
            "second.",
}
_JMP_KEYS = {"p": "params", "params": "params", "c": "compute", "compute": "compute",
             "o": "output", "output": "output", "r": "reduce", "reduce": "reduce"}
_KERAS_NAMES = FLOATING_DTYPES + tuple(f"mixed_{d}" for d in HALF_DTYPES)


#: jmp-grammar keys of the fp8 settings -> Float8Recipe's keyword (None: the recipe itself)
_FLOAT8_KEYS = {"float8": None, "f8": None, "amax_history_len": "amax_history_len", "margin": "margin",
                "float8_forward": "forward_dtype", "float8_backward": "backward_dtype"}

#: jmp-grammar keys of the optimizer settings -> Policy's keyword
_MEMORY_KEYS = {"rounding": "update_rounding", "update_rounding": "update_rounding",
                "state": "optimizer_state_dtype", "optimizer_state": "optimizer_state_dtype"}

#: what a name says: (variable, compute, output or None, reduce or None, fp8 recipe or None,
#: the optimizer settings it names: update_rounding / optimizer_state_dtype)
Parsed = tuple[str, str, "str | None", "str | None", "Float8Recipe | None", dict]


def _valid_names_hint() -> str:
    return (
        f"Expected a Keras name ({', '.join(repr(n) for n in _KERAS_NAMES)}; fp8 matmuls: "
        f"'float8_from_mixed_bfloat16' and the other float8_from_ names), a jmp policy "
        f"('params=float32,compute=bfloat16,output=float32' or 'p=f32,c=bf16'; fp8 matmuls: "
        f"'p=f32,c=bf16,float8=tensorwise'; weight updates: 'p=bf16,rounding=stochastic,state=int8'), "
        f"a memory preset ({', '.join(repr(n) for n in PRESETS)}) or a Lightning precision "
        f"({', '.join(repr(n) for n in (*_LIGHTNING, *_LIGHTNING_FLOAT8))})."
    )


def parse_name(name: str) -> Parsed:
    """What a policy name of any family says."""
    text = name.strip()
    key = text.lower()
    if key.startswith("float8_from_"):
        source = key[len("float8_from_"):]
        if source not in KERAS_SOURCES:
            raise ValueError(
                f"Received policy name {show(name)}: Keras's fp8 names take a source policy, one "
                f"of {', '.join(repr(f'float8_from_{s}') for s in KERAS_SOURCES)}. For another "
                f"source write the jmp form, e.g. 'params=float32,compute=bfloat16,float8=delayed'.")
        variable, compute, output, reduce, _, _ = parse_name(source)
        return variable, compute, output, reduce, Float8Recipe("delayed"), {}  # what Keras means by it
    mode, _, source = key.partition("_from_")
    if source and mode.split("/")[0] in ("int8", "int4", "gptq", "awq"):  # Keras's integer weights
        raise ValueError(
            f"Received policy name {show(name)}, Keras's name for weights model.quantize stored as "
            f"integers: a mixedpolicy policy sets variable and compute dtypes, not integer weights. "
            f"Quantize with Keras (model.quantize({mode.split('/')[0]!r})) and apply the policy they "
            f"compute in ({show(source)}): apply_policy keeps the integer weights, and describe shows both.")
    if key.startswith("mixed_"):
        compute = canonical_dtype(key[len("mixed_"):], what=f"the dtype in {show(name)}")
        if compute not in HALF_DTYPES:
            raise ValueError(
                f"Received policy name {show(name)}: a mixed policy computes in half "
                f"precision, so it must be 'mixed_float16' or 'mixed_bfloat16'. For "
                f"full precision use {compute!r} itself."
            )
        return "float32", compute, None, None, None, {}
    if key in PRESETS:
        dtype, rounding, state = PRESETS[key]
        return dtype, dtype, None, None, None, {"update_rounding": rounding, "optimizer_state_dtype": state}
    if key in _AMBIGUOUS:
        raise ValueError(f"Received policy name {show(name)}, which is ambiguous: {_AMBIGUOUS[key]}")
    if key in _LIGHTNING:
        variable, compute = _LIGHTNING[key]
        return variable, compute, None, None, None, {}
    if key in _LIGHTNING_FLOAT8:
        dtype = _LIGHTNING_FLOAT8[key]
        return dtype, dtype, None, None, Float8Recipe("delayed"), {}
    if "=" in key:
        return _parse_jmp(name)
    try:
        dtype = canonical_dtype(key, what="policy name")
    except ValueError as e:
        float8 = " 8-bit" in str(e)  # canonical_dtype's word on fp8 spellings
        raise ValueError(f"Received policy name {show(name)}, which is not a policy "
                         f"mixedpolicy knows (Unknown dtype or policy name). {_valid_names_hint()}"
                         + (str(e)[str(e).index(" 8-bit"):] if float8 else "")) from None
    return dtype, dtype, None, None, None, {}


def _parse_jmp(name: str) -> Parsed:
    found: dict[str, str] = {}
    float8: dict[str, object] = {}
    memory: dict[str, str] = {}
    for part in name.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        field = _JMP_KEYS.get(key)
        if sep and key in _MEMORY_KEYS:
            if _MEMORY_KEYS[key] in memory:
                raise ValueError(f"Received policy name {show(name)}, which sets {key!r} twice.")
            memory[_MEMORY_KEYS[key]] = value.strip()
            continue
        if sep and key in _FLOAT8_KEYS:
            setting = _FLOAT8_KEYS[key] or "recipe"
            if setting in float8:
                raise ValueError(f"Received policy name {show(name)}, which sets {key!r} twice.")
            text = value.strip()
            float8[setting] = int(text) if setting in ("amax_history_len", "margin") and text.lstrip("-").isdigit() else text
            continue
        if not sep or field is None:
            raise ValueError(
                f"Received policy name {show(name)}: Unknown key in the part {part.strip()!r}, "
                f"which is not 'key=dtype' with key one of 'params' ('p'), 'compute' ('c'), 'output' "
                f"('o') or 'reduce' ('r'), an fp8 setting ('float8', 'amax_history_len', "
                f"'margin', 'float8_forward', 'float8_backward') or an optimizer setting "
                f"('rounding', 'state'). Example: "
                f"'params=float32,compute=bfloat16,output=float32'."
            )
        if field in found:
            raise ValueError(f"Received policy name {show(name)}, which sets {field!r} "
                             f"twice; give each of params, compute, output, reduce at most once.")
        canonical = canonical_reduce_dtype if field == "reduce" else canonical_dtype
        found[field] = canonical(value, what=f"{field} in policy {show(name)}")
    recipe = None
    if float8:
        if "recipe" not in float8:
            raise ValueError(f"Received policy name {show(name)}, which sets "
                             f"{sorted(float8)} but no 'float8=<recipe>'; add e.g. ',float8=delayed'.")
        settings = {k: v for k, v in float8.items() if k != "recipe"}
        recipe = Float8Recipe(str(float8["recipe"]), **settings)  # type: ignore[arg-type]
    # jmp's rule: params default to float32, compute follows params, output follows compute.
    variable = found.get("params", "float32")
    compute = found.get("compute", variable)
    return variable, compute, found.get("output"), found.get("reduce"), recipe, memory


def canonical_name(variable: str, compute: str, output: str, reduce: str,
                   float8: Float8Recipe | None = None, rounding: str = "nearest", state: str | None = None) -> str:
    """The one name equal policies share: Keras's where Keras has one, a memory preset's, else
    jmp's grammar."""
    state = variable if state is None else state
    if not is_default(variable, rounding, state):
        preset = preset_for(variable, compute, output, rounding, state) if reduce == variable and not float8 else None
        if preset is not None:
            return preset
        base = canonical_name(variable, compute, output, reduce)
        jmp = base if "=" in base else f"params={variable},compute={compute},output={output}"
        return ",".join([jmp, *(float8.name_parts() if float8 is not None else []),
                         *([f"rounding={rounding}"] if rounding != "nearest" else []),
                         *([f"state={state}"] if state != variable else [])])
    if float8 is not None:
        base = canonical_name(variable, compute, output, reduce)
        if float8.is_keras_default and base in KERAS_SOURCES:
            return f"float8_from_{base}"
        jmp = base if "=" in base else f"params={variable},compute={compute},output={output}"
        return ",".join([jmp, *float8.name_parts()])
    if reduce != variable:  # only jmp's grammar (with reduce=) can say it
        return f"params={variable},compute={compute},output={output},reduce={reduce}"
    if variable == compute == output:
        return compute
    if variable == "float32" and compute in HALF_DTYPES and output == compute:
        return f"mixed_{compute}"
    return f"params={variable},compute={compute},output={output}"


def read_name(name: object) -> Parsed:
    """What the first argument of `Policy` says when it is not a Policy: a name of any family,
    Lightning's numbers 32 and 64, a dtype object (that dtype everywhere), or None."""
    if name is None:
        return "float32", None, None, None, None, {}  # type: ignore[return-value]
    if isinstance(name, str):
        return parse_name(name)
    if isinstance(name, int) and not isinstance(name, bool) and str(name) in ("32", "64"):
        return parse_name(str(name))  # Lightning's 32 and 64
    if is_dtype_object(name):
        # a dtype object (np.float16, jnp.bfloat16, torch.bfloat16...): that dtype everywhere,
        # as jmp's Policy(dtype, dtype, dtype) and Keras's DTypePolicy("bfloat16") read it
        return parse_name(canonical_dtype(name, what="name"))
    hint = ""
    if isinstance(name, int) and not isinstance(name, bool):
        hint = (" Of Lightning's numbers, 32 and 64 are accepted; 16 is ambiguous: "
                "write '16-mixed' or 'mixed_float16' for float16 compute with float32 "
                "variables, or 'float16' for float16 everywhere.")
    raise TypeError(
        f"Received policy name {show(name)} of type {type(name).__name__}; expected "
        f"a string such as 'mixed_float16', a floating dtype or a Policy.{hint} To convert a "
        f"Keras DTypePolicy or a jmp Policy use Policy.from_keras / Policy.from_jmp.")
