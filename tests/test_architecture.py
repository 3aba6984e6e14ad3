"""The layout keeps its promises: the top-level folders stand in floors and no import runs up
a floor or across to a neighbour on the same one; pure modules do no I/O; no two modules
import each other, directly or in a circle; no module or function grows past what a reader
can hold.

The floors (``docs/design.md``, "Module map"), from the ground up: ``schemas/`` (the wire
contracts, the error base, the id hashing every process agrees on) imports nothing of
FreshRec; ``freshcore/`` (the kernel: settings, Kafka and Redis, topics, metrics, the service
shape) stands on it alone; the services ``streams/``, ``inference/``, ``param_server/`` and the
replay's ``evaluation/`` stand on the kernel and the contracts, each apart from the others;
``freshrec/`` (the product: the public face, the client, the command line and app shell, the
simulator) stands on any of them; ``tools/`` (benchmarks and drills) on everything.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
FLOORS = {
    "schemas": 0,
    "freshcore": 1,
    "streams": 2,
    "inference": 2,
    "param_server": 2,
    "evaluation": 2,
    "freshrec": 3,
    "tools": 4,
}
"""Each top-level folder's floor: a module imports its own folder and the floors below."""
PACKAGES = tuple(FLOORS)
SERVICES = ("inference", "streams", "param_server")
IO_PACKAGES = {
    "confluent_kafka",
    "aiokafka",
    "faust",
    "redis",
    "socket",
    "requests",
    "mode",
    "http",
    "urllib",
    "subprocess",
    "threading",
}
MAX_LINES = 450
MAX_FUNCTION_LINES = 60


def modules() -> dict[str, Path]:
    """Every module of the project's packages, by dotted name."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = path
    return out


MODULES = modules()


def imports(path: Path) -> set[str]:
    """The modules ``path`` imports, anywhere in it (a lazy import counts)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def project_imports(name: str) -> set[str]:
    return {m for m in imports(MODULES[name]) if m in MODULES and m != name}


def layer(name: str) -> str:
    """The top-level folder a module lives in (``freshcore.kafka`` -> ``freshcore``)."""
    return name.split(".")[0]


def pure_modules() -> list[str]:
    """Modules whose docstring says they are pure ("Pure." in it)."""
    out = []
    for name, path in MODULES.items():
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if re.search(r"\bPure[.:]", doc):
            out.append(name)
    return out


PURE = pure_modules()


def test_the_pure_modules_are_found():
    # the ones the design names as pure; a docstring that lost "Pure." would drop its check
    for name in (
        "freshcore.hotscore",
        "streams.decay",
        "inference.learning.pending",
        "inference.learning.outbox",
        "inference.learning.steps",
        "inference.batching",
        "inference.serving.breaker",
        "inference.serving.rerank",
        "param_server.adagrad",
        "schemas.rows",
    ):
        if name in MODULES:
            assert name in PURE, f"{name}'s docstring no longer says it is pure"
    assert len(PURE) >= 20


@pytest.mark.parametrize("name", PURE)
def test_pure_modules_import_no_io(name):
    top_level = {m.split(".")[0] for m in imports(MODULES[name])}
    assert not top_level & IO_PACKAGES, f"{name} imports {sorted(top_level & IO_PACKAGES)}"


@pytest.mark.parametrize("name", [n for n in MODULES if layer(n) != "tools"])
def test_nothing_but_the_tools_imports_tools_or_tests(name):
    bad = {m for m in imports(MODULES[name]) if m.split(".")[0] in ("tools", "tests")}
    assert not bad, f"{name} imports {sorted(bad)}"


@pytest.mark.parametrize("name", [n for n in MODULES if layer(n) != "tools"])
def test_no_import_runs_up_a_floor_or_across_to_a_neighbour(name):
    own = layer(name)
    bad = {m for m in project_imports(name) if layer(m) != own and FLOORS[layer(m)] >= FLOORS[own]}
    assert not bad, f"{name} (floor {FLOORS[own]}) imports {sorted(bad)}"


def test_every_top_level_package_has_a_floor():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert packages == set(FLOORS), f"a package without a floor: {packages ^ set(FLOORS)}"


@pytest.mark.parametrize("name", [n for n in MODULES if n.startswith("freshrec.sim")])
def test_the_simulator_is_a_client_like_any_other(name):
    """The synthetic world and the closed loop stand on the kernel, the wire contracts and
    the public client: they reach the services only over Kafka and Redis, as a user's code
    would."""
    bad = {
        m
        for m in project_imports(name)
        if layer(m) in (*SERVICES, "evaluation") or m.startswith("freshrec.app")
    }
    assert not bad, f"{name} imports {sorted(bad)}"


# The worker's wings (``docs/design.md``, "Module map"): each may import its own rooms, the
# wings listed here, and the loop's pure leaves; the loop at the top of ``inference/`` (the
# worker, its intake, commits, offsets, batching, routing and settings) may import any wing.
WINGS = {
    "tables": set(),
    "models": set(),
    "learning": {"tables"},
    "serving": {"tables", "models"},
    "training": {"models"},
}
LOOP_LEAVES = {"inference.device", "inference.offsets"}
"""The loop's modules a wing may use: where the tables live, and the offset gate."""


def wing(name: str) -> str | None:
    """``inference.serving.recall`` -> ``serving``; a module of the loop -> None."""
    parts = name.split(".")
    return parts[1] if parts[0] == "inference" and len(parts) > 1 and parts[1] in WINGS else None


def test_every_inference_module_lives_in_a_wing_or_the_loop():
    loop = sorted(
        n for n in MODULES if n.startswith("inference.") and wing(n) is None and n.count(".") == 1
    )
    assert set(loop) <= {
        "inference.assembly",
        "inference.batching",
        "inference.clients",
        "inference.commits",
        "inference.device",
        "inference.eventflow",
        "inference.feedback",
        "inference.intake",
        "inference.offsets",
        "inference.route",
        "inference.settings",
        "inference.worker",
    } | {f"inference.{w}" for w in WINGS}, f"a new module of the loop: {loop} (or a new wing)"
    for w in WINGS:
        assert (ROOT / "inference" / w / "__init__.py").exists()


@pytest.mark.parametrize("name", [n for n in MODULES if wing(n) is not None])
def test_the_wings_stay_apart(name):
    own = wing(name)
    allowed = WINGS[own] | {own}
    bad = {
        m
        for m in project_imports(name)
        if m.startswith("inference")
        and m != "inference"
        and m not in LOOP_LEAVES
        and wing(m) not in allowed
    }
    assert not bad, f"{name} ({own}) imports {sorted(bad)}: the wing may use {sorted(allowed)}"


def test_no_modules_import_each_other_in_a_circle():
    graph = {name: project_imports(name) for name in MODULES}
    # a package's __init__ importing its own modules is not a circle through them
    graph = {n: {m for m in deps if not n.startswith(m + ".")} for n, deps in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("name", list(MODULES))
def test_no_module_grows_past_what_a_reader_can_hold(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name}: {lines} lines (at most {MAX_LINES}): split it"


@pytest.mark.parametrize("name", list(MODULES))
def test_no_function_grows_past_a_screen(name):
    """Counted from its first decorator to its last line, docstring and comments included:
    a function is split by what it does, not trimmed to fit."""
    long = []
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            if node.end_lineno - first + 1 > MAX_FUNCTION_LINES:
                long.append(f"{node.name} ({node.end_lineno - first + 1} lines)")
    assert not long, f"{name}: functions over {MAX_FUNCTION_LINES} lines: {long}"
