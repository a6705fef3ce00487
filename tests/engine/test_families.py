"""Every MoE family of the installed mlx-lm: its model files are scanned for SwitchGLU /
SwitchMLP experts, and each family found must have a synthetic preset (a new mlx-lm's family
fails here by name). Per preset: the checkpoint's tensors are the model's parameters with
stacked experts, and `expert-stream plan` (the footprint) counts the checkpoint's expert and
trunk bytes exactly. Exact streaming of every preset is tests/engine/test_engine_exact.py. A family
that cannot stream (dbrx) is refused in one sentence naming it. Prism's Hadamard packs
(prism_hadamard_qwen35) are checked to be real packs as mlx-lm loads them, and to stream with
their rotated router."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

import mlx_lm
from expert_stream.streaming.errors import CheckpointError
from expert_stream.streaming.footprint import checkpoint_footprint
from expert_stream.streaming.lab.synthetic import PRESETS, read_synth
from expert_stream.streaming.lab.synthetic.families import moe_families, switch_families
from expert_stream.streaming.lab.synthetic.structure import routed_expert_modules


def _skip_unavailable(arch: str) -> None:
    reason = PRESETS[arch].unavailable_reason()
    if reason:
        pytest.skip(reason)


# Families found that no preset covers yet, each with the reason (a new one fails the test below).
UNCOVERED: dict[str, str] = {}


def _covering_preset(family: str):
    """The preset that builds `family`'s model: its own, the VLM wrapper layout of one, or one
    whose mlx-lm Model class is the family's or derives from it (qwen3_5_moe for qwen3_5)."""
    import importlib

    if family in PRESETS:
        return family
    for name, preset in PRESETS.items():
        if preset.vlm is not None and preset.vlm.model_type == family:
            return name
    try:
        model_class = importlib.import_module(f"mlx_lm.models.{family}").Model
    except (ImportError, AttributeError):
        return None
    for name, preset in PRESETS.items():
        if preset.available():
            own = importlib.import_module(f"mlx_lm.models.{preset.module or name}").Model
            if issubclass(own, model_class):
                return name
    return None


def test_every_mlx_lm_moe_family_has_a_preset():
    families = switch_families()
    assert len(families) >= 30, f"the scan of mlx_lm.models found only {families}"
    assert {"glm_moe_dsa", "solar_open", "qwen3_5"} <= set(moe_families()) - set(families)
    missing = [f for f in moe_families() if _covering_preset(f) is None and f not in UNCOVERED]
    stale = [f for f in UNCOVERED if _covering_preset(f) is not None]
    assert not stale, f"{stale} have a preset now: take them out of UNCOVERED"
    assert not missing, (
        f"mlx-lm {mlx_lm.__version__} has MoE families with no synthetic preset: "
        f"{', '.join(missing)}; add one to streaming/lab/synthetic/presets_2026.py (or list the family "
        "in streaming/architectures.py UNSTREAMABLE with its reason)"
    )


def test_the_flagships_are_found_in_mlx_lm_032():
    if tuple(int(x) for x in mlx_lm.__version__.split(".")[:2]) < (0, 32):
        pytest.skip(f"the 2026 flagships are in mlx-lm 0.32; {mlx_lm.__version__} is installed")
    assert {"deepseek_v41", "kimi_k3", "mistral4", "gemma4_text", "mimo_v2_flash", "minimax_m3_vl",
            "muse_spark", "bailing_moe_v3", "bailing_moe_linear", "bailing_hybrid", "jamba",
            "granitemoehybrid", "deepseek_v32"} <= set(switch_families())


