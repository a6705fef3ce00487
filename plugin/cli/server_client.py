"""Talking to a running server started through expert-stream: its URL (from the run files it
left) and the JSON of its control endpoints, for the `status` and `demo` commands."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from expert_stream.streaming.errors import ExpertStreamError


def fetch_json(url: str, method: str = "GET", timeout: float = 30.0) -> dict:
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            return json.loads(exc.read())
        except ValueError:
            raise ExpertStreamError(f"{url}: HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ExpertStreamError(f"{url}: no answer ({getattr(exc, 'reason', exc)}); is the server running "
                                "through `expert-stream serve` / `mlx-lm-server`?") from None


def server_url(url, config) -> str:
    """--url, else the one running server (serving --config, if given) that left a run file."""
    if url:
        return url.rstrip("/")
    from expert_stream.plugin import run_files

    found = run_files.running(config)
    which = f" serving {config}" if config else ""
    if not found:
        raise ExpertStreamError(f"no server{which} started through `expert-stream serve` / `mlx-lm-server` is "
                                f"running (run files in {run_files.servers_dir()}); pass --url for another one")
    if len(found) > 1:
        listing = "; ".join(f"{r['url']} ({r['config']})" for r in found)
        raise ExpertStreamError(f"{len(found)} servers{which} are running: {listing}; pick one with --url or --config")
    return found[0]["url"].rstrip("/")
