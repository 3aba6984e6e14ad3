"""The public face: what ``from freshrec import …`` gives, and one base for every error."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import pytest

from tests.test_architecture import MODULES, layer


def test_the_client_and_the_error_base_come_from_the_package():
    from freshrec import FreshRecError, RecommendClient, RecommendTimeout, SyncRecommendClient
    from freshrec.client import RecommendClient as Direct

    assert RecommendClient is Direct
    assert issubclass(RecommendTimeout, FreshRecError) and RecommendTimeout.retriable
    assert issubclass(RecommendTimeout, TimeoutError)  # callers catching TimeoutError still do
    assert SyncRecommendClient.__module__ == "freshrec.client"
    with pytest.raises(AttributeError):
        import freshrec

        _ = freshrec.NoSuchThing


def test_importing_the_package_does_not_import_the_client_until_it_is_used():
    # every service process imports freshrec (its command line); the client costs ~0.4 s
    code = "import sys, freshrec; print('aiokafka' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


LIBRARY = [n for n in MODULES if layer(n) != "tools" and not n.endswith("__main__")]


def _errors() -> list[tuple[str, type]]:
    found = []
    for name in LIBRARY:
        module = importlib.import_module(name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == name:
                found.append((f"{name}.{obj.__name__}", obj))
    return found


ERRORS = _errors()


def test_the_project_defines_errors():
    assert len(ERRORS) >= 12


@pytest.mark.parametrize("name,cls", ERRORS, ids=[n for n, _ in ERRORS])
def test_every_error_derives_from_the_one_base(name, cls):
    from freshrec import FreshRecError

    assert issubclass(cls, FreshRecError), f"{name} does not derive from FreshRecError"