@pytest.mark.parametrize("arch", sorted(PRESETS))
def test_layout_and_plan_sizes_match_the_checkpoint(checkpoints, arch):
    """Strict load (lazy): the file's names are the model's parameters (plus the MTP head the
    family's exports carry), experts stacked by expert. `expert-stream plan`'s exact sizes are
    the shard headers' bytes: expert bytes = the tensors of the routed expert modules, trunk =
    the other tensors the model loads, dropped = what stock's sanitize drops (the MTP head)."""
    _skip_unavailable(arch)
    from expert_stream.plugin.cli.plan_command import make_plan
    from expert_stream.streaming.checkpoint import CheckpointIndex

    path = checkpoints(arch)
    model, config = mlx_lm.utils.load_model(path, lazy=True)  # strict
    params = {k for k, _ in tree_flatten(model.parameters())}
    index = CheckpointIndex(path)
    on_disk = {name: info.nbytes for name, info in index.tensors.items()}
    sizes = read_synth(path)["sizes"]
    assert params <= set(on_disk) and len(set(on_disk) - params) == sizes["mtp_tensors"]
    assert (sizes["mtp_tensors"] > 0) == (PRESETS[arch].mtp is not None)
    experts = dict(routed_expert_modules(model))
    assert experts, f"{arch}: no routed expert blocks"
    counts = {m["weight"].shape[0] for m in experts.values()}
    assert len(counts) == 1 and counts.pop() == PRESETS[arch].experts

    expert_names = {n for n in params if n.rpartition(".")[0] in experts}
    expert_bytes = sum(on_disk[n] for n in expert_names)
    trunk_bytes = sum(on_disk[n] for n in params - expert_names)
    plan = make_plan(path, context=1024, memory_bytes=64 << 30, bandwidth_gbps=1.0, t_compute=0.01)
    assert plan["expert_bytes"] == expert_bytes == sizes["expert_bytes"]
    assert plan["trunk_bytes"] == trunk_bytes == sizes["trunk_bytes"]  # shared experts, dense layers...
    assert plan["dropped_bytes"] == sum(on_disk.values()) - expert_bytes - trunk_bytes == sizes["mtp_bytes"]
    assert plan["total_bytes"] == sum(on_disk.values())
    fp = checkpoint_footprint(path)
    assert len(fp.layer_expert_bytes) == plan["moe_layers"] == sizes["moe_layers"]
    assert max(fp.layer_expert_bytes) == sizes["bytes_per_expert"]
    assert plan["top_k"] == PRESETS[arch].top_k


MTP_FAMILIES = sorted(a for a, p in PRESETS.items() if p.mtp is not None)


@pytest.mark.parametrize("arch", MTP_FAMILIES)
def test_mtp_head_is_on_disk_and_only_stock_sanitize_sees_it(checkpoints, arch):
    """The checkpoint holds the family's MTP head (a decoder layer with stacked experts under
    the MTP prefix, and the head's norms and projection), and stock mlx-lm's own sanitize drops
    exactly those tensors; the engine streams the model's MoE layers only, never the MTP one."""
    _skip_unavailable(arch)
    import expert_stream
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    preset = PRESETS[arch]
    path = checkpoints(arch)
    model, _ = mlx_lm.utils.load_model(path, lazy=True)
    params = {k for k, _ in tree_flatten(model.parameters())}
    weights = {}
    for shard in sorted(path.glob("model*.safetensors")):
        weights.update(mx.load(str(shard)))  # lazy: no tensor data read
    mtp = set(weights) - params
    layer, norms, projs = preset.mtp.names(preset.layers)
    assert mtp and all(n.startswith((layer + ".", *norms, *projs)) for n in mtp)
    assert set(norms) <= mtp and {f"{p}.weight" for p in projs} <= mtp
    stacked = [n for n in mtp if n.startswith(layer + ".") and weights[n].ndim == 3
               and weights[n].shape[0] == preset.experts]
    assert stacked, f"{arch}: the MTP layer has no stacked experts"
    kept = model.sanitize(dict(weights))
    assert not mtp & set(kept), f"{arch}: sanitize keeps {sorted(mtp & set(kept))[:3]}"
    assert params <= set(kept)

    fp = checkpoint_footprint(path)
    _, _, handle = expert_stream.load(path, budget_gib=fp.budget_gib_for_slots(fp.top_k))
    moe_layers = sum(isinstance(m, (SwitchGLU, SwitchMLP)) for _, m in model.named_modules())
    assert len(handle.streams) == len(fp.layer_expert_bytes) == moe_layers
    assert not [s.name for s in handle.streams if s.name.startswith(layer + ".")]
    assert handle.stats()["streamed_layers"] == moe_layers
    handle.close()


