"""Run files: each server started through `expert-stream` writes where it listens, so that a
bare `expert-stream status` finds it (the config file alone does not say: mlx_lm.server takes
its port from the command line, and flags override mlx-openai-server's `server:` section).

One JSON file per server process in `<cache dir>/servers/`, removed when the process exits; a
file whose process is gone is ignored and deleted by the next reader."""

from __future__ import annotations

import atexit
import json
import os
import time
from pathlib import Path
from typing import Optional

from expert_stream.plugin.paths import cache_dir

# A server bound to every interface is asked on loopback (the control endpoints answer loopback only).
ANY_ADDRESS = {"0.0.0.0", "::", ""}


def servers_dir() -> Path:
    path = cache_dir() / "servers"
    path.mkdir(parents=True, exist_ok=True)
    return path


def local_url(host: Optional[str], port: int) -> str:
    host = "127.0.0.1" if host in ANY_ADDRESS or host is None else host
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def write(url: str, config_path, host_name: str) -> Path:
    """Record this process's server; the file goes when the process exits normally."""
    path = servers_dir() / f"{os.getpid()}.json"
    path.write_text(json.dumps({"url": url, "config": str(Path(config_path).expanduser().absolute()),
                                "host": host_name, "pid": os.getpid(), "started": time.time()}))
    atexit.register(_remove, path)
    return path


def remove_own() -> None:
    """This process's run file, for an exit that skips atexit (os._exit)."""
    _remove(servers_dir() / f"{os.getpid()}.json")


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running(config_path=None) -> list[dict]:
    """The servers whose processes still run, newest first; only those serving config_path if given."""
    wanted = str(Path(config_path).expanduser().absolute()) if config_path else None
    found = []
    for path in servers_dir().glob("*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not _alive(int(record.get("pid", 0))):
            _remove(path)
            continue
        if wanted is None or record.get("config") == wanted:
            found.append(record)
    return sorted(found, key=lambda r: -r.get("started", 0))
