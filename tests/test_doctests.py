"""The examples in module docstrings are run, so they cannot rot."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGES = (
    "freshrec",
    "schemas",
    "freshcore",
    "streams",
    "inference",
    "param_server",
    "evaluation",
    "tools",
)
MODULES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts)
    for pkg in PACKAGES
    for p in (ROOT / pkg).rglob("*.py")  # the wings of inference/ and freshrec/app, sim too
    if ">>>" in p.read_text()
)


def test_the_modules_in_subpackages_are_found():
    assert "inference.serving.rerank" in MODULES and "inference.learning.outbox" in MODULES
    assert "freshcore.sequels" in MODULES  # the kernel's examples run too


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
