"""A Java harness (tests/interop/*, each one runnable jar built by `make`) as one long-lived process for the test
session: a JSON request line on its stdin, a JSON answer line on its stdout, calls serialized."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any, BinaryIO


class JsonLineProcess:
    """`java -jar JAR`; `call(op, **params)` returns the answer's fields or raises `refused(error, trace)`."""

    name = "the Java harness"  # in error messages
    make_target = ""

    def __init__(self, jar: Path, log: BinaryIO | int = subprocess.DEVNULL) -> None:
        java = shutil.which("java")
        if java is None:
            raise RuntimeError(f"java is needed for {self.name}: apt-get install -y openjdk-17-jre-headless")
        if not jar.exists():
            raise RuntimeError(f"{jar} is missing: build it with `make {self.make_target}` (Maven, Java 17)")
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

    def refused(self, error: str, trace: str) -> Exception:
        return RuntimeError(error + ("\n" + trace if trace else ""))

    def call(self, op: str, **params: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self.lock:
            self.proc.stdin.write(json.dumps({"op": op, **params}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited ({self.proc.poll()})")
        answer = json.loads(line)
        if not answer.pop("ok"):
            raise self.refused(answer["error"], answer.get("trace", ""))
        return answer

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
