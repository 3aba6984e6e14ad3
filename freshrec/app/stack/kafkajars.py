"""The Apache Kafka release the stack runs: pinned in ``kafka-broker/pom.xml`` (package data)
and resolved by Maven into a cache outside the checkout, once.

The jars of release V live in ``$XDG_CACHE_HOME/freshrec/kafka/V/lib`` (``~/.cache`` when
``XDG_CACHE_HOME`` is unset), Maven's own repository beside them in ``…/freshrec/kafka/m2``.
``fetch`` runs ``mvn -C`` (a checksum that does not match fails the fetch instead of being
warned about) into a folder of its own and renames it to ``lib`` only when Maven succeeded,
so a ``lib`` folder is always whole; with ``lib`` there nothing is asked of Maven again, and
the broker starts offline.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from freshrec.app.stack.errors import StackError

BROKER_FILES = Path(__file__).resolve().parent / "kafka-broker"
"""The pom that pins the release and the broker's log4j2 configuration."""
POM = BROKER_FILES / "pom.xml"
LOG4J2 = BROKER_FILES / "log4j2.properties"
MAVEN_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class KafkaRelease:
    """The pinned release and where its jars are cached."""

    version: str
    cache: Path
    """``…/freshrec/kafka``: each version's ``lib`` and Maven's repository ``m2``."""

    @property
    def lib(self) -> Path:
        return self.cache / self.version / "lib"

    @property
    def name(self) -> str:
        return f"Apache Kafka {self.version}"

    def fetched(self) -> bool:
        """The jars are in the cache (a ``lib`` folder is only ever there whole)."""
        return (self.lib / f"kafka_2.13-{self.version}.jar").is_file()


@cache
def pinned_version(pom: Path = POM) -> str:
    """The Kafka version the pom names (its ``kafka.version`` property)."""
    ns = {"m": "http://maven.apache.org/POM/4.0.0"}
    found = ET.parse(pom).getroot().find("m:properties/m:kafka.version", ns)
    if found is None or not (found.text or "").strip():
        raise StackError(f"{pom} names no kafka.version")
    return found.text.strip()


def cache_root(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/freshrec/kafka``, or ``~/.cache/freshrec/kafka``."""
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "freshrec" / "kafka"


def kafka_release(env: Mapping[str, str] | None = None) -> KafkaRelease:
    return KafkaRelease(pinned_version(), cache_root(env))


def maven_argv(mvn: str, pom: Path, repo: Path, out: Path) -> list[str]:
    """Maven copying the pom's runtime dependencies into ``out``; ``-C``: strict checksums."""
    return [
        mvn,
        "-B",
        "-q",
        "-C",
        "-f",
        str(pom),
        f"-Dmaven.repo.local={repo}",
        "dependency:copy-dependencies",
        "-DincludeScope=runtime",
        f"-DoutputDirectory={out}",
    ]


def maven_failure(output: str) -> str:
    """Maven's reason in one line: its first ``[ERROR]`` line (else its last line).

    >>> maven_failure("[INFO] x\\n[ERROR] Failed to execute goal: Unknown host\\n[ERROR] -> [Help 1]")
    'Failed to execute goal: Unknown host'
    """
    lines = [x.strip() for x in output.splitlines() if x.strip()]
    for line in lines:
        if line.startswith("[ERROR]") and line[7:].strip():
            return line[7:].strip()
    return lines[-1] if lines else "no output"


def fetch(release: KafkaRelease, mvn: str | None = None) -> Path:
    """The release's jars in the cache, fetched with Maven when they are not there yet;
    raises ``StackError`` with the reason in one line (nothing half-fetched is left)."""
    if release.fetched():
        return release.lib
    mvn = mvn or shutil.which("mvn")
    if mvn is None:
        raise StackError(f"no mvn on PATH to fetch {release.name} into {release.lib}")
    release.lib.parent.mkdir(parents=True, exist_ok=True)
    with _fetch_lock(release.lib.parent / ".fetch.lock"):
        if release.fetched():  # another process fetched it while this one waited
            return release.lib
        partial = release.lib.with_name("lib.partial")
        shutil.rmtree(partial, ignore_errors=True)
        pom = (
            release.lib.parent / "pom.xml"
        )  # Maven may write next to its pom: not in site-packages
        shutil.copyfile(POM, pom)
        try:
            done = subprocess.run(
                maven_argv(mvn, pom, release.cache / "m2", partial),
                capture_output=True,
                text=True,
                timeout=MAVEN_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            shutil.rmtree(partial, ignore_errors=True)
            raise StackError(f"mvn could not fetch {release.name}: {exc}") from None
        if done.returncode != 0 or not (partial / f"kafka_2.13-{release.version}.jar").is_file():
            shutil.rmtree(partial, ignore_errors=True)
            reason = maven_failure(done.stdout + done.stderr)
            raise StackError(f"mvn could not fetch {release.name}: {reason}")
        partial.rename(release.lib)
    return release.lib


@contextlib.contextmanager
def _fetch_lock(path: Path):
    """One fetch at a time per cache (two `make` runs, two test workers)."""
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
