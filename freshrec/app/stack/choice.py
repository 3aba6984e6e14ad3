"""Which broker the embedded stack runs, and why: Apache Kafka where a Java 17 or newer is on
PATH and its jars are cached or Maven can fetch them, else Tansu.

``auto`` (the default) falls back to Tansu and says why; ``kafka`` asked for by name fails
with the reason instead. The reason is the first line every stack command prints::

    broker: Apache Kafka 4.4.0 (java 17.0.15, mvn found)
    broker: Tansu (embedded): no java on PATH
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

from freshrec.app.settings import BROKER
from freshrec.app.stack.errors import StackError
from freshrec.app.stack.kafkajars import KafkaRelease, fetch, kafka_release

BROKERS = BROKER.choices
"""What ``--broker`` and ``FRESHREC_BROKER`` accept: ``auto``, ``kafka``, ``tansu``."""
KAFKA, TANSU = "kafka", "tansu"
LEAST_JAVA = 17
"""Apache Kafka 4's brokers need Java 17 or newer."""


@dataclass(frozen=True)
class Java:
    path: str
    version: str

    @property
    def major(self) -> int:
        return java_major(self.version)


@dataclass(frozen=True)
class BrokerChoice:
    """The broker a stack runs: ``kafka`` (with the Java that runs it and the cached jars)
    or ``tansu``, and why, for the line that says so."""

    kind: str
    why: str
    java: Java | None = None
    release: KafkaRelease | None = None
    asked: str = "auto"
    """What was asked for: ``auto``, or the broker by name."""

    @property
    def name(self) -> str:
        return self.release.name if self.release else "Tansu"

    @property
    def line(self) -> str:
        if self.kind == KAFKA:
            return f"broker: {self.name} ({self.why})"
        return f"broker: Tansu (embedded): {self.why}"


def java_major(version: str) -> int:
    """The feature release of a ``java -version`` string (``1.8.0_292`` is 8).

    >>> java_major("17.0.15"), java_major("1.8.0_292"), java_major("25"), java_major("21-ea")
    (17, 8, 25, 21)
    """
    parts = re.findall(r"\d+", version)
    if not parts:
        raise ValueError(f"not a Java version: {version!r}")
    major = int(parts[0])
    return int(parts[1]) if major == 1 and len(parts) > 1 else major


def version_of(banner: str) -> str | None:
    """The version in ``java -version``'s banner (``openjdk version "17.0.15" 2025-04-15``).

    >>> version_of('openjdk version "17.0.15" 2025-04-15\\nOpenJDK Runtime Environment')
    '17.0.15'
    """
    m = re.search(r'version "([^"]+)"', banner)
    return m.group(1) if m else None


@cache
def _probe_java(path: str, mtime_ns: int) -> tuple[str | None, str]:
    """(version, banner) of the java at ``path``; cached per binary (``mtime_ns`` keys a
    replaced one), since each ask starts a JVM."""
    try:
        done = subprocess.run(
            [path, "-version"], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, str(exc)
    banner = (done.stderr + done.stdout).strip()
    return (version_of(banner) if done.returncode == 0 else None), banner


def find_java() -> Java:
    """The ``java`` on PATH, if it runs and is new enough for Apache Kafka; else
    ``StackError`` with the reason."""
    path = shutil.which("java")
    if path is None:
        raise StackError("no java on PATH")
    resolved = str(Path(path).resolve())
    version, banner = _probe_java(resolved, Path(resolved).stat().st_mtime_ns)
    if version is None:
        first = banner.splitlines()[0] if banner else "no output"
        raise StackError(f"{path} does not run: {first}")
    java = Java(resolved, version)
    try:
        major = java.major
    except ValueError:
        raise StackError(f"{path} gives no version Apache Kafka can check: {version}") from None
    if major < LEAST_JAVA:
        raise StackError(
            f"java {version} on PATH is older than the {LEAST_JAVA} Apache Kafka needs"
        )
    return java


def choose_broker(requested: str = "auto", *, may_fetch: bool = False) -> BrokerChoice:
    """The broker for ``requested`` (``auto``, ``kafka`` or ``tansu``). ``may_fetch``: the
    jars may be fetched with Maven here (the command line does; a test never does). Asked
    for ``kafka``, whatever keeps it from running raises ``StackError``."""
    if requested not in BROKERS:
        raise StackError(f"unknown broker {requested!r} (known: {', '.join(BROKERS)})")
    if requested == TANSU:
        return BrokerChoice(
            TANSU, "asked for (--broker tansu or FRESHREC_BROKER=tansu)", asked=TANSU
        )
    try:
        return replace(_kafka_choice(kafka_release(), may_fetch), asked=requested)
    except StackError as exc:
        if requested == KAFKA:
            raise
        return BrokerChoice(TANSU, str(exc))


def _kafka_choice(release: KafkaRelease, may_fetch: bool) -> BrokerChoice:
    java = find_java()
    mvn = shutil.which("mvn")
    if release.fetched():
        why = f"java {java.version}, " + ("mvn found" if mvn else "jars cached")
        return BrokerChoice(KAFKA, why, java, release)
    if mvn is None:
        raise StackError(f"no mvn on PATH to fetch {release.name}")
    if not may_fetch:
        raise StackError(
            f"{release.name} is not fetched yet into {release.lib} "
            "(`freshrec stack fetch`, or make)"
        )
    fetch(release, mvn)
    return BrokerChoice(KAFKA, f"java {java.version}, mvn found", java, release)
