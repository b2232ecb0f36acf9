"""Eclipse Metro 4.0.4 (tests/interop/metro, built by `make metro`) as a long-lived Java process: JSON lines on its
stdin and stdout, one JVM for the whole test session. `call` has Metro read the gateway's published WSDL and its
WS-SecurityPolicy as they are, and send payloads on one Dispatch: the client's keys and trust are the only
configuration (tests/interop/metro/src/main/java/wsgate/metro/ClientConfig.java)."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any, BinaryIO

JAR = Path(__file__).parents[1] / "interop" / "metro" / "target" / "metro-client.jar"


class MetroError(Exception):
    """Metro refused or failed (its own error text and causes); `trace` is the Java stack trace."""

    def __init__(self, message: str, trace: str = "") -> None:
        super().__init__(message)
        self.trace = trace


class Metro:
    """One `java -jar metro-client.jar` process; calls are serialized (one request line, one answer line)."""

    def __init__(self, log: BinaryIO | int = subprocess.DEVNULL, jar: Path = JAR) -> None:
        java = shutil.which("java")
        if java is None:
            raise RuntimeError("java is needed for the Metro interop tests: apt-get install -y openjdk-17-jre-headless")
        if not jar.exists():
            raise RuntimeError(f"{jar} is missing: build it with `make metro` (Maven, Java 17)")
        # C1 only: a test session is short, and the JIT's start-up is most of its Java time.
        self.proc = subprocess.Popen(
            [java, "-XX:TieredStopAtLevel=1", "-jar", str(jar)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            encoding="utf-8",
        )
        self.lock = threading.Lock()
        self.call("ping")

    def call(self, op: str, **params: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self.lock:
            self.proc.stdin.write(json.dumps({"op": op, **params}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the Metro client exited ({self.proc.poll()})")
        answer = json.loads(line)
        if not answer.pop("ok"):
            raise MetroError(answer["error"], answer.get("trace", ""))
        return answer

    def invoke(self, wsdl: str, service: str, port: str, payloads: list[str], **params: Any) -> list[str]:
        """Metro's replies to `payloads`, sent in turn on one Dispatch of `port` built from the WSDL at `wsdl`."""
        return self.call("call", wsdl=wsdl, service=service, port=port, payloads=payloads, **params)["replies"]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
