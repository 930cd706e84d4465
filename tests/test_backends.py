"""The three adapter interfaces, the registry, and the array operations on every backend."""

import numpy as np
import pytest

from conftest import require_module

from mixedpolicy import _registry
from mixedpolicy._adapter import ArrayOps, ModelAdapter, OptimizerAdapter


@pytest.mark.parametrize("interface", [ArrayOps, ModelAdapter, OptimizerAdapter])
def test_an_implementation_missing_a_method_fails_when_created(interface):
    class Half(interface):
        name = "half"

    with pytest.raises(TypeError, match="abstract"):
        Half()


def test_unknown_backend_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"'tpu'; expected one of \[.*'numpy'.*\]"):
        _registry.array_ops("tpu")
    with pytest.raises(ValueError, match=r"'keras', which computes on other frameworks' arrays"):
        _registry.array_ops("keras")


def test_every_row_names_classes_that_implement_their_interface():
    """Each row's targets exist and are what the row says; the wrappers are the wrappers."""
    import importlib

    for entry in _registry.ENTRIES:
        for target, interface in ((entry.arrays, ArrayOps), (entry.models, ModelAdapter),
                                  (entry.optimizers, OptimizerAdapter)):
            if not target:
                continue
            module, _, cls = target.partition(":")
            assert module.startswith("mixedpolicy.backends."), target
            try:  # the framework first, as the registry does: only then its row is loaded
                importlib.import_module(entry.gate)
            except ImportError:  # that framework is not installed here
                continue
            found = getattr(importlib.import_module(module), cls)
            assert issubclass(found, interface), target
        assert entry.arrays or entry.models or entry.optimizers, entry.name


def test_registry_never_imports_a_framework_to_check(monkeypatch):
    # A row whose framework is not imported is never loaded: loading this one would
    # fail, so classifying an object proves it was passed over.
    ghost = _registry.Entry("ghost", "not_an_imported_framework", arrays="no_such_module:Ghost",
                            models="no_such_module:Ghost")
    monkeypatch.setattr(_registry, "ENTRIES", [ghost] + _registry.ENTRIES)
    monkeypatch.setattr(_registry, "_by_type", {})
    assert _registry.array_ops_for(np.ones(2)).name == "numpy"
    assert _registry.model_adapter(object()) is None
    assert "no_such_module:Ghost" not in _registry._loaded


def test_classification_is_cached_per_type(monkeypatch):
    monkeypatch.setattr(_registry, "_by_type", {})
    _registry.array_ops_for(np.ones(2))
    assert np.ndarray in _registry._by_type


def test_python_numbers_are_held_by_numpy():
    assert _registry.array_ops_for(3.0).name == "numpy"
    assert _registry.array_ops_for_tree({"a": [1.0, None]}).name == "numpy"


def test_cast_tree_leaves_integers_and_structure(backend):
    tree = {"w": backend.asarray([1.5, 2.5], "float32"), "n": backend.asarray([1, 2], "int32"),
            "mask": backend.asarray([True, False], "bool"), "none": None}
    out = _registry.cast_tree(tree, "bf16")
    assert backend.floating_dtype(out["w"]) == "bfloat16"
    assert backend.floating_dtype(out["n"]) is None and backend.floating_dtype(out["mask"]) is None
    assert np.asarray(out["n"]).dtype == np.int32 and np.asarray(out["mask"]).dtype == np.bool_
    assert out["none"] is None
    assert _registry.array_ops_for_tree(tree).name == backend.name


def test_array_ops_on_every_backend(backend):
    x = backend.asarray([1.0, 2.0], "float32")
    assert backend.is_array(x) and not backend.is_array([1.0, 2.0])
    assert backend.floating_dtype(x) == "float32"
    assert backend.floating_dtype(backend.cast(x, "float16")) == "float16"
    if backend.name == "jax" and not __import__("jax").config.jax_enable_x64:
        with pytest.raises(ValueError, match="jax_enable_x64"):
            backend.cast(x, "float64")
    else:
        assert backend.floating_dtype(backend.cast(x, "float64")) == "float64"
    cond = backend.asarray([True, False], "bool")
    picked = backend.where(cond, x, backend.full_like(x, 7.0))
    assert np.asarray(picked).tolist() == [1.0, 7.0]
    assert np.asarray(backend.zeros_like(x)).tolist() == [0.0, 0.0]
    assert [np.asarray(leaf).tolist() for leaf in backend.leaves({"a": x, "b": [x]})] == [[1.0, 2.0]] * 2


def test_numpy_has_arrays_only():
    numpy = _registry.entry("numpy")
    assert numpy.arrays and not numpy.models and not numpy.optimizers
    assert _registry.model_adapter(np.ones(2)) is None and _registry.optimizer_adapter(np.ones(2)) is None

