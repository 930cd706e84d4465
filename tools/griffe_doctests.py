"""A griffe extension for the API reference (mkdocs.yml): a docstring's doctest examples, the
``>>>`` lines and the output under them, become fenced ``pycon`` blocks, so Markdown renders
them as code instead of nested blockquotes. The docstrings themselves stay plain doctests.

A class built by ``__new__`` alone (``LossScaleOptimizer``, a factory) gets its heading's
signature from ``__new__``, and a ``NamedTuple`` one from its fields, as other classes get
theirs from ``__init__``."""

from __future__ import annotations

from typing import Any

import griffe


def fence_doctests(text: str) -> str:
    """`text` with each run of doctest lines (from a ``>>>`` line to the next blank line or
    dedent) inside a fenced ``pycon`` block; text already in a fence is left as it is."""
    lines, out, i, fenced = text.split("\n"), [], 0, False
    while i < len(lines):
        line = lines[i]
        stripped = line.lstrip()
        if stripped.startswith("```"):
            fenced = not fenced
        if fenced or not stripped.startswith(">>>"):
            out.append(line)
            i += 1
            continue
        indent = line[:len(line) - len(stripped)]
        block = []
        while i < len(lines) and lines[i].strip() and lines[i].startswith(indent):
            block.append(lines[i][len(indent):])
            i += 1
        out += [indent + "```pycon", *(indent + b for b in block), indent + "```"]
    return "\n".join(out)


class DoctestBlocks(griffe.Extension):
    """Fences the doctests of every documented object's docstring."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(obj.docstring.value)


class ConstructorSignatures(griffe.Extension):
    """Gives a class with a ``__new__`` and no ``__init__`` of its own the ``__new__`` signature."""

    def on_class_members(self, *, cls: griffe.Class, **kwargs: Any) -> None:
        if "__init__" in cls.members:
            return
        new = cls.members.get("__new__")
        if isinstance(new, griffe.Function):
            parameters = new.parameters
        elif any(str(base).endswith("NamedTuple") for base in cls.bases):
            fields = [m for m in cls.members.values()
                      if isinstance(m, griffe.Attribute) and m.annotation is not None and not m.name.startswith("_")]
            parameters = griffe.Parameters(griffe.Parameter("self"), *(
                griffe.Parameter(f.name, annotation=f.annotation, default=f.value) for f in fields))
        else:
            return
        cls.set_member("__init__", griffe.Function("__init__", lineno=cls.lineno, endlineno=cls.lineno,
                                                   parameters=parameters, returns=None))
