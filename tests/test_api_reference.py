"""The API reference as a reader sees it: docs/api.md rendered by MkDocs (what `make docs`
builds) shows every public name under the name users type, a callable with its signature, and
no doctest prompt outside a code block on any page."""

import html
import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import mixedpolicy

ROOT = Path(__file__).resolve().parent.parent
#: the framework facades: mixedpolicy.<name>.<each name in its __all__>
FACADES = ("torch", "jax", "keras", "tensorflow", "lightning", "huggingface")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--quiet", "--site-dir", str(out)], cwd=ROOT,
                          env=dict(os.environ, NO_MKDOCS_2_WARNING="1"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def public_names():
    names = [f"mixedpolicy.{name}" for name in mixedpolicy.__all__]
    for facade in FACADES:
        # the facades' own modules import no framework; their __all__ is read from the source
        source = (ROOT / "mixedpolicy" / f"{facade}.py").read_text()
        listed = re.search(r"^__all__ = \[(.*?)\]", source, re.S | re.M)
        assert listed, f"mixedpolicy/{facade}.py has no __all__"
        names += [f"mixedpolicy.{facade}.{name}" for name in re.findall(r'"(\w+)"', listed[1])]
    return names


def headings(page: str) -> dict:
    """id -> the heading's text, for every documented object on a rendered page."""
    found = re.findall(r'<h\d id="(mixedpolicy[\w.]*)" class="doc doc-heading">(.*?)</h\d>', page, re.S)
    return {ident: re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", "", text))).strip() for ident, text in found}


def test_every_public_name_is_in_the_reference_with_its_signature(site):
    shown = headings((site / "api" / "index.html").read_text())
    missing = [name for name in public_names() if name not in shown]
    assert not missing, f"not in docs/api.md under the name users type: {missing}"
    for name in public_names():
        module, _, attr = name.rpartition(".")
        obj = getattr(importlib.import_module(module), attr) if module == "mixedpolicy" else None
        if callable(obj) and not inspect.isabstract(obj) and not isinstance(obj, type(mixedpolicy)):
            assert shown[name].startswith(f"{name}(") or f"{name}(" in shown[name], \
                f"{name} is shown without its signature: {shown[name]!r}"


def test_the_facades_classes_show_how_to_construct_them(site):
    shown = headings((site / "api" / "index.html").read_text())
    for name, argument in (("mixedpolicy.lightning.Precision", "policy=None"),
                           ("mixedpolicy.huggingface.Trainer", "policy=None"),
                           ("mixedpolicy.huggingface.Accelerator", "policy=None"),
                           ("mixedpolicy.LossScaleOptimizer", "initial_scale=None"),
                           ("mixedpolicy.Policy", "compute_dtype=None")):
        assert argument in shown[name], shown[name]


def test_no_doctest_prompt_escapes_its_code_block(site):
    for page in sorted(site.rglob("*.html")):
        text = re.sub(r"<(pre|code)\b.*?</\1>", "", page.read_text(), flags=re.S)
        assert "&gt;&gt;&gt;" not in text, f"{page.relative_to(site)}: a >>> line rendered as text"
