"""Per-architecture configs: for each mlx-lm `model_type`, the config.json a converted checkpoint
of that family carries, shrunk to a few sizes the caller picks (layers, experts, top-k, hidden,
expert width, vocabulary). Field names and values mirror the real Hugging Face configs, so the
mlx-lm model class builds exactly the modules a real checkpoint has; anything can be overridden.

Each preset also says how the mlx-vlm text-export layout (`language_model.` names) is written
for that family, or that stock mlx-lm cannot load it. What a preset is lives in preset.py; the
registry of every family (these and presets_2026.py's) in registry.py. The families that later
ones build on (deepseek_v3, glm4_moe, qwen3_5_moe) are public: presets_2026.py extends them."""

from __future__ import annotations

from .errors import SyntheticError
from .preset import Dims, Preset, VlmLayout, common_config, deepseek_mtp, mla_config, qwen_mtp


def _qwen3_moe(d: Dims) -> dict:
    return {
        **common_config(d, "qwen3_moe", "Qwen3MoeForCausalLM"),
        "head_dim": d.head_dim,
        "intermediate_size": d.intermediate,
        "moe_intermediate_size": d.moe_hidden,
        "num_experts": d.experts,
        "num_experts_per_tok": d.top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "use_sliding_window": False,
    }


def _linear_attention(d: Dims) -> dict:
    """Gated DeltaNet sizes of the Qwen3-Next / Qwen3.5 linear-attention layers."""
    return {
        "linear_num_key_heads": max(1, d.heads // 2),
        "linear_num_value_heads": d.heads,
        "linear_key_head_dim": d.head_dim,
        "linear_value_head_dim": d.head_dim,
        "linear_conv_kernel_dim": 4,
        # one full-attention layer every 4 (3 linear : 1 full), as the real models
        "full_attention_interval": min(4, d.layers),
    }


def _qwen3_next(d: Dims) -> dict:
    return {
        **common_config(d, "qwen3_next", "Qwen3NextForCausalLM"),
        **_linear_attention(d),
        "head_dim": d.head_dim,
        "intermediate_size": d.intermediate,
        "moe_intermediate_size": d.moe_hidden,
        "shared_expert_intermediate_size": d.moe_hidden,
        "num_experts": d.experts,
        "num_experts_per_tok": d.top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "rope_scaling": None,
        "attention_bias": False,
    }


def qwen3_5_moe_config(d: Dims) -> dict:
    text = {
        **common_config(d, "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
        **_linear_attention(d),
        "head_dim": d.head_dim,
        "moe_intermediate_size": d.moe_hidden,
        "shared_expert_intermediate_size": d.moe_hidden,
        "num_experts": d.experts,
        "num_experts_per_tok": d.top_k,
        "decoder_sparse_step": 1,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_interleaved": True,
            "mrope_section": _mrope_section(d.head_dim, 0.25),
        },
    }
    text.pop("architectures")
    text["layer_types"] = [
        "full_attention" if (i + 1) % text["full_attention_interval"] == 0 else "linear_attention"
        for i in range(d.layers)
    ]
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "tie_word_embeddings": False,
    }


def _mrope_section(head_dim: int, partial: float) -> list[int]:
    """Split the rotary half-dimension over (time, height, width) as Qwen does (11, 11, 10
    of 32 for head_dim 256)."""
    half = int(head_dim * partial) // 2
    t = (half * 11 + 31) // 32
    h = (half - t + 1) // 2
    return [t, h, half - t - h]


_DEEPSEEK_YARN = {
    "max_position_embeddings": 163840,  # = factor x original, as DeepSeek-V2/V3
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
    },
}