_TOY_FRAMEWORK = '''
import numpy as np

class Tensor(np.ndarray):
    """The toy framework's array: a numpy array of its own type."""

def tensor(value, dtype="float32"):
    return np.asarray(value, dtype).view(Tensor)

class Layer:
    def __init__(self, *children):
        self.children, self.weight, self.compute = list(children), tensor([1.0, 2.0]), "float32"

class SGD:
    def __init__(self, lr):
        self.lr = lr
'''

_TOY_FILES = {
    "arrays.py": '''
import numpy as np
import toyframework as tf
from mixedpolicy._adapter import ArrayOps

class ToyArrays(ArrayOps):
    name = "toy"
    def is_array(self, x): return isinstance(x, tf.Tensor)
    def leaves(self, tree):
        if isinstance(tree, (list, tuple)): return [l for t in tree for l in self.leaves(t)]
        if isinstance(tree, dict): return [l for t in tree.values() for l in self.leaves(t)]
        return [tree]
    def tree_map(self, fn, tree):
        if isinstance(tree, (list, tuple)): return type(tree)(self.tree_map(fn, t) for t in tree)
        if isinstance(tree, dict): return {k: self.tree_map(fn, v) for k, v in tree.items()}
        return fn(tree)
    def asarray(self, value, dtype, like=None): return tf.tensor(value, dtype)
    def floating_dtype(self, x):
        name = np.dtype(x.dtype).name if self.is_array(x) else None
        return name if name in ("float16", "float32", "float64") else None
    def cast(self, x, dtype): return tf.tensor(x, dtype) if self.floating_dtype(x) else x
    def all_finite(self, tree):
        return tf.tensor(all(np.isfinite(x).all() for x in self.leaves(tree) if self.floating_dtype(x)), "bool")
    def where(self, cond, a, b): return np.where(cond, a, b).view(tf.Tensor)
    def zeros_like(self, x): return np.zeros_like(x)
    def full_like(self, x, value): return np.full_like(x, value)
''',
    "modules.py": '''
import toyframework as tf
from mixedpolicy._adapter import ModelAdapter
from mixedpolicy.policy_map import LayerInfo
from mixedpolicy.table import LayerPolicy

def _walk(layer, path="", chain=()):
    chain = chain + (LayerInfo(path, type(layer)),)
    yield layer, list(chain)
    for i, child in enumerate(layer.children):
        yield from _walk(child, f"{path}.{i}" if path else str(i), chain)

class ToyModels(ModelAdapter):
    def is_model(self, obj): return isinstance(obj, tf.Layer)
    def apply_policy(self, model, policy_map):
        for layer, chain in _walk(model):
            layer.resolution = policy_map.resolve(chain)
            layer.compute = layer.resolution.policy.compute_dtype
        return model
    def remove_policy(self, model):
        for layer, _ in _walk(model):
            layer.__dict__.pop("resolution", None)
            layer.compute = "float32"
        return model
    def describe(self, model):
        return [LayerPolicy(chain[-1].path, "Layer", layer.resolution.policy, layer.resolution.source)
                for layer, chain in _walk(model)]
''',
    "optimizer.py": '''
import toyframework as tf
from mixedpolicy._adapter import OptimizerAdapter

class ToyLossScaleOptimizer:
    def __init__(self, inner, loss_scale): self.inner, self.loss_scale = inner, loss_scale

class ToyOptimizers(OptimizerAdapter):
    def is_optimizer(self, obj): return isinstance(obj, tf.SGD)
    def wrap_optimizer(self, optimizer, loss_scale, axis_name=None):
        return ToyLossScaleOptimizer(optimizer, loss_scale)
''',
}


