"""The host under soak: its config file (built from a few knobs, so faults can edit it) and its
server process started through `expert-stream` on 127.0.0.1, in its own process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

HOSTS = ("openai", "mlx_lm")
# A model process of mlx-openai-server takes 15-120 s to start on 2 busy cores.
START_TIMEOUT_S = 600
BUDGETS = (0.00005, 0.0001, 0.0002)  # moe-a's budgets (GiB): 3, 6 and 12 of its 16 slots
ENTRY = {"prefill_step": 64}  # several prefill chunks for the long prompts


@dataclass
class ConfigKnobs:
    """What valid edits change: moe-a's budget, and whether moe-c is served."""

    budget_gib: float = BUDGETS[0]
    with_c: bool = False
    extra_options: dict = field(default_factory=dict)
    model_settings: dict = field(default_factory=dict)  # `soak --set`: in every streamed model's entry

    def document(self, host: str, folders: dict, port: int) -> dict:
        options = {"watch": True, "poll_seconds": 0.3, "debounce_seconds": 0.3, **self.extra_options}
        doc: dict = {"expert_stream": options}
        if host == "openai":
            options.setdefault("drain_timeout_s", 30)
            doc["server"] = {"host": "127.0.0.1", "port": port, "log_level": "WARNING"}
        streamed = {**ENTRY, **self.model_settings}
        models = [entry(folders, "moe-a", {"budget_gib": self.budget_gib, **streamed}),
                  entry(folders, "moe-b", dict(streamed)),  # budget_gib: auto
                  entry(folders, "dense", None)]
        if self.with_c:
            models.append(entry(folders, "moe-c", dict(streamed)))
        doc["models"] = models
        return doc


def entry(folders: dict, served: str, block) -> dict:
    out = {"model_path": str(folders[served]), "served_model_name": served}
    if block is not None:
        out["expert_stream"] = block
    return out


def dump(doc) -> str:
    return yaml.safe_dump(doc, sort_keys=False)


class HostUnderSoak:
    """`expert-stream serve` (mlx-openai-server) or `expert-stream mlx-lm-server` on a free port."""

    def __init__(self, host: str, folders: dict, work: Path, port: int, model_settings: dict | None = None):
        if host not in HOSTS:
            raise ValueError(f"host must be one of {', '.join(HOSTS)}, got {host!r}")
        self.host, self.folders, self.work, self.port = host, folders, Path(work), port
        self.base = f"http://127.0.0.1:{port}"
        self.config_path = self.work / "host.yaml"
        self.knobs = ConfigKnobs(model_settings=dict(model_settings or {}))
        self.process = None
        self.starts = 0
        self.down = threading.Event()  # set while the soak has killed the server and starts it again
        self._log = None

    def write_config(self, text: str | None = None) -> None:
        self.config_path.write_text(text if text is not None else self.valid_text())

    def valid_text(self) -> str:
        return dump(self.knobs.document(self.host, self.folders, self.port))

    def argv(self) -> list[str]:
        cli = [sys.executable, "-m", "expert_stream.plugin.cli"]
        if self.host == "openai":
            return [*cli, "serve", "--config", str(self.config_path), "--no-log-file"]
        return [*cli, "mlx-lm-server", "--config", str(self.config_path), "--", "--host", "127.0.0.1",
                "--port", str(self.port)]

    def start(self) -> float:
        """Start the server and wait until it answers; the seconds it took."""
        self.write_config()
        self._log = open(self.work / f"server-{self.starts}.log", "w")
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false",
               "EXPERT_STREAM_CACHE": str(self.work / "cache")}
        self.process = subprocess.Popen(self.argv(), stdout=self._log, stderr=subprocess.STDOUT, cwd=self.work,
                                        env=env, start_new_session=True)
        self.starts += 1
        t0 = time.perf_counter()
        path = "/v1/models" if self.host == "openai" else "/health"
        while time.perf_counter() - t0 < START_TIMEOUT_S:
            if self.process.poll() is not None:
                raise RuntimeError(f"the {self.host} host exited with {self.process.returncode} while starting; "
                                   f"its log: {self._log.name}")
            try:
                with urllib.request.urlopen(self.base + path, timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the {self.host} host did not answer within {START_TIMEOUT_S} s; its log: {self._log.name}")

    def restart_after_kill(self) -> float:
        """kill -9 the server, then start it again; `down` is set meanwhile."""
        self.down.set()
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            self._log.close()
            return self.start()
        finally:
            self.down.clear()

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        if self.alive():
            stop_process_group(self.process)
        if self._log:
            self._log.close()


def stop_process_group(process: subprocess.Popen, grace_s: float = 60) -> None:
    """Stop a host started in its own process group as Ctrl-C would (its children too), killing
    the group when it does not exit within `grace_s`."""
    os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