def deepseek_v3_config(d: Dims) -> dict:
    n_group, topk_group = d.expert_groups
    return {
        **common_config(d, "deepseek_v3", "DeepseekV3ForCausalLM"),
        "num_key_value_heads": d.heads,
        "intermediate_size": d.intermediate,
        "moe_intermediate_size": d.moe_hidden,
        "n_routed_experts": d.experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": d.top_k,
        "routed_scaling_factor": 2.5,
        "n_group": n_group,
        "topk_group": topk_group,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 1 if d.layers > 1 else 0,
        "kv_lora_rank": 64,
        "q_lora_rank": 96,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        **_DEEPSEEK_YARN,
        "attention_bias": False,
        "num_nextn_predict_layers": 1,
    }


def glm4_moe_config(d: Dims) -> dict:
    return {
        **common_config(d, "glm4_moe", "Glm4MoeForCausalLM"),
        "head_dim": d.head_dim,
        "intermediate_size": d.intermediate,
        "moe_intermediate_size": d.moe_hidden,
        "n_routed_experts": d.experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": d.top_k,
        "routed_scaling_factor": 1.0,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "first_k_dense_replace": 1 if d.layers > 1 else 0,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "use_qk_norm": True,
        "attention_bias": True,
        "num_nextn_predict_layers": 1,
    }


def _gpt_oss(d: Dims) -> dict:
    return {
        **common_config(d, "gpt_oss", "GptOssForCausalLM"),
        "head_dim": d.head_dim,
        "intermediate_size": d.moe_hidden,
        "num_local_experts": d.experts,
        "num_experts_per_tok": d.top_k,
        "experts_per_token": d.top_k,
        "rms_norm_eps": 1e-5,
        "sliding_window": 128,
        "rope_theta": 150000,
        "max_position_embeddings": 131072,  # = factor x original, as gpt-oss
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
            "truncate": False,
        },
        "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(d.layers)
        ],
        "swiglu_limit": 7.0,
        "attention_bias": True,
    }


def _mixtral(d: Dims) -> dict:
    return {
        **common_config(d, "mixtral", "MixtralForCausalLM"),
        "intermediate_size": d.moe_hidden,
        "num_local_experts": d.experts,
        "num_experts_per_tok": d.top_k,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
    }


def _olmoe(d: Dims) -> dict:
    return {
        **common_config(d, "olmoe", "OlmoeForCausalLM"),
        "num_key_value_heads": d.heads,
        "intermediate_size": d.moe_hidden,
        "num_experts": d.experts,
        "num_experts_per_tok": d.top_k,
        "norm_topk_prob": False,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "clip_qkv": None,
    }


def _nemotron_pattern(layers: int) -> str:
    # Nemotron-3-Nano alternates Mamba and MoE blocks with an occasional attention block
    # ("MEMEM*EMEMEM*E..."); "ME*E" keeps all three kinds in four layers.
    return "".join("ME*E"[i % 4] for i in range(layers))