def test_a_toy_backend_is_one_folder_and_one_row(tmp_path, monkeypatch):
    """Adding a framework: a folder with arrays/modules/optimizer.py and one registry row,
    nothing else; the public API then serves it (loss scales, casts, policies, the wrapper)."""
    import sys

    import mixedpolicy as mp

    (tmp_path / "toyframework.py").write_text(_TOY_FRAMEWORK)
    folder = tmp_path / "toybackend"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    for name, text in _TOY_FILES.items():
        (folder / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    row = _registry.Entry("toy", "toyframework", arrays="toybackend.arrays:ToyArrays",
                          models="toybackend.modules:ToyModels",
                          optimizers="toybackend.optimizer:ToyOptimizers",
                          wrapper="toybackend.optimizer:ToyLossScaleOptimizer",
                          model_words="a toy Layer", optimizer_words="a toy SGD")
    monkeypatch.setattr(_registry, "ENTRIES", [row] + _registry.ENTRIES)
    monkeypatch.setattr(_registry, "_by_type", {})
    monkeypatch.setattr(_registry, "_loaded", {})
    try:
        import toyframework as tf

        grads = [tf.tensor([512.0, 1024.0], "float16")]
        scale = mp.DynamicLossScale(loss_scale=tf.tensor(256.0))
        unscaled = scale.unscale(grads)
        assert type(unscaled[0]) is tf.Tensor and unscaled[0].dtype == np.float16
        assert unscaled[0].tolist() == [2.0, 4.0] and bool(mp.all_finite(unscaled))
        assert not bool(mp.all_finite([tf.tensor([np.inf])]))
        assert mp.Policy("mixed_float16").cast_to_compute({"w": tf.tensor([1.0])})["w"].dtype == np.float16

        model = mp.apply_policy(tf.Layer(tf.Layer()), "mixed_float16", {"0": "float32"})
        assert (model.compute, model.children[0].compute) == ("float16", "float32")
        assert [row.path for row in mp.describe(model)] == ["", "0"]

        wrapped = mp.LossScaleOptimizer(tf.SGD(0.1))
        assert isinstance(wrapped, mp.LossScaleOptimizer) and wrapped.inner.lr == 0.1
        with pytest.raises(TypeError, match="a toy Layer"):
            mp.apply_policy(object())
    finally:
        for name in [m for m in sys.modules if m.startswith(("toyframework", "toybackend"))]:
            del sys.modules[name]


def test_all_finite_over_many_leaves_finds_the_one_that_is_not(backend):
    """The flag over many leaves is counted (a dot product on JAX and TensorFlow, whose XLA
    copied `all` of the stacked flags into every reader): the same answers on every backend."""
    import mixedpolicy as mp

    leaves = [backend.asarray([1.0, 2.0], "float32") for _ in range(30)]
    assert bool(mp.all_finite(leaves)) and bool(mp.all_finite(leaves[:1])) and bool(mp.all_finite([]))
    for bad in (np.inf, -np.inf, np.nan):
        for where in (0, 17, 29):
            poisoned = list(leaves)
            poisoned[where] = backend.asarray([1.0, bad], "float32")
            assert not bool(mp.all_finite(poisoned)), (bad, where)


def test_all_finite_over_groups_of_mixed_dtypes_and_sizes(backend, monkeypatch):
    """The check reads a group of leaves at a time (one dtype, a bounded number of elements):
    a non-finite value is found in any dtype, in a leaf bigger than a group, in an empty leaf's
    neighbour; the groups keep each dtype's order and start anew past the bound."""
    import mixedpolicy as mp
    from mixedpolicy import _dtypes

    monkeypatch.setattr(_dtypes, "FINITE_GROUP_ELEMENTS", 8)
    half = backend.half_dtype()
    leaves = [backend.asarray(np.ones(n), dtype) for n, dtype in
              ((3, "float32"), (2, half), (0, "float32"), (12, "float32"), (4, half), (5, "float32"))]
    assert bool(mp.all_finite(leaves))
    for i, leaf in enumerate(leaves):
        if leaf.shape[0] == 0:
            continue
        for bad in (np.inf, -np.inf, np.nan):
            values = np.ones(leaf.shape[0])
            values[-1] = bad
            poisoned = list(leaves)
            poisoned[i] = backend.asarray(values, backend.floating_dtype(leaf))
            assert not bool(mp.all_finite(poisoned)), (i, bad)
    sizes = [[len(x) for x in group] for group in _dtypes.finite_groups(leaves, len)]
    assert sizes == [[3, 0], [2, 4], [12], [5]]
    assert [len(g) for g in _dtypes.finite_groups([np.ones(3)] * 3, lambda x: None)] == [1, 1, 1]
    # an array past FINITE_ALONE_ELEMENTS is read in place, alone; the small ones group around it
    monkeypatch.setattr(_dtypes, "FINITE_ALONE_ELEMENTS", 4)
    assert [[len(x) for x in group] for group in _dtypes.finite_groups(leaves, len)] == [[3, 0], [2, 4], [12], [5]]
    mixed = [np.ones(n) for n in (2, 5, 1, 6, 3)]
    assert [[len(x) for x in g] for g in _dtypes.finite_groups(mixed, len)] == [[2, 1, 3], [5], [6]]


def test_finite_values_at_the_top_of_the_range_read_as_finite(backend):
    """The check never adds the values themselves: many float32 values near its largest, whose
    sum overflows to inf, are finite; a half-precision leaf at its largest value too."""
    import mixedpolicy as mp

    half = backend.half_dtype()
    top = {"float16": 65504.0, "bfloat16": 3.3e38}[half]
    leaves = [backend.asarray(np.full(4096, 3.0e38), "float32"), backend.asarray(np.full(300, top), half),
              backend.asarray(np.full(7, -3.0e38), "float32")]
    assert bool(mp.all_finite(leaves))
    leaves[1] = backend.asarray(np.r_[np.full(299, top), np.inf], half)
    assert not bool(mp.all_finite(leaves))


def test_torch_check_reads_sparse_gradients_and_every_kind_of_non_finite_value():
    """An embedding's sparse gradient is read through its stored values (torch's isfinite has no
    sparse kernel: all_finite raised NotImplementedError); -inf, which only the smallest value
    shows, is found as inf and NaN are."""
    from conftest import require_module

    torch = require_module("torch")
    import mixedpolicy as mp

    where = torch.tensor([[0, 1], [1, 0]])
    for bad in (float("inf"), float("-inf"), float("nan")):
        sparse = torch.sparse_coo_tensor(where, torch.tensor([1.0, bad]), (2, 2))
        assert not bool(mp.all_finite([torch.ones(3), sparse]))
        assert not bool(mp.all_finite([torch.ones(3, dtype=torch.bfloat16), torch.tensor([bad])]))
    assert bool(mp.all_finite([torch.sparse_coo_tensor(where, torch.ones(2), (2, 2)), torch.ones(2, 2).to_sparse_csr(),
                               torch.zeros(2, 2).to_sparse(), torch.ones(0)]))
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    embedding(torch.tensor([1, 2])).sum().backward()
    assert embedding.weight.grad.is_sparse and bool(mp.all_finite([embedding.weight.grad]))


def test_tensorflows_compiled_check_grows_with_the_leaves_not_their_square():
    """Under tf.function(jit_compile=True) the jmp-style check and select over n leaves: XLA
    copied the stacked flags' chain of ands into each select (n squared ands: 600 leaves took
    71 s to compile on a CPU); it grows with n now."""
    from conftest import require_module

    tf = require_module("tensorflow")
    import mixedpolicy as mp

    def ands(n):
        values = [tf.ones((4, 4)) for _ in range(n)]

        @tf.function(jit_compile=True)
        def step(p, g):
            return mp.select_tree(mp.all_finite(g), [a - 0.1 * b for a, b in zip(p, g)], p)
        return step.experimental_get_compiler_ir(values, values)(stage="optimized_hlo").count(" and(")

    small, large = ands(20), ands(80)
    assert large <= 8 * small + 100, (small, large)  # squared growth: 16x


def test_a_class_key_sets_the_reduce_dtype_of_its_layers_on_every_engine():
    """One layer chain for every engine: the same model (dense 4->8, a norm, dense 8->2) on
    DDP's, JAX's and tf.distribute's front doors, and a PolicyMap whose class key (each
    framework's dense class) sends the dense layers' gradients in bfloat16: 58 values two bytes
    lighter everywhere, the norm's 16 in float32. (Keras under tf.distribute: the Keras suite.)"""
    import mixedpolicy as mp

    dense_values = 4 * 8 + 8 + 8 * 2 + 2
    cases = []
    torch = require_module("torch")
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    cases.append(("torch", torch.nn.Linear, lambda policy: mp.torch.bytes_per_step(net, policy)))
    nnx = require_module("flax.nnx", "jax")

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(4, 8, rngs=rngs), nnx.LayerNorm(8, rngs=rngs), nnx.Linear(8, 2, rngs=rngs)])

    jnet = Net(nnx.Rngs(0))
    cases.append(("jax", nnx.Linear,
                  lambda policy: mp.jax.bytes_per_step(nnx.state(jnet, nnx.Param), policy, model=jnet)))
    tf = require_module("tensorflow")

    class Dense(tf.Module):
        def __init__(self, a, b):
            super().__init__()
            self.w, self.b = tf.Variable(tf.ones((a, b))), tf.Variable(tf.zeros(b))

    class Norm(tf.Module):
        def __init__(self, n):
            super().__init__()
            self.scale, self.offset = tf.Variable(tf.ones(n)), tf.Variable(tf.zeros(n))

    class TfNet(tf.Module):
        def __init__(self):
            super().__init__()
            self.layers = [Dense(4, 8), Norm(8), Dense(8, 2)]

    tnet = TfNet()
    cases.append(("tensorflow", Dense,
                  lambda policy: mp.tensorflow.bytes_per_step(tnet.trainable_variables, policy, model=tnet)))
    for engine, dense, count in cases:
        by_class = mp.PolicyMap("float32", {dense: mp.Policy("float32", reduce_dtype="bfloat16")})
        f32 = count("float32")
        assert f32 == 4 * (dense_values + 16), engine
        assert count(by_class) == f32 - 2 * dense_values, engine
