"""A secure Apache Kafka node for the tests, built from the deployment's own definitions: the
broker properties and SCRAM users of ``deploy/kafka/start.sh`` (what docker-compose runs:
SASL/SCRAM-SHA-512 listeners, the StandardAuthorizer, nothing allowed without an ACL), every
listener moved to a free loopback port, and the client listener on TLS as the Kubernetes
ConfigMap's ``SASL_SSL`` asks, with a CA made at run time by openssl. Each principal's
password is a fresh random one, so a test can look for it in every log.

``start.sh`` stays a shell script (it runs in the broker's container, where FreshRec is not
installed); what it defines is read from it here, never copied.
"""

from __future__ import annotations

import re
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from freshrec.app.stack import free_port, stop_pids
from freshrec.app.stack.apachekafka import (
    BROKER_JVM,
    SINGLE_MACHINE,
    STARTED,
    TOOL_JVM,
    KafkaNode,
    cluster_id,
    failure_reason,
    java_argv,
    read_from,
)
from freshrec.app.stack.ports import accepts
from freshrec.app.stack.processes import spawn

ROOT = Path(__file__).resolve().parents[1]
START_SH = ROOT / "deploy" / "kafka" / "start.sh"
CLIENT_LISTENER, BROKER_LISTENER = "EXTERNAL", "INTERNAL"
"""``EXTERNAL``: clients outside the broker's network (here on TLS); ``INTERNAL``: between
brokers and, in docker-compose, the services on the compose network (SASL over plaintext)."""
FORMAT_TIMEOUT_S = 180.0


def start_script_properties(text: str) -> dict[str, str]:
    """The ``server.properties`` that ``start.sh`` writes, its ``${VARS}`` left in.

    >>> start_script_properties("cat >x <<PROPS\\na=1\\nb=${B}\\nPROPS\\n")
    {'a': '1', 'b': '${B}'}
    """
    block = re.search(r"<<PROPS\n(.*?)\nPROPS\n", text, re.S)
    if block is None:
        raise ValueError("start.sh writes no server.properties (no <<PROPS block)")
    lines = [x for x in block.group(1).splitlines() if x.strip() and not x.startswith("#")]
    return dict(line.split("=", 1) for line in lines)


def scram_users(text: str) -> dict[str, str]:
    """The SCRAM-SHA-512 users ``start.sh`` creates, each with its password's variable.

    >>> scram_users('--add-scram "SCRAM-SHA-512=[name=worker,password=${KAFKA_W}]"')
    {'worker': 'KAFKA_W'}
    """
    return dict(re.findall(r"SCRAM-SHA-512=\[name=([\w-]+),password=\$\{(\w+)\}\]", text))


def substituted(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], value)


def listener_names(listeners: str) -> list[str]:
    return [entry.split("://", 1)[0] for entry in listeners.split(",")]


def on_loopback(props: dict[str, str], ports: dict[str, int], tls: str) -> dict[str, str]:
    """``props`` with every listener (and the controller voter) on its loopback port, and the
    ``tls`` listener's SASL over TLS instead of plaintext."""
    out = dict(props)
    for key in ("listeners", "advertised.listeners"):
        out[key] = ",".join(f"{n}://127.0.0.1:{ports[n]}" for n in listener_names(props[key]))
    controller = props["controller.listener.names"]
    out["controller.quorum.voters"] = f"{props['node.id']}@127.0.0.1:{ports[controller]}"
    protocols = dict(p.split(":") for p in props["listener.security.protocol.map"].split(","))
    protocols[tls] = protocols[tls].replace("PLAINTEXT", "SSL")
    out["listener.security.protocol.map"] = ",".join(f"{n}:{p}" for n, p in protocols.items())
    return out


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {done.stderr.strip()[-400:]}")


def make_ca(directory: Path) -> Path:
    """A throwaway CA (``ca.pem``) in ``directory``, and a broker certificate for
    127.0.0.1/localhost that it signed, with its key, in one PEM keystore
    (``broker-keystore.pem``: the unencrypted PKCS#8 key, then the chain, which Kafka's PEM
    keystore reads). Returns the CA file."""
    directory.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
             "/CN=freshrec-test-ca", "-keyout", "ca.key", "-out", "ca.pem",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=directory)  # fmt: skip
    _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048",
             "-out", "broker.key", cwd=directory)  # fmt: skip
    _openssl("req", "-new", "-key", "broker.key", "-subj", "/CN=localhost", "-out", "broker.csr",
             cwd=directory)  # fmt: skip
    (directory / "broker.ext").write_text(
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n"
    )
    _openssl("x509", "-req", "-in", "broker.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "2", "-extfile", "broker.ext", "-out", "broker.crt",
             cwd=directory)  # fmt: skip
    parts = ("broker.key", "broker.crt", "ca.pem")
    keystore = "".join((directory / p).read_text() for p in parts)
    (directory / "broker-keystore.pem").write_text(keystore)
    (directory / "broker-keystore.pem").chmod(0o600)
    return directory / "ca.pem"