def _nemotron_h(d: Dims) -> dict:
    mamba_heads = max(2, d.hidden // 32)
    return {
        **common_config(d, "nemotron_h", "NemotronHForCausalLM"),
        "head_dim": d.head_dim,
        "attention_bias": False,
        "intermediate_size": d.intermediate,
        "hybrid_override_pattern": _nemotron_pattern(d.layers),
        "mamba_num_heads": mamba_heads,
        "mamba_head_dim": 32,
        "mamba_proj_bias": False,
        "mamba_hidden_act": "silu",
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 2 if mamba_heads % 2 == 0 else 1,
        "chunk_size": 128,
        "mlp_bias": False,
        "mlp_hidden_act": "relu2",
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "moe_intermediate_size": d.moe_hidden,
        "moe_shared_expert_intermediate_size": 2 * d.moe_hidden,
        "n_routed_experts": d.experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": d.top_k,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "time_step_min": 0.001,
        "time_step_max": 0.1,
    }


def _nemotron_finalize(cfg: dict) -> None:
    pattern = cfg.get("hybrid_override_pattern")
    if pattern:
        cfg["num_hidden_layers"] = len(pattern)


def _kimi_linear(d: Dims) -> dict:
    full = [i for i in range(1, d.layers + 1) if i % 4 == 0]
    kda = [i for i in range(1, d.layers + 1) if i % 4 != 0]
    cfg = common_config(d, "kimi_linear", "KimiLinearForCausalLM")
    cfg.update(
        {
            "num_key_value_heads": d.heads,
            "head_dim": d.head_dim,
            "intermediate_size": d.intermediate,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-5,
            "model_max_length": 32768,
            "linear_attn_config": {
                "full_attn_layers": full,
                "kda_layers": kda,
                "num_heads": d.heads,
                "head_dim": d.head_dim,
                "short_conv_kernel_size": 4,
            },
            "num_experts": d.experts,
            "moe_intermediate_size": d.moe_hidden,
            "num_experts_per_token": d.top_k,
            "num_shared_experts": 1,
            "moe_router_activation_func": "sigmoid",
            "moe_renormalize": True,
            "routed_scaling_factor": 2.446,
            "first_k_dense_replace": 1 if d.layers > 1 else 0,
            "moe_layer_freq": 1,
            "use_grouped_topk": True,
            "num_expert_group": 1,
            "topk_group": 1,
            "kv_lora_rank": 64,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16,
            "v_head_dim": 32,
            "mla_use_nope": True,
        }
    )
    return cfg


def _minimax(d: Dims) -> dict:
    return {
        **common_config(d, "minimax", "MiniMaxM2ForCausalLM"),
        "head_dim": d.head_dim,
        "intermediate_size": d.moe_hidden,
        "num_local_experts": d.experts,
        "num_experts_per_tok": d.top_k,
        "shared_intermediate_size": 0,
        "rotary_dim": d.head_dim // 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 5000000.0,
        "scoring_func": "sigmoid",
        "use_qk_norm": True,
        "qk_norm_type": "per_layer",
    }


def _laguna(d: Dims) -> dict:
    layer_types = [
        "full_attention" if i % 2 == 0 else "sliding_attention" for i in range(d.layers)
    ]
    return {
        **common_config(d, "laguna", "LagunaForCausalLM"),
        "head_dim": d.head_dim,
        "intermediate_size": d.intermediate,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "qkv_bias": False,
        "gating": True,
        "sliding_window": 512,
        "layer_types": layer_types,
        "num_attention_heads_per_layer": [d.heads] * d.layers,
        "mlp_layer_types": ["dense"] + ["sparse"] * (d.layers - 1),
        "rope_parameters": {
            "full_attention": {
                "rope_type": "default",
                "rope_theta": 500000.0,
                "partial_rotary_factor": 0.5,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "num_experts": d.experts,
        "num_experts_per_tok": d.top_k,
        "moe_intermediate_size": d.moe_hidden,
        "shared_expert_intermediate_size": d.moe_hidden,
        "moe_routed_scaling_factor": 2.5,
        "moe_router_logit_softcapping": 0.0,
        "moe_router_score_func": "sigmoid",
    }


def _laguna_finalize(cfg: dict) -> None:
    # per-layer lists must follow a layer count changed through overrides
    n = cfg["num_hidden_layers"]
    for key in ("layer_types", "num_attention_heads_per_layer", "mlp_layer_types"):
        if key in cfg and len(cfg[key]) != n:
            raise SyntheticError(f"laguna: overrides give {key} {len(cfg[key])} entries for {n} layers")


def _qwen2_moe(d: Dims) -> dict:
    return {
        **common_config(d, "qwen2_moe", "Qwen2MoeForCausalLM"),
        "intermediate_size": d.intermediate,
        "moe_intermediate_size": d.moe_hidden,
        "shared_expert_intermediate_size": 2 * d.moe_hidden,
        "num_experts": d.experts,
        "num_experts_per_tok": d.top_k,
        "decoder_sparse_step": 1,
        "norm_topk_prob": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
    }


def _deepseek_v2(d: Dims) -> dict:
    n_group, topk_group = d.expert_groups
    return {
        **common_config(d, "deepseek_v2", "DeepseekV2ForCausalLM"),
        **mla_config(d),
        "intermediate_size": d.intermediate,
        "moe_intermediate_size": d.moe_hidden,
        "n_routed_experts": d.experts,
        "n_shared_experts": 2,
        "num_experts_per_tok": d.top_k,
        "routed_scaling_factor": 16.0,
        "topk_method": "group_limited_greedy",
        "n_group": n_group,
        "topk_group": topk_group,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 1 if d.layers > 1 else 0,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        **_DEEPSEEK_YARN,
        "attention_bias": False,
    }


def _glm4_moe_lite(d: Dims) -> dict:
    return {
        **common_config(d, "glm4_moe_lite", "Glm4MoeLiteForCausalLM"),
        **mla_config(d),
        "intermediate_size": d.intermediate,
        "moe_intermediate_size": d.moe_hidden,
        "n_routed_experts": d.experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": d.top_k,
        "routed_scaling_factor": 1.8,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 1 if d.layers > 1 else 0,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "num_nextn_predict_layers": 1,
    }


def _llama4(d: Dims) -> dict:
    text = {
        **common_config(d, "llama4_text", "Llama4ForCausalLM"),
        "head_dim": d.head_dim,
        "intermediate_size": d.moe_hidden,
        "intermediate_size_mlp": d.intermediate,
        "num_local_experts": d.experts,
        "num_experts_per_tok": d.top_k,
        # Maverick: MoE every other layer (dense MLP between), a shared expert in each
        "interleave_moe_layer_step": 2 if d.layers > 1 else 1,
        "attention_chunk_size": 8192,
        "attention_bias": False,
        "use_qk_norm": True,
        "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(d.layers)],
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": None,
    }
    text.pop("architectures")
    return {
        "architectures": ["Llama4ForConditionalGeneration"],
        "model_type": "llama4",
        "text_config": text,
        "tie_word_embeddings": False,
    }


def _granitemoe(d: Dims) -> dict:
    return {
        **common_config(d, "granitemoe", "GraniteMoeForCausalLM"),
        "intermediate_size": d.moe_hidden,
        "num_local_experts": d.experts,
        "num_experts_per_tok": d.top_k,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "logits_scaling": 6.0,
        "attention_multiplier": 0.0078125,
        "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22,
        "tie_word_embeddings": True,
    }


def _lfm2_moe(d: Dims) -> dict:
    # LFM2: short-convolution blocks with an attention block every few layers
    layer_types = ["full_attention" if i % 4 == 2 else "conv" for i in range(d.layers)]
    return {
        **common_config(d, "lfm2_moe", "Lfm2MoeForCausalLM"),
        "intermediate_size": d.intermediate,
        "moe_intermediate_size": d.moe_hidden,
        "num_experts": d.experts,
        "num_experts_per_tok": d.top_k,
        "norm_topk_prob": True,
        "use_expert_bias": True,
        "num_dense_layers": 1 if d.layers > 1 else 0,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "layer_types": layer_types,
        "rope_theta": 1000000.0,
    }


FIRST_PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            "qwen3_moe",
            _qwen3_moe,
            vlm=VlmLayout(
                "wrapper",
                model_type="qwen3_vl_moe",
                architectures=("Qwen3VLMoeForConditionalGeneration",),
                text_model_type="qwen3_vl_moe_text",
            ),
            notes="experts at model.layers.N.mlp.switch_mlp",
        ),
        Preset(
            "qwen3_next",
            _qwen3_next,
            layers=4,
            min_layers=2,
            notes="hybrid Gated DeltaNet / attention; shared expert with sigmoid gate",
        ),
        Preset(
            "qwen3_5_moe",
            qwen3_5_moe_config,
            layers=4,
            min_layers=2,
            vlm=VlmLayout("native"),
            mtp=qwen_mtp(),
            notes="names always start with language_model. (mlx-lm class wraps the text model)",
        ),
        Preset(
            "deepseek_v3",
            deepseek_v3_config,
            layers=3,
            max_layers=61,
            mtp=deepseek_mtp("model.layers.61"),  # sanitize drops layer 61 by number
            vlm=VlmLayout(
                "wrapper",
                model_type="kimi_k25",
                architectures=("KimiK25ForConditionalGeneration",),
                text_model_type="kimi_k2",
            ),
            notes="first_k_dense_replace dense layers, shared experts, raw router matrix "
            "(mlp.gate.weight, zero-initialized in mlx-lm), e_score_correction_bias kept float32",
        ),
        Preset("glm4_moe", glm4_moe_config, layers=3, mtp=deepseek_mtp(), notes="dense first layer, shared expert"),
        Preset(
            "gpt_oss",
            _gpt_oss,
            experts=16,
            top_k=4,
            quant_mode="mxfp4",
            min_layers=2,
            notes="experts at mlp.experts (SwitchGLU with biases), router 8-bit per quant_predicate",
        ),
        Preset(
            "mixtral",
            _mixtral,
            experts=8,
            top_k=2,
            notes="experts at model.layers.N.block_sparse_moe.switch_mlp",
        ),
        Preset("olmoe", _olmoe, top_k=4),
        Preset(
            "nemotron_h",
            _nemotron_h,
            layers=4,
            mtp=qwen_mtp(),
            finalize=_nemotron_finalize,
            notes="backbone.layers.N.mixer.switch_mlp (SwitchMLP fc1/fc2, relu2); "
            "layers follow hybrid_override_pattern",
        ),
        Preset(
            "kimi_linear",
            _kimi_linear,
            layers=4,
            min_layers=2,
            mtp=qwen_mtp("model.mtp"),
            notes="KDA linear attention + MLA; dense first layer; experts at mlp.switch_mlp",
        ),
        Preset("minimax", _minimax, notes="experts at block_sparse_moe.switch_mlp"),
        Preset(
            "qwen2_moe",
            _qwen2_moe,
            notes="shared expert with sigmoid gate (shared_expert_gate, shape (1, hidden))",
        ),
        Preset(
            "deepseek_v2",
            _deepseek_v2,
            layers=3,
            notes="group-limited greedy softmax routing, 2 shared experts, MLA",
        ),
        Preset(
            "glm4_moe_lite",
            _glm4_moe_lite,
            layers=3,
            mtp=deepseek_mtp(),
            notes="MLA + noaux_tc sigmoid routing (GLM-4.7-Flash)",
        ),
        Preset(
            "llama4",
            _llama4,
            layers=4,
            top_k=1,  # mlx-lm's Llama 4 MoE routes each token to one expert only
            vlm=VlmLayout("native", vision_prefix="vision_model"),
            notes="language_model.model.layers.N.feed_forward.experts, MoE every other layer, "
            "router at feed_forward.router, shared expert",
        ),
        Preset(
            "granitemoe",
            _granitemoe,
            notes="router at block_sparse_moe.router.layer (8-bit per quant_predicate); tied "
            "embeddings (no lm_head tensor): greedy output of random weights repeats a token",
        ),
        Preset(
            "lfm2_moe",
            _lfm2_moe,
            layers=4,
            notes="experts at feed_forward.switch_mlp; expert_bias kept float32; conv blocks",
        ),
        Preset(
            "laguna",
            _laguna,
            layers=3,
            min_layers=2,
            vlm=VlmLayout("prefix", vision_prefix=None),
            finalize=_laguna_finalize,
            mlx_lm_since="0.32",
            notes="mlx-lm >= 0.32 only; router at mlp.gate.proj",
        ),
    ]
}
