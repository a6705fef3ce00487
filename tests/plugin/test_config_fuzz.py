"""The config parser under fuzzed input: a clear ConfigError or a valid config, never anything
else (no OverflowError, RecursionError, MemoryError, TypeError...). Fixed seed, a few hundred
cases built from a valid file: values swapped for hostile ones, keys added and removed, the
text itself cut and spliced, and a few documents made to blow up a naive reader."""

from __future__ import annotations

import copy
import math
import random
import time

import pytest
import yaml

from expert_stream.plugin.config import ConfigError, HostConfig, load_host_config
from expert_stream.plugin.hosts.mlx_lm.server import MLX_LM_SERVER
from plugin_fixtures import make_dense, make_moe, openai_server_installed

SEED = 1414
CASES = 250
GIB = 1 << 30

HOSTILE = [None, True, False, 0, -1, 1, 3, 2 ** 70, -(2 ** 70), 10 ** 400, 1e300, -1e300, float("inf"),
           float("-inf"), float("nan"), -0.0, 5e-324, "", "bogus", "1e+300", ".inf", "nan", "-1", "~/x",
           "/nowhere", [], {}, [1, 2], {"a": 1}, {1: 2, "b": 3}, [[[[[[[[[[1]]]]]]]]]], "x" * 10000,
           {"budget_gib": 1}, ["lru"], "lru", "python", "native", 64, 0.5, 1.5]
KEYS = ["enabled", "watch", "poll_seconds", "debounce_seconds", "drain_timeout_s", "queue_timeout", "memory_gib",
        "headroom_gib", "reload_endpoint", "defaults", "budget_gib", "policy", "prefetch", "prefetch_per_layer", "prefetch_into", "prefetch_depth", "prefetch_guesses",
        "reader_threads", "reader", "slot_write", "cache_bypass", "mlx_cache_limit_gib", "top_k_override",
        "skip_miss_below", "prefill_step", "overlap", "warm_start", "model_path", "model_id",
        "served_model_name", "model_type", "context_length", "queue_size", "max_concurrency", "trust_remote_code",
        "lora_scales", "server", "host", "port", "models", "expert_stream", "default_model", 7, None, "budjet"]
SPECIAL = [
    "[" * 5000 + "]" * 5000,
    "models:\n" + "  - " * 200 + "x\n",
    "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdefgh", "bcdefghi")) + "models: *i\n",
    "models: &m [*m]\n",
    "models: [{model_path: !!binary aGVsbG8=}]\n",
    "models: [{model_path: !!python/object:os.system ls}]\n",
    "models: [{model_path: 2020-01-01}]\n",
    "\x00\xff\xfe",
    "",
    "--- []\n--- {}\n",
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-checkpoints")
    return {"moe": make_moe(root), "dense": make_dense(root)}


def base_doc(models, schema) -> dict:
    """A valid config for that host: its own top-level keys (mlx_lm.server has no `server:`)."""
    host_keys = {"server": {"host": "127.0.0.1", "port": 8000}}
    if schema.top_level_keys is not None:
        host_keys = {k: v for k, v in host_keys.items() if k in schema.top_level_keys}
    return {
        "expert_stream": {"watch": True, "poll_seconds": 0.5, "defaults": {"policy": "lru"}},
        **host_keys,
        "models": [
            {"model_path": str(models["moe"]), "served_model_name": "big",
             "expert_stream": {"budget_gib": 0.001, "reader_threads": 2}},
            {"model_path": str(models["dense"]), "served_model_name": "small"},
        ],
    }


def containers(node, out):
    if isinstance(node, (dict, list)):
        out.append(node)
        for child in (node.values() if isinstance(node, dict) else node):
            containers(child, out)
    return out


def mutate_doc(rng: random.Random, doc: dict) -> dict:
    doc = copy.deepcopy(doc)
    for _ in range(rng.randint(1, 3)):
        target = rng.choice(containers(doc, []))
        action = rng.random()
        if isinstance(target, dict) and target and action < 0.4:
            target[rng.choice(list(target))] = copy.deepcopy(rng.choice(HOSTILE))
        elif isinstance(target, dict) and action < 0.75:
            target[rng.choice(KEYS)] = copy.deepcopy(rng.choice(HOSTILE))
        elif isinstance(target, dict) and target:
            del target[rng.choice(list(target))]
        elif isinstance(target, list) and target and action < 0.5:
            target[rng.randrange(len(target))] = copy.deepcopy(rng.choice(HOSTILE))
        elif isinstance(target, list):
            target.append(copy.deepcopy(rng.choice(HOSTILE)))
    return doc


def mutate_text(rng: random.Random, text: str) -> str:
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(text) + 1)
        choice = rng.random()
        if choice < 0.4:
            text = text[:i] + text[i + rng.randint(1, 12):]
        elif choice < 0.8:
            text = text[:i] + "".join(rng.choice(":-[]{}&*!|>'\"#%@`,? \n\t0e.") for _ in range(rng.randint(1, 4))) + text[i:]
        else:
            lines = text.splitlines(keepends=True)
            j = rng.randrange(len(lines))
            lines.insert(rng.randrange(len(lines) + 1), lines[j])
            text = "".join(lines)
    return text


def cases(models, schema):
    rng = random.Random(SEED)
    base = base_doc(models, schema)
    out = list(SPECIAL)
    while len(out) < CASES:
        if rng.random() < 0.6:
            out.append(yaml.safe_dump(mutate_doc(rng, base), sort_keys=False, width=10 ** 6))
        else:
            out.append(mutate_text(rng, yaml.safe_dump(base, sort_keys=False)))
    return out


def schemas():
    found = [MLX_LM_SERVER.schema()]
    if openai_server_installed():  # else the mlx_lm.server schema alone
        from expert_stream.plugin.hosts.openai.server import MLX_OPENAI_SERVER

        found.append(MLX_OPENAI_SERVER.schema())
    return found


def test_fuzzed_configs_give_a_config_error_or_a_valid_config(models, tmp_path):
    path = tmp_path / "host.yaml"
    outcomes = {"valid": 0, "refused": 0}
    t0 = time.perf_counter()
    for schema in schemas():
        for n, text in enumerate(cases(models, schema)):
            path.write_bytes(text.encode("utf-8", "surrogateescape"))
            try:
                config = load_host_config(path, schema, memory_bytes=64 * GIB)
            except ConfigError as exc:
                assert str(path) in str(exc), (n, str(exc))  # names the file
                outcomes["refused"] += 1
                continue
            except Exception as exc:  # what this test exists to catch
                raise AssertionError(f"case {n} ({schema.name}): {type(exc).__name__}: {exc}\n{text[:2000]}") from exc
            assert isinstance(config, HostConfig)
            outcomes["valid"] += 1
            config.host_yaml()
            for entry in config.entries:
                assert entry.fingerprint
                if entry.streamed and entry.settings.auto:  # resolved with the other entries, within the limit
                    limit = config.options.memory_gib * GIB if config.options.memory_gib else 64 * GIB
                    assert entry.footprint.min_budget_bytes <= entry.budget.bytes <= limit
                elif entry.streamed:
                    assert 0 < entry.settings.budget_gib < float("inf")
            options = config.options
            assert all(math.isfinite(v) for v in (options.poll_seconds, options.debounce_seconds,
                                                     options.drain_timeout_s, options.headroom_gib))
            assert options.poll_seconds > 0
    print("fuzz outcomes:", outcomes, f"{time.perf_counter() - t0:.1f} s")
    assert outcomes["valid"] >= 20 and outcomes["refused"] >= 200  # both kinds were exercised
