"""Issue 14 item 4: the file watcher of the running server survives any failed reload, reports
it in the status record and the log, and applies the next edit. The parent's real Reloader and
FileWatcher on a real file, with a real plugin whose validate_settings hook fails on demand;
no model process is started (the edits change only the `server:` section)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from expert_stream.plugin import plugins
from expert_stream.plugin.hookspecs import hookimpl
from plugin_fixtures import make_dense, make_moe, needs_openai_server

needs_openai_server()


class FailingValidation:
    """A third-party plugin whose hook raises something other than SettingsError."""

    def __init__(self):
        self.fail = False

    @hookimpl
    def validate_settings(self, settings, model_path, where):
        if self.fail:
            raise RuntimeError("injected fault in a validate_settings hook")


def config_text(moe, dense, port, budget="0.001"):
    return (f"expert_stream: {{watch: true, poll_seconds: 0.05, debounce_seconds: 0.05}}\n"
            f"server: {{host: 127.0.0.1, port: {port}}}\nmodels:\n"
            f"  - model_path: {moe}\n    served_model_name: moe\n    expert_stream: {{budget_gib: {budget}}}\n"
            f"  - model_path: {dense}\n    served_model_name: dense\n")


async def until(predicate, timeout=20.0):
    for _ in range(int(timeout / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


def test_watcher_survives_failed_reloads_and_applies_the_next_edit(tmp_path, caplog):
    from expert_stream.plugin.hosts.openai.reloader import Reloader, ServingState
    from expert_stream.plugin.hosts.openai.server import MLX_OPENAI_SERVER

    moe, dense = make_moe(tmp_path), make_dense(tmp_path)
    path = tmp_path / "host.yaml"
    path.write_text(config_text(moe, dense, 8000))
    host = MLX_OPENAI_SERVER
    internals = host.internals()
    schema = host.schema(internals)
    state = ServingState(host, internals, schema, host.load_config(path, internals), {})
    reloader = Reloader(state, internals.ModelRegistry())
    record = reloader.record
    fault = FailingValidation()
    pm = plugins.get_plugin_manager()
    pm.register(fault, name="failing-validation")
    caplog.set_level(logging.ERROR, logger="expert_stream")

    async def scenario():
        watch = asyncio.create_task(reloader.watch())
        await asyncio.sleep(0.2)  # the watcher takes the file's first stat
        try:
            # A number that overflowed the budget's byte count and killed the watch task.
            path.write_text(config_text(moe, dense, 8001, budget="1e+300"))
            await until(lambda: record.last_error)
            assert "budget_gib must be between 0 and" in record.last_error and str(path) in record.last_error
            # A plugin's hook failing with something other than a SettingsError.
            fault.fail = True
            path.write_text(config_text(moe, dense, 8002))
            await until(lambda: "injected fault" in (record.last_error or ""))
            assert "validating the config failed: RuntimeError" in record.last_error
            assert not watch.done()
            # The next edit is applied.
            fault.fail = False
            path.write_text(config_text(moe, dense, 8003))
            await until(lambda: record.last_error is None and record.reloads == 1)
            assert state.config.top_level["server"]["port"] == 8003
            assert record.applied_hash == state.config.text_hash
            # The endpoint's path answers a failure as a refusal, not an exception.
            fault.fail = True
            path.write_text(config_text(moe, dense, 8004))
            result = await reloader.reload("endpoint")
            assert result["ok"] is False and "injected fault" in result["error"]
            assert not watch.done()
        finally:
            watch.cancel()

    try:
        asyncio.run(scenario())
    finally:
        pm.unregister(name="failing-validation")
    assert any("injected fault" in r.getMessage() for r in caplog.records)  # and in the log