def test_metal_only_family_streams_by_construction(checkpoints):
    """muse_spark: stock mlx-lm runs its attention through Metal kernels, so no forward pass
    runs here; the engine still swaps every expert block for a streamed one (the stock
    SwitchGLU runs with slot arrays), and on Metal test_engine_exact compares logits."""
    _skip_unavailable("muse_spark")
    import expert_stream
    from expert_stream.streaming.streamed_switch import StreamedSwitch

    path = checkpoints("muse_spark")
    fp = checkpoint_footprint(path)
    model, _, handle = expert_stream.load(path, budget_gib=fp.budget_gib_for_slots(fp.top_k))
    named = [(p, m) for p, m in model.named_modules() if isinstance(m, StreamedSwitch)]
    streamed = [m for _, m in named]
    assert len(streamed) == len(fp.layer_expert_bytes) == PRESETS["muse_spark"].layers
    # the norm muse_spark keeps on its SwitchGLU stays resident and reachable where the model
    # reads it (`self.experts.post_expert_norm`)
    for block in streamed:
        assert block.post_expert_norm is block.inner.post_expert_norm
        mx.eval(block.post_expert_norm.weight)
    # The expert blocks alone run on CPU: streamed equals stock bitwise, for a decode-sized call
    # and for one of 96 pairs (stock's sorted path), under eviction.
    stock, _ = mlx_lm.utils.load_model(path)
    stock_blocks = dict(stock.named_modules())
    for p, block in named:
        ref = stock_blocks[p]
        for tokens in (1, 24):
            x = mx.random.normal((1, tokens, ref.gate_proj.input_dims), key=mx.random.key(tokens))
            indices = mx.random.randint(0, fp.num_experts[0], (1, tokens, fp.top_k), key=mx.random.key(7))
            a, b = ref(x, indices), block(x, indices)
            mx.eval(a, b)
            assert mx.array_equal(a, b).item(), f"{p}: {tokens} tokens differ"
    assert handle.stats()["totals"]["evictions"] > 0
    if not mx.metal.is_available():
        with pytest.raises(RuntimeError, match="Metal"):
            mx.eval(model(mx.array([[5, 6, 7]])))
    handle.close()


def test_unstreamable_family_is_refused_naming_it(tmp_path):
    """dbrx keeps one MLP per expert: load and plan refuse it in one sentence."""
    import expert_stream
    from mlx_lm.utils import _get_classes, save_config, save_model

    config = {
        "model_type": "dbrx", "vocab_size": 256, "d_model": 64, "n_layers": 1, "n_heads": 2,
        "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
        "attn_config": {"kv_n_heads": 1, "clip_qkv": 8.0, "rope_theta": 10000.0},
    }
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    save_model(tmp_path, model)
    save_config(config, tmp_path / "config.json")
    for call in (lambda: expert_stream.load(tmp_path, budget_gib=1),
                 lambda: checkpoint_footprint(tmp_path)):
        with pytest.raises(CheckpointError, match=r"'dbrx' cannot stream: .*one MLP module per expert") as err:
            call()
        assert str(err.value).count(". ") == 0  # one sentence


def test_kimi_k3_without_latent_moe_is_exact_with_lookahead(checkpoints):
    """kimi_k3 with its latent MoE off: the lookahead probe is built and reads guessed
    experts, and every logit equals stock's, chunked prefill included."""
    _skip_unavailable("kimi_k3")
    from exactness import assert_same_logits, load_pair, prompt_ids

    path = checkpoints("kimi_k3", overrides={"routed_expert_hidden_size": None})
    stock, streamed, handle = load_pair(path)
    assert all(layer.lookaheads for layer in handle.layers[:-1])
    assert_same_logits(stock, streamed, prompt_ids(70, seed=3), decode_steps=16, chunk=32)
    assert handle.stats()["totals"]["guesses"] > 0
    handle.close()


def test_kimi_k3_latent_moe_streams_without_lookahead(checkpoints):
    """The latent MoE's experts see a down-projection of the residual (width
    routed_expert_hidden_size): the lookahead probe, which rescales the normed residual, is
    not built (it failed the first decode with a broadcast error), and logits equal stock's."""
    _skip_unavailable("kimi_k3")
    from exactness import assert_same_logits, load_pair, prompt_ids

    stock, streamed, handle = load_pair(checkpoints("kimi_k3"))
    assert len(handle.layers) > 1 and all(not layer.lookaheads for layer in handle.layers)
    assert_same_logits(stock, streamed, prompt_ids(48), decode_steps=6)
    handle.close()


