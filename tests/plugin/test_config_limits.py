"""Issue 14: every setting validated completely before anything is unloaded, and no code from a
model folder runs unless the entry trusts it. Real files, the real parser and CLI."""

from __future__ import annotations

import json
import shutil
import textwrap

import pytest

from expert_stream.plugin.config import ConfigError, load_host_config
from expert_stream.plugin.hosts.mlx_lm.server import MLX_LM_SERVER
from plugin_fixtures import make_moe, needs_openai_server


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return make_moe(tmp_path_factory.mktemp("limits-checkpoints"))


@pytest.fixture(scope="module")
def schema():
    try:
        from expert_stream.plugin.hosts.openai.server import MLX_OPENAI_SERVER

        return MLX_OPENAI_SERVER.schema()
    except Exception:
        return MLX_LM_SERVER.schema()


def write(tmp_path, moe, options="", settings="budget_gib: 0.001", entry=""):
    path = tmp_path / "host.yaml"
    path.write_text(textwrap.dedent(f"""\
        expert_stream: {{{options}}}
        models:
          - model_path: {moe}
            served_model_name: big
            expert_stream: {{{settings}}}
        """) + entry)
    return path


@pytest.mark.parametrize("settings, message", [
    ("budget_gib: 1e+300", "budget_gib must be between 0 and"),
    ("budget_gib: .inf", "budget_gib must be between 0 and"),
    ("budget_gib: .nan", "budget_gib must be > 0"),
    ("budget_gib: 0.001, policy: bogus", "policy must be one of lru,"),
    ("budget_gib: 0.001, reader_threads: 100000", "reader_threads must be between 1 and 256"),
    ("budget_gib: 0.001, reader_threads: 0", "reader_threads must be >= 1"),
    ("budget_gib: 0.001, mlx_cache_limit_gib: .inf", "mlx_cache_limit_gib must be between"),
    ("budget_gib: 0.001, mlx_cache_limit_gib: -1", "mlx_cache_limit_gib must be between"),
    ("budget_gib: 0.001, top_k_override: 50", "top_k_override: 50 is more than the 2 experts per token"),
    ("budget_gib: 0.001, prefill_step: 1e+300", "prefill_step must be int"),
    ("budget_gib: 0.001, slot_write: bogus", "slot_write must be one of"),
    ("budget_gib: 0.001, 7: 1", "unknown setting(s) 7"),
])
def test_settings_out_of_range_are_refused_by_key(tmp_path, moe, schema, settings, message):
    path = write(tmp_path, moe, settings=settings)
    with pytest.raises(ConfigError) as err:
        load_host_config(path, schema)
    assert str(path) in str(err.value) and "models[0] (big)" in str(err.value)
    assert message in str(err.value)


@pytest.mark.parametrize("options, message", [
    ("poll_seconds: 0", "expert_stream.poll_seconds: must be between 0.05 and 3600"),
    ("poll_seconds: -1", "expert_stream.poll_seconds: must be between"),
    ("poll_seconds: .nan", "expert_stream.poll_seconds: must be between"),
    ("debounce_seconds: .inf", "expert_stream.debounce_seconds: must be between"),
    ("drain_timeout_s: 1e+300", "expert_stream.drain_timeout_s: must be between"),
    ("queue_timeout: 99999999999", "expert_stream.queue_timeout: must be between"),
    ("headroom_gib: .inf", "expert_stream.headroom_gib: must be between"),
    ("memory_gib: 1e300", "expert_stream.memory_gib: must be between"),
    ("poll_seconds: fast", "expert_stream.poll_seconds: must be float"),
])
def test_plugin_options_out_of_range_are_refused_by_key(tmp_path, moe, schema, options, message):
    path = write(tmp_path, moe, options=options)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")) as err:
        load_host_config(path, schema)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("entry, message", [
    ("    queue_timeout: .inf\n", "queue_timeout: inf is not int"),
    ("    context_length: abc\n", "context_length: 'abc' is not int | None"),
    ("    trust_remote_code: 1\n", "trust_remote_code: 1 is not bool"),
    ("    queue_size: 0\n", "queue_size: must be between 1 and"),
])
def test_host_keys_are_checked_against_the_hosts_dataclass(tmp_path, moe, entry, message):
    needs_openai_server()
    from expert_stream.plugin.hosts.openai.server import MLX_OPENAI_SERVER

    path = write(tmp_path, moe, entry=entry)
    with pytest.raises(ConfigError) as err:
        load_host_config(path, MLX_OPENAI_SERVER.schema())
    assert f"{path}: models[0] (big): {message}" in str(err.value)
    path.write_text(path.read_text().replace(entry, "") + "server: {port: 70000}\n")
    with pytest.raises(ConfigError, match=r"server\.port: must be between 0 and 65535"):
        load_host_config(path, MLX_OPENAI_SERVER.schema())


@pytest.mark.parametrize("text, message", [
    ("models: " + "[" * 3000 + "]" * 3000 + "\n", "nested deeper than 64 levels"),
    ("a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdef", "bcdefg")) + "models: *g\n",
     "aliases expand it to more than"),
    ("models: &m [*m]\n", "an alias refers to the collection that contains it"),
])
def test_deep_nesting_and_alias_bombs_are_config_errors(tmp_path, schema, text, message):
    path = tmp_path / "host.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as err:
        load_host_config(path, schema)
    assert str(path) in str(err.value)


# Runs only if someone executes it: leaves a file beside itself, then provides the model classes.
MODEL_FILE = """import pathlib
pathlib.Path(__file__).with_name("model_file_ran").write_text("yes")
from mlx_lm.models.qwen3_moe import Model, ModelArgs
"""


@pytest.fixture
def remote_code_checkpoint(moe, tmp_path):
    folder = tmp_path / "remote-code-moe"
    shutil.copytree(moe, folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_file"] = "custom_model.py"
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "custom_model.py").write_text(MODEL_FILE)
    return folder


def test_model_file_is_refused_unless_the_entry_trusts_it(tmp_path, remote_code_checkpoint, schema):
    ran = remote_code_checkpoint / "model_file_ran"
    path = write(tmp_path, remote_code_checkpoint)
    with pytest.raises(ConfigError) as err:
        load_host_config(path, schema)
    assert "model_file 'custom_model.py' would run" in str(err.value) and "trust_remote_code: true" in str(err.value)
    assert str(remote_code_checkpoint / "custom_model.py") in str(err.value)
    assert not ran.exists()
    path = write(tmp_path, remote_code_checkpoint, entry="    trust_remote_code: true\n")
    assert load_host_config(path, schema).entries[0].streamed
    assert ran.exists()  # trusted: mlx-lm built the model from it, as it would without the plugin


def test_plan_and_load_refuse_model_file(remote_code_checkpoint, capsys):
    import expert_stream
    from expert_stream.plugin.cli import main
    from expert_stream.streaming.remote_code import RemoteCodeError

    ran = remote_code_checkpoint / "model_file_ran"
    assert main(["plan", str(remote_code_checkpoint), "--bandwidth-gbps", "1"]) == 2
    assert "model_file 'custom_model.py' would run" in capsys.readouterr().err
    with pytest.raises(RemoteCodeError, match="trust_remote_code"):
        expert_stream.load(remote_code_checkpoint, budget_gib=0.001)
    assert not ran.exists()
    assert main(["plan", str(remote_code_checkpoint), "--bandwidth-gbps", "1", "--trust-remote-code"]) == 0
    assert ran.exists()
