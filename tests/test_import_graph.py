"""The library's import graph has no cycle, and no library file outgrows one concept."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "mixedpolicy"
MAX_LINES = 350


def _modules() -> dict:
    mods = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def _edges(mods: dict) -> dict:
    """module -> the mixedpolicy modules it imports, at the top or inside functions."""
    edges = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                base = node.module
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base])
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    edges[name].add(target if target in mods else base)
            elif isinstance(node, ast.Import):
                edges[name].update(a.name for a in node.names)
            else:  # an import by name: import_module("mixedpolicy.x"), sys.modules["mixedpolicy.x"]
                edges[name].update(_named(node, mods))
        edges[name] = {t for t in edges[name] if t in mods and t != name}
    return edges


def _literal_prefix(node) -> str | None:
    """A string literal's text, or an f-string's literal start ("mixedpolicy.backends.")."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return node.values[0].value
    return None


def _named(node, mods: dict) -> set:
    """The mixedpolicy modules a node reaches by name: the argument of an import_module call,
    the key of a sys.modules subscript or .get (an f-string: every module under its prefix)."""
    text = None
    if isinstance(node, ast.Call) and node.args:
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        is_modules_get = (isinstance(func, ast.Attribute) and func.attr == "get"
                          and isinstance(func.value, ast.Attribute) and func.value.attr == "modules")
        if called in ("import_module", "__import__") or is_modules_get:
            text = _literal_prefix(node.args[0])
    elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "modules":
        text = _literal_prefix(node.slice)
    if not text or not text.startswith("mixedpolicy") or text == "mixedpolicy.":
        return set()  # (the package's own attributes, mp.jax...: test_lazy_attributes)
    if text in mods:
        return {text}
    return {m for m in mods if m.startswith(text)}  # an f-string: every module it may name


def _cycles(edges: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycle():
    mods = _modules()
    assert len(mods) > 20
    assert _cycles(_edges(mods)) == []


def test_a_cycle_would_be_found():
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]


def test_no_library_file_is_over_the_limit():
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


GROUND = {"mixedpolicy._dtypes", "mixedpolicy._scale_checks", "mixedpolicy._import_hook",
          "mixedpolicy._adapter", "mixedpolicy._registry", "mixedpolicy._conversions", "mixedpolicy.float8"}


#: public modules that name a framework's engine: on the top floor with the backends
TOP_FACADES = {"mixedpolicy.__main__", "mixedpolicy.distributed", "mixedpolicy.torch", "mixedpolicy.jax", "mixedpolicy.tensorflow",
               "mixedpolicy.keras", "mixedpolicy.lightning",
               "mixedpolicy.huggingface"}


def _floor(module: str) -> int:
    """0: the ground floor; 1: the core; 2: backends, bench and the command line."""
    if module in GROUND:
        return 0
    if module.startswith(("mixedpolicy.backends", "mixedpolicy.bench")) or module in TOP_FACADES:
        return 2
    return 1


def test_lazy_attributes_are_the_facades_and_the_codecs():
    """The package loads these by name on first use (mp.jax...): the facades on the top
    floor, which import their framework, and the core's codecs; nothing else."""
    import mixedpolicy

    mods = _modules()
    for name in mixedpolicy._LAZY_MODULES:
        module = f"mixedpolicy.{name}"
        assert module in mods and (module in TOP_FACADES or module == "mixedpolicy.codecs"), module


def test_no_import_runs_back_up():
    """The ground floor imports only itself, the core never imports a backend or the bench
    (inside functions included, by import statement, by `import_module` string or by a
    `sys.modules` probe): the registry reaches backends through its table, once their
    framework is imported. A backend never imports the bench."""
    mods = _modules()
    assert GROUND <= set(mods), GROUND - set(mods)
    up = sorted((a, b) for a, targets in _edges(mods).items() for b in targets
                if _floor(b) > _floor(a)
                or (a.startswith("mixedpolicy.backends") and b.startswith("mixedpolicy.bench")))
    assert up == []


def test_every_framework_folder_has_the_same_file_names_for_the_same_parts():
    """arrays.py for ArrayOps; modules/layers/flax/equinox.py for models; optimizer/optax.py
    for optimizers: what the registry's rows name."""
    from mixedpolicy import _registry

    for entry in _registry.ENTRIES:
        for target, names in ((entry.arrays, {"arrays"}),
                              (entry.models, {"modules", "layers", "flax", "equinox"}),
                              (entry.optimizers, {"optimizer", "optax"})):
            if target:
                module = target.partition(":")[0]
                assert module.count(".") == 3 and module.rsplit(".", 1)[1] in names, target
                assert (ROOT.parent / (module.replace(".", "/") + ".py")).exists(), target


FRAMEWORK_MODULES = {"torch", "jax", "jaxlib", "tensorflow", "keras", "flax", "optax", "equinox", "jmp"}


def _framework_probes(path: Path) -> list:
    """Where `path` imports a framework, reaches one by its module's name (an import_module /
    __import__ / sys.modules probe) or tells one by it (``xp.__name__ == "torch"``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        texts = []
        if isinstance(node, ast.Import):
            texts = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            texts = [node.module]
        elif isinstance(node, ast.Compare):
            texts = [n.value for n in (node.left, *node.comparators) if isinstance(n, ast.Constant)]
        elif isinstance(node, (ast.Call, ast.Subscript)):
            texts = [t for t in [_named_text(node)] if t]
        found += [f"{path.name}:{node.lineno}" for t in texts
                  if isinstance(t, str) and t.partition(".")[0] in FRAMEWORK_MODULES]
    return found


def _named_text(node) -> str | None:
    if isinstance(node, ast.Call) and node.args:
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if called in ("import_module", "__import__", "find_spec") or (
                called == "get" and isinstance(func.value, ast.Attribute) and func.value.attr == "modules"):
            return _literal_prefix(node.args[0])
    elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "modules":
        return _literal_prefix(node.slice)
    return None


def test_the_core_names_no_framework(tmp_path):
    """The core (floor 1) neither imports a framework nor reaches or tells one by its name: the
    registry (ground floor) holds the one table of frameworks, and each backend hands the core
    what it needs (an ArrayOps, an array namespace) instead of the core asking which it is."""
    core = [p for m, p in _modules().items() if _floor(m) == 1]
    assert len(core) > 10
    assert [hit for p in core for hit in _framework_probes(p)] == []
    sample = tmp_path / "sample.py"  # the probe sees what it is meant to see
    sample.write_text('import sys\nif xp.__name__ == "torch": pass\nsys.modules.get("jax")\n'
                      'def f():\n    from tensorflow import nest\n')
    assert _framework_probes(sample) == ["sample.py:2", "sample.py:3", "sample.py:5"]
