"""Each setting is declared once (``freshcore/declare.py``), and the declarations are the only
place the code reads a variable from, the only place a default is written, and the source of
the settings reference (``docs/settings.md``, ``python -m tools.settings_doc``)."""

from __future__ import annotations

import ast
import re

import pytest

from tests.test_architecture import MODULES, layer
from tools import settings_doc

ENV_NAME = re.compile(r"^(FRESHREC|KAFKA|REDIS)_[A-Z0-9_]+$")
DECLARED = settings_doc.declared()
LIBRARY = {n: p for n, p in MODULES.items() if layer(n) != "tools"}


def _names_in(tree: ast.AST) -> set[str]:
    """Every variable name written out whole (not the stem of an f-string)."""
    stems = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and id(node) not in stems
        and isinstance(node.value, str)
        and ENV_NAME.match(node.value)
    }


def _raw_reads(tree: ast.AST) -> list[str]:
    """``x.get("FRESHREC_…")`` and ``x["FRESHREC_…"]`` reads: a variable read around its
    declaration, with a default of its own."""
    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "get" and node.args and isinstance(node.args[0], ast.Constant):
                key = node.args[0].value
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, ast.Load)
            and isinstance(node.slice, ast.Constant)
        ):
            key = node.slice.value
        if isinstance(key, str) and ENV_NAME.match(key):
            found.append(f"line {node.lineno}: {key}")
    return found


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n != "tools.settings_doc"))
def test_every_variable_the_code_names_is_declared(name):
    names = _names_in(ast.parse(MODULES[name].read_text()))
    unknown = sorted(n for n in names if n not in DECLARED)
    assert not unknown, f"{name} names variables no declaration declares: {unknown}"


@pytest.mark.parametrize("name", sorted(n for n in LIBRARY if n != "freshcore.declare"))
def test_no_library_module_reads_a_variable_around_its_declaration(name):
    reads = _raw_reads(ast.parse(LIBRARY[name].read_text()))
    assert not reads, f"{name} reads variables directly (use the declaration's read): {reads}"


def test_every_declared_setting_is_read_by_some_process():
    read = settings_doc.readers()
    unread = sorted(set(DECLARED) - set(read))
    assert not unread, f"declared but read by no process's settings: {unread}"


def test_the_settings_page_equals_the_declarations():
    page = settings_doc.PAGE.read_text()
    assert page == settings_doc.page_with(settings_doc.render()), (
        "docs/settings.md differs from the declarations: python -m tools.settings_doc"
    )


def test_a_variable_declared_twice_is_refused_at_import():
    from freshcore.declare import Setting

    Setting("TEST_ONCE_ONLY", 1, "Once.", kind=int, module="tests.one")
    with pytest.raises(RuntimeError, match="TEST_ONCE_ONLY is declared twice"):
        Setting("TEST_ONCE_ONLY", 2, "Twice.", kind=int, module="tests.two")


def test_a_mode_may_set_exactly_the_settings_declared_for_modes():
    from inference.serving.modes import MODE_SETTINGS, MODES

    assert {s.env for s in DECLARED.values() if s.modes} == MODE_SETTINGS
    for overrides in MODES.values():
        assert set(overrides) <= MODE_SETTINGS
