"""Every MoE family of the installed mlx-lm: its model files are scanned for SwitchGLU /
SwitchMLP experts, and each family found must have a synthetic preset (a new mlx-lm's family
fails here by name). Per preset: the checkpoint's tensors are the model's parameters with
stacked experts, and `expert-stream plan` (the footprint) counts the checkpoint's expert and
trunk bytes exactly. Exact streaming of every preset is tests/test_engine_exact.py. A family
that cannot stream (dbrx) is refused in one sentence naming it."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

import mlx_lm
from expert_stream.streaming.errors import CheckpointError
from expert_stream.streaming.footprint import checkpoint_footprint
from expert_stream.streaming.lab.synthetic import PRESETS, read_synth
from expert_stream.streaming.lab.synthetic.families import switch_families
from expert_stream.streaming.lab.synthetic.structure import routed_expert_modules


def _skip_unavailable(arch: str) -> None:
    reason = PRESETS[arch].unavailable_reason()
    if reason:
        pytest.skip(reason)


def test_every_mlx_lm_moe_family_has_a_preset():
    families = switch_families()
    assert len(families) >= 30, f"the scan of mlx_lm.models found only {families}"
    missing = [f for f in families if f not in PRESETS]
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
    """Strict load (lazy): the file's names are the model's parameters, experts stacked by
    expert; the footprint's expert bytes and trunk bytes are the checkpoint's (synth.json
    counts them from the tensors it wrote)."""
    _skip_unavailable(arch)
    path = checkpoints(arch)
    model, config = mlx_lm.utils.load_model(path, lazy=True)  # strict
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {k for k, _ in tree_flatten(model.parameters())}
    experts = dict(routed_expert_modules(model))
    assert experts, f"{arch}: no routed expert blocks"
    counts = {m["weight"].shape[0] for m in experts.values()}
    assert len(counts) == 1 and counts.pop() == PRESETS[arch].experts

    sizes = read_synth(path)["sizes"]
    fp = checkpoint_footprint(path)
    assert fp.expert_bytes == sizes["expert_bytes"]
    assert fp.trunk_bytes == sizes["trunk_bytes"]  # shared experts, dense layers, attention...
    assert len(fp.layer_expert_bytes) == sizes["moe_layers"]
    assert max(fp.layer_expert_bytes) == sizes["bytes_per_expert"]
    assert fp.top_k == PRESETS[arch].top_k


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
    assert all(layer.layered.lookahead is not None for layer in handle.layers[:-1])
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
    assert len(handle.layers) > 1 and all(layer.layered.lookahead is None for layer in handle.layers)
    assert_same_logits(stock, streamed, prompt_ids(48), decode_steps=6)
    handle.close()