@dataclass
class SecureKafka:
    """One KRaft node (broker and controller) as ``start.sh`` defines it, on loopback."""

    java: str
    lib: Path
    home: Path
    passwords: dict[str, str] = field(default_factory=dict)
    """Each SCRAM user's password, fresh and random: ``admin`` and every service's."""
    ports: dict[str, int] = field(default_factory=dict)
    """Each listener's port: ``EXTERNAL`` (SASL_SSL), ``INTERNAL`` (SASL_PLAINTEXT) and the
    controller's (PLAINTEXT)."""
    properties: dict[str, str] = field(default_factory=dict)
    ca: Path | None = None
    proc: subprocess.Popen | None = None

    @property
    def node(self) -> KafkaNode:
        return KafkaNode(1, self.ports[CLIENT_LISTENER], self.ports["CONTROLLER"],
                         self.home / "node", self.home / "logs")  # fmt: skip

    def bootstrap(self, listener: str = CLIENT_LISTENER) -> str:
        return f"127.0.0.1:{self.ports[listener]}"

    def protocol(self, listener: str) -> str:
        return dict(
            p.split(":") for p in self.properties["listener.security.protocol.map"].split(",")
        )[listener]

    def security_env(self, principal: str, listener: str = CLIENT_LISTENER) -> dict[str, str]:
        """The environment a FreshRec process reads to log in as ``principal``."""
        env = {
            "KAFKA_BOOTSTRAP_SERVERS": self.bootstrap(listener),
            "KAFKA_SECURITY_PROTOCOL": self.protocol(listener),
            "KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
            "KAFKA_SASL_USERNAME": principal,
            "KAFKA_SASL_PASSWORD": self.passwords[principal],
        }
        if env["KAFKA_SECURITY_PROTOCOL"].endswith("SSL"):
            env["KAFKA_SSL_CA_LOCATION"] = str(self.ca)
        return env

    def client_config(self, principal: str, listener: str = CLIENT_LISTENER, **kw) -> dict:
        """A librdkafka client's settings to log in as ``principal``, through FreshRec's own
        ``KafkaSecurity`` (``kw``: settings over them)."""
        from freshcore.settings import KafkaSecurity

        env = self.security_env(principal, listener)
        security = KafkaSecurity.from_env(env).librdkafka()
        return {"bootstrap.servers": env["KAFKA_BOOTSTRAP_SERVERS"], **security, **kw}

    # ---------------------------------------------------------------------------- start
    def start(self, timeout_s: float) -> None:
        """Certificates, properties, storage formatted with the SCRAM users, then the node
        started and waited on until it serves."""
        text = START_SH.read_text()
        self.passwords = {user: secrets.token_urlsafe(24) for user in scram_users(text)}
        self.ca = make_ca(self.home / "certs")
        props = start_script_properties(text)
        self.ports = {name: free_port() for name in listener_names(props["listeners"])}
        self.properties = self._properties(props, text)
        node = self.node
        node.home.mkdir(parents=True, exist_ok=True)
        node.properties.write_text("".join(f"{k}={v}\n" for k, v in self.properties.items()))
        self._format(text)
        log_at = node.server_log.stat().st_size if node.server_log.exists() else 0
        argv = java_argv(self.java, self.lib, node, "kafka.Kafka", BROKER_JVM)
        self.proc = spawn([*argv, str(node.properties)], node.console, detach=False)
        self._wait(log_at, timeout_s)

    def _properties(self, props: dict[str, str], text: str) -> dict[str, str]:
        env = {var: self.passwords[user] for user, var in scram_users(text).items()}
        env["KAFKA_EXTERNAL_HOST"] = "127.0.0.1"
        props = {k: substituted(v, env) for k, v in props.items()}
        props = on_loopback(props, self.ports, CLIENT_LISTENER)
        return {
            **SINGLE_MACHINE,
            **props,
            "log.dirs": str(self.node.data),
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(self.home / "certs" / "broker-keystore.pem"),
        }

    def _format(self, text: str) -> None:
        users = scram_users(text)
        scram = [
            a
            for user in users
            for a in ("--add-scram", f"SCRAM-SHA-512=[name={user},password={self.passwords[user]}]")
        ]
        node = self.node
        node.logs.mkdir(parents=True, exist_ok=True)
        argv = java_argv(self.java, self.lib, node, "kafka.tools.StorageTool", TOOL_JVM)
        done = subprocess.run(
            [*argv, "format", "-t", cluster_id(), "-c", str(node.properties), *scram],
            capture_output=True,
            text=True,
            timeout=FORMAT_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
        if done.returncode != 0:
            raise RuntimeError(f"formatting failed: {failure_reason(done.stdout + done.stderr)}")

    def _wait(self, log_at: int, timeout_s: float) -> None:
        node, deadline = self.node, time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                reason = failure_reason(node.console.read_text(errors="replace"))
                raise RuntimeError(f"the secure broker exited at start: {reason}")
            if accepts(node.port) and STARTED in read_from(node.server_log, log_at):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the secure broker did not serve within {timeout_s:.0f}s")
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 30 s; waits until the process has gone."""
        if self.proc is not None and self.proc.poll() is None:
            stop_pids([self.proc.pid], grace_s=30)
        if self.proc is not None:
            self.proc.wait(10)

    def logs(self) -> str:
        """Everything the broker wrote: its server log and its console."""
        node = self.node
        return "".join(p.read_text(errors="replace") for p in (node.server_log, node.console)
                       if p.exists())  # fmt: skip


def secure_kafka_or_why(home: Path) -> SecureKafka | str:
    """A (not yet started) secure node in ``home``, or why none can run here: no Java 17 or
    newer, Apache Kafka's jars not fetched (``freshrec stack fetch``), or no openssl."""
    from freshrec.app.stack import StackError, choose_broker

    if shutil.which("openssl") is None:
        return "no openssl on PATH to make the test CA"
    try:
        choice = choose_broker("kafka", may_fetch=False)
    except StackError as exc:
        return f"no Apache Kafka to run: {exc}"
    return SecureKafka(choice.java.path, choice.release.lib, home)