def test_prism_hadamard_pack_is_what_mlx_lm_loads_and_streams_with_lookahead(checkpoints):
    """prism_hadamard_qwen35 (Bonsai 2's MLX packs): every linear and the embedding of the
    language model is a Hadamard-rotated 2-bit module named in the `modules` manifest, with a
    +-1 sign vector on disk; the experts stay plain 2-bit group-128 SwitchGLU stacks. Read as
    plain qwen3_5_moe the same shards give other logits (the rotation is real). The lookahead
    probe scores with the packed router by calling it, and every logit equals stock's."""
    _skip_unavailable("prism_hadamard_qwen35")
    import mlx.nn as nn
    from exactness import assert_same_logits, load_pair, prompt_ids
    from mlx_lm.models.prism_hadamard_qwen35 import HadamardQuantizedLinear
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    path = checkpoints("prism_hadamard_qwen35")
    config = json.loads((path / "config.json").read_text())
    assert config["quantization"] == {"bits": 2, "group_size": 128, "mode": "affine"}
    assert (config["schema_version"], config["tensor_namespace"]) == (2, "mlx-vlm-qwen3_5")
    stock, _ = mlx_lm.utils.load_model(path)
    modules = dict(stock.language_model.named_modules())
    on_disk = {}
    for shard in path.glob("model*.safetensors"):
        on_disk.update(mx.load(str(shard)))
    plain_kinds = (nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding)
    unpacked = [p for p, m in modules.items() if isinstance(m, plain_kinds)]
    assert not unpacked, f"not packed: {unpacked[:3]}"
    assert {r["path"] for r in config["modules"]} == {
        p for p, m in modules.items() if isinstance(m, HadamardQuantizedLinear)}
    for record in config["modules"]:
        assert record["block"] == 512
        signs = on_disk[f"language_model.{record['path']}.signs"]
        assert mx.all(mx.abs(signs) == 1).item() and 0 < mx.sum(signs == 1).item() < signs.size
    assert sum(r["embedding"] for r in config["modules"]) == 1
    experts = [m for _, m in routed_expert_modules(stock)]
    assert experts and all(isinstance(m, QuantizedSwitchLinear) and (m.bits, m.group_size) == (2, 128)
                           for m in experts)

    prompt = prompt_ids(40, seed=5)
    # the shards read as plain 2-bit qwen3_5_moe (signs left out)
    unrotated, _ = mlx_lm.utils.load_model(path, strict=False, model_config={"model_type": "qwen3_5_moe"})
    assert not mx.array_equal(stock(prompt), unrotated(prompt)).item()

    stock, streamed, handle = load_pair(path)
    assert len(handle.layers) > 1 and all(layer.lookaheads for layer in handle.layers[:-1])
    assert_same_logits(stock, streamed, prompt, decode_steps=16, chunk=16)
    totals = handle.stats()["totals"]
    assert totals["guesses"] > 0 and totals["evictions"] > 0
    handle.close()


def test_prism_hadamard_pack_takes_only_its_recipe(tmp_path):
    """mlx-lm loads only 2-bit affine group-128 packs: the generator refuses any other recipe,
    naming the family, and leaves no folder behind."""
    _skip_unavailable("prism_hadamard_qwen35")
    from expert_stream.streaming.lab.synthetic import make_checkpoint
    from expert_stream.streaming.lab.synthetic.errors import SyntheticError

    for kwargs in ({"bits": 4}, {"bits": 0}, {"group_size": 64}, {"mixed_bits": "1:4"}):
        with pytest.raises(SyntheticError, match="prism_hadamard_qwen35: the packs are 2-bit affine"):
            make_checkpoint(tmp_path / "pack", "prism_hadamard_qwen35", progress=False, **kwargs)
    assert not list(tmp_path.iterdir())


@pytest.mark.slow  # float16 runs ~10x slower than float32 on MLX CPU: about a minute here
def test_prism_hadamard_pack_in_float16_is_exact(checkpoints):
    """The packs' modules compute in float16 (their manifest's dtype): a float16 trunk streams
    bitwise equal to stock too, batched prefill and decode under eviction."""
    _skip_unavailable("prism_hadamard_qwen35")
    from exactness import assert_same_logits, load_pair, prompt_ids

    stock, streamed, handle = load_pair(checkpoints("prism_hadamard_qwen35", dtype="float16"))
    assert_same_logits(stock, streamed, prompt_ids(48), decode_steps=6)
    totals = handle.stats()["totals"]
    assert totals["evictions"] > 0 and totals["sweep_calls"] > 0
    handle.close()
