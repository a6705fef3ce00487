"""Presets for the MoE families mlx-lm added or that the first preset file left out: the 2026
flagships (DeepSeek-V4.1, Kimi K3, Mistral 4, Gemma 4, MiMo-V2-Flash, MiniMax-M3, Muse Spark,
Ling/Ring 2.5) and the older families (dots1, ERNIE 4.5, Hunyuan, LongCat-Flash, ...). Same rules
as presets.py: real config field names and values, shrunk to the caller's sizes; registered in
PRESETS by registry.py."""

from __future__ import annotations

from . import hadamard_pack
from .preset import Dims, Mtp, Preset, VlmLayout, common_config, deepseek_mtp, mla_config, qwen_mtp
from .presets import deepseek_v3_config, glm4_moe_config, qwen3_5_moe_config


def _every(n: int, period: int, offset: int = 0) -> list[int]:
    """0/1 per layer: 1 where (i - offset) is a multiple of `period`."""
    return [int(i >= offset and (i - offset) % period == 0) for i in range(n)]


def _dense_first(d: Dims) -> int:
    return 1 if d.layers > 1 else 0


# ---------------------------------------------------------------- 2026 flagships


def _deepseek_v41(d: Dims) -> dict:
    # DeepSeek-V4.1: every layer MoE (sqrt-softplus router with correction bias, a shared
    # expert), hyper-connections (hc_mult streams), sliding-window attention with compressed
    # KV in some layers; the MTP block (`mtp.`) is dropped by sanitize.
    return {
        **common_config(d, "deepseek_v41", "DeepseekV41ForCausalLM"),
        "head_dim": 64,
        "q_lora_rank": 96,
        "qk_rope_head_dim": 16,
        "o_groups": 2,
        "o_lora_rank": 64,
        "moe_intermediate_size": d.moe_hidden,
        "n_routed_experts": d.experts,
        "num_experts_per_tok": d.top_k,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-6,
        "sliding_window": 128,
        "compress_ratios": [0] + [4] * (d.layers - 1),
        "kv_source_layer_ids": list(range(1, d.layers)),
        "index_source_layer_ids": [1] if d.layers > 1 else [],
        "index_n_heads": 2,
        "index_head_dim": 32,
        "index_topk": 64,
        "rope_theta": 10000.0,
        "max_position_embeddings": 65536,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "num_nextn_predict_layers": 1,
    }


def _kimi_k3(d: Dims) -> dict:
    # Kimi K3: KDA linear attention 3 : 1 MLA, attention residuals over blocks of layers,
    # SiTU experts in a latent width (routed_expert_hidden_size), dense first layer.
    full = [i for i in range(1, d.layers + 1) if i % 4 == 0]
    text = common_config(d, "kimi_k3", "KimiK3ForCausalLM")
    text.pop("hidden_act")
    text.update(
        {
            "num_key_value_heads": d.heads,
            "intermediate_size": d.intermediate,
            "rms_norm_eps": 1e-5,
            "linear_attn_config": {
                "full_attn_layers": full,
                "kda_layers": [i for i in range(1, d.layers + 1) if i not in full],
                "num_heads": d.heads,
                "head_dim": d.head_dim,
                "short_conv_kernel_size": 4,
            },
            "hidden_act": "situ",
            "activation_situ_beta": 1.0,
            "attn_res_block_size": 2,
            "q_lora_rank": 96,
            "kv_lora_rank": 64,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16,
            "v_head_dim": 32,
            "mla_use_nope": True,
            "mla_use_output_gate": True,
            "num_experts": d.experts,
            "num_experts_per_token": d.top_k,
            "num_shared_experts": 1,
            "moe_intermediate_size": d.moe_hidden,
            "moe_router_activation_func": "sigmoid",
            "moe_renormalize": True,
            "routed_scaling_factor": 2.5,
            "first_k_dense_replace": _dense_first(d),
            "moe_layer_freq": 1,
            "use_grouped_topk": True,
            "num_expert_group": 1,
            "topk_group": 1,
            "routed_expert_hidden_size": d.hidden // 2,
            "latent_moe_use_norm": True,
        }
    )
    return text


def _mistral4(d: Dims) -> dict:
    # Mistral Large 3 / Mistral 4: DeepSeek-V3 layout (MLA, shared expert, grouped routing).
    n_group, topk_group = d.expert_groups
    return {
        **common_config(d, "mistral4", "Mistral4ForCausalLM"),
        **mla_config(d),
        "intermediate_size": d.intermediate,
        "moe_intermediate_size": d.moe_hidden,
        "n_routed_experts": d.experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": d.top_k,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": True,
        "n_group": n_group,
        "topk_group": topk_group,
        "first_k_dense_replace": _dense_first(d),
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144,
        "rope_parameters": {
            "type": "yarn",
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 64.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1,
        },
    }


def _gemma4_text(d: Dims) -> dict:
    # Gemma 4 MoE (26B-A4B): every layer has a dense MLP and an MoE block side by side,
    # sliding / full attention 5 : 1, tied embeddings, soft-capped logits.
    return {
        **common_config(d, "gemma4_text", "Gemma4ForCausalLM"),
        "head_dim": d.head_dim,
        "global_head_dim": 2 * d.head_dim,
        "intermediate_size": d.intermediate,
        "num_key_value_heads": d.kv_heads,
        "num_global_key_value_heads": d.kv_heads,
        "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": d.vocab,
        "rms_norm_eps": 1e-6,
        "sliding_window": 512,
        "sliding_window_pattern": 2,
        "final_logit_softcapping": 30.0,
        "use_double_wide_mlp": False,
        "attention_k_eq_v": True,
        "enable_moe_block": True,
        "num_experts": d.experts,
        "top_k_experts": d.top_k,
        "moe_intermediate_size": d.moe_hidden,
        "tie_word_embeddings": True,
        "hidden_activation": "gelu_pytorch_tanh",
    }


def _mimo_v2_flash(d: Dims) -> dict:
    # MiMo-V2-Flash: sliding / global attention hybrid with attention sinks, dense first
    # layer, sigmoid noaux_tc routing; MTP layers dropped by sanitize.
    pattern = [0 if i % 4 == 0 else 1 for i in range(d.layers)]
    if 1 not in pattern:
        pattern[-1] = 1
    return {
        **common_config(d, "mimo_v2_flash", "MiMoV2FlashForCausalLM"),
        "hybrid_layer_pattern": pattern,
        "moe_layer_freq": [0] * _dense_first(d) + [1] * (d.layers - _dense_first(d)),
        "add_swa_attention_sink_bias": True,
        "add_full_attention_sink_bias": False,
        "sliding_window_size": 128,
        "intermediate_size": d.intermediate,
        "moe_intermediate_size": d.moe_hidden,
        "n_shared_experts": None,
        "n_routed_experts": d.experts,
        "routed_scaling_factor": None,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": d.top_k,
        "layernorm_epsilon": 1e-5,
        "rope_theta": 5000000.0,
        "swa_rope_theta": 10000.0,
        "swa_num_attention_heads": d.heads,
        "swa_num_key_value_heads": d.kv_heads,
        "head_dim": d.head_dim + 16,
        "v_head_dim": d.head_dim,
        "swa_head_dim": d.head_dim + 16,
        "swa_v_head_dim": d.head_dim,
        "partial_rotary_factor": 0.334,
        "num_nextn_predict_layers": 1,
    }


def _minimax_m3_vl(d: Dims) -> dict:
    # MiniMax-M3: the VLM export (text model under language_model.), dense first layer,
    # shared expert, swiglu with clamp; the vision tower is dropped by sanitize.
    text = {
        **common_config(d, "minimax_m3", "MiniMaxM3ForCausalLM"),
        "head_dim": d.head_dim,
        "intermediate_size": d.moe_hidden,
        "dense_intermediate_size": d.intermediate,
        "shared_intermediate_size": d.moe_hidden,
        "num_local_experts": d.experts,
        "num_experts_per_tok": d.top_k,
        "rms_norm_eps": 1e-6,
        "rope_theta": 5000000.0,
        "partial_rotary_factor": 0.5,
        "routed_scaling_factor": 2.0,
        "use_qk_norm": True,
        "use_gemma_norm": True,
        "mlp_layer_types": ["dense"] * _dense_first(d) + ["sparse"] * (d.layers - _dense_first(d)),
    }
    text.pop("architectures")
    return {
        "architectures": ["MiniMaxM3VLForConditionalGeneration"],
        "model_type": "minimax_m3_vl",
        "text_config": text,
        "tie_word_embeddings": False,
    }


def _muse_spark(d: Dims) -> dict:
    # Muse Spark: every layer MoE, sliding / full attention, NoPE layers (rope theta 0).
    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(d.layers)]
    text = {
        "hidden_size": d.hidden,
        "num_attention_heads": d.heads,
        "num_key_value_heads": d.kv_heads,
        "head_dim": d.head_dim,
        "num_hidden_layers": d.layers,
        "vocab_size": d.vocab,
        "rms_norm_eps": 1e-5,
        "post_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "layer_rope_theta": [500000.0 if t == "sliding_attention" else 0.0 for t in types],
        "layer_types": types,
        "sliding_window": 128,
        "final_logit_softcapping": 30.0,
        "output_multiplier": 1.0,
        "num_local_experts": d.experts,
        "num_experts_per_tok": d.top_k,
        "moe_hidden_size": d.hidden // 2,  # experts run at a compressed width
        "moe_intermediate_size": d.moe_hidden,
        "tie_word_embeddings": False,
    }
    return {
        "architectures": ["MuseSparkForConditionalGeneration"],
        "model_type": "muse_spark",
        "text_config": text,
        # transformers (5.24) checks that the audio encoder's width is the text model's when the
        # tokenizer loads the config; the real export carries the block
        "audio_config": {"out_hidden_size": d.hidden},
        "tie_word_embeddings": False,
    }


def _bailing_v3(d: Dims, model_type: str) -> dict:
    # Ling / Ring 2.5 (bailing_moe_v3) and its hybrid release (bailing_hybrid): KDA or
    # linear attention in groups of layer_group_size with MLA closing each group, dense first
    # layer, grouped sigmoid routing with expert bias, shared expert.
    n_group, topk_group = d.expert_groups
    cfg = {
        **common_config(d, model_type, "BailingMoeV3ForCausalLM"),
        "num_key_value_heads": d.heads,
        "head_dim": d.head_dim,
        "intermediate_size": d.intermediate,
        "moe_intermediate_size": d.moe_hidden,
        "moe_shared_expert_intermediate_size": d.moe_hidden,
        "num_experts": d.experts,
        "num_experts_per_tok": d.top_k,
        "num_shared_experts": 1,
        "first_k_dense_replace": _dense_first(d),
        "n_group": n_group,
        "topk_group": topk_group,
        "routed_scaling_factor": 2.5,
        "layer_group_size": min(4, d.layers),
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "rms_norm_eps": 1e-6,
        "rope_theta": 6000000.0,
        "rope_interleave": True,
        "num_nextn_predict_layers": 1,
    }
    if model_type == "bailing_moe_v3":
        cfg.update({"q_lora_rank": 96, "short_conv_kernel_size": 4, "kda_lower_bound": -5.0,
                    "kda_safe_gate": True, "no_kda_lora": True})
    else:
        cfg.update({"group_norm_size": 2, "score_function": "sigmoid", "norm_topk_prob": True,
                    "moe_router_enable_expert_bias": True, "use_qk_norm": True,
                    "partial_rotary_factor": 0.5})
    return cfg


def _bailing_moe_v3(d: Dims) -> dict:
    return _bailing_v3(d, "bailing_moe_v3")


def _bailing_hybrid(d: Dims) -> dict:
    return _bailing_v3(d, "bailing_hybrid")


def _bailing_moe(d: Dims, model_type: str = "bailing_moe") -> dict:
    # Ling 2.0: dense first layer, grouped sigmoid routing with expert bias, shared expert.
    n_group, topk_group = d.expert_groups
    return {
        **common_config(d, model_type, "BailingMoeV2ForCausalLM"),
        "head_dim": d.head_dim,
        "intermediate_size": d.intermediate,
        "moe_intermediate_size": d.moe_hidden,
        "moe_shared_expert_intermediate_size": d.moe_hidden,
        "num_experts": d.experts,
        "num_shared_experts": 1,
        "num_experts_per_tok": d.top_k,
        "norm_topk_prob": True,
        "first_k_dense_replace": _dense_first(d),
        "rms_norm_eps": 1e-6,
        "rope_theta": 600000.0,
        "use_qk_norm": True,
        "partial_rotary_factor": 0.5,
        "moe_router_enable_expert_bias": True,
        "routed_scaling_factor": 2.5,
        "score_function": "sigmoid",
        "n_group": n_group,
        "topk_group": topk_group,
        "num_nextn_predict_layers": 1,
    }


def _bailing_moe_linear(d: Dims) -> dict:
    # Ring-mini-linear: lightning (linear) attention with a softmax-attention layer closing
    # each group of layer_group_size.
    cfg = _bailing_moe(d, "bailing_moe_linear")
    cfg["architectures"] = ["BailingMoeLinearV2ForCausalLM"]
    cfg.update({"layer_group_size": min(4, d.layers), "group_norm_size": 2})
    return cfg


def _jamba(d: Dims) -> dict:
    # Jamba: Mamba / attention 7 : 1, MoE every other layer; tied embeddings off in 1.5.
    return {
        **common_config(d, "jamba", "JambaForCausalLM"),
        "intermediate_size": d.moe_hidden,
        "attn_layer_offset": min(2, d.layers - 1),
        "attn_layer_period": 4,
        "expert_layer_offset": 1 if d.layers > 1 else 0,
        "expert_layer_period": 2,
        "mamba_d_conv": 4,
        "mamba_d_state": 16,
        "mamba_expand": 2,
        "mamba_dt_rank": 16,
        "num_experts": d.experts,
        "num_experts_per_tok": d.top_k,
        "rms_norm_eps": 1e-6,
    }


def _granitemoehybrid(d: Dims) -> dict:
    # Granite 4.0 (H-Small/Tiny): Mamba-2 / attention hybrid, MoE with a shared MLP in every
    # layer, tied embeddings.
    types = ["attention" if i % 4 == 2 else "mamba" for i in range(d.layers)]
    return {
        **common_config(d, "granitemoehybrid", "GraniteMoeHybridForCausalLM"),
        "intermediate_size": d.intermediate,
        "attention_bias": False,
        "embedding_multiplier": 12.0,
        "attention_multiplier": 0.0078125,
        "logits_scaling": 6.0,
        "residual_multiplier": 0.22,
        "layer_types": types,
        "rms_norm_eps": 1e-5,
        "num_local_experts": d.experts,
        "num_experts_per_tok": d.top_k,
        "shared_intermediate_size": d.moe_hidden,
        "mamba_expand": 2,
        "mamba_n_heads": 2 * d.hidden // 32,  # transformers checks heads x head_dim = expand x hidden
        "mamba_d_head": 32,
        "mamba_proj_bias": False,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_n_groups": 1,
        "mamba_conv_bias": True,
        "position_embedding_type": "nope",
        "rope_theta": 10000.0,  # mlx-lm 0.31 requires it even without rope
        "tie_word_embeddings": True,
        # the moe width: granite's experts are `intermediate_size` wide in transformers
        "moe_intermediate_size": d.moe_hidden,
    }


def _deepseek_v32(d: Dims) -> dict:
    # DeepSeek-V3.2: DeepSeek-V3 plus the lightning indexer (sparse attention).
    n_group, topk_group = d.expert_groups
    return {
        **common_config(d, "deepseek_v32", "DeepseekV32ForCausalLM"),
        **mla_config(d),
        "index_head_dim": 32,
        "index_n_heads": 2,
        "index_topk": 64,
        "intermediate_size": d.intermediate,
        "moe_intermediate_size": d.moe_hidden,
        "n_routed_experts": d.experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": d.top_k,
        "routed_scaling_factor": 2.5,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "n_group": n_group,
        "topk_group": topk_group,
        "moe_layer_freq": 1,
        "first_k_dense_replace": _dense_first(d),
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 163840,
        "num_nextn_predict_layers": 1,
    }


def _glm_moe_dsa(d: Dims) -> dict:
    # GLM-5: the DeepSeek-V3.2 model (mlx-lm reuses it) under GLM's config names.
    cfg = {**_deepseek_v32(d), **common_config(d, "glm_moe_dsa", "GlmMoeDsaForCausalLM")}
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
    return {**cfg, "attention_bias": False, "indexer_rope_interleave": True}


def _solar_open(d: Dims) -> dict:
    # Solar Open: mlx-lm builds it with the glm4_moe model.
    cfg = {**glm4_moe_config(d), **common_config(d, "solar_open", "SolarOpenForCausalLM")}
    return {**cfg, "scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def _prism_hadamard_qwen35(d: Dims) -> dict:
    # Prism's Hadamard packs (Bonsai 2): the qwen3_5 (MoE) model, packed by hadamard_pack.pack
    # after its weights are drawn. The shared expert runs at the model's width, so every packed
    # linear's input takes the same Hadamard block (the published packs use one block).
    config = qwen3_5_moe_config(d)
    config["text_config"]["shared_expert_intermediate_size"] = d.hidden
    return config


def _kimi_vl(d: Dims) -> dict:
    # Kimi-VL's language model: the DeepSeek-V3 model under `language_model.` (names as the
    # mlx-lm class has them; its sanitize drops the vision tower).
    return {"architectures": ["KimiVLForConditionalGeneration"], "model_type": "kimi_vl",
            "text_config": {**deepseek_v3_config(d), "model_type": "deepseek_v3"}}


def _longcat_flash_ngram(d: Dims) -> dict:
    # LongCat-Flash with n-gram embeddings beside the word embedding.
    return {**_longcat_flash(d), "architectures": ["LongcatFlashNgramForCausalLM"],
            "model_type": "longcat_flash_ngram", "ngram_vocab_size_ratio": 4, "emb_neighbor_num": 3,
            "emb_split_num": 2}


# ---------------------------------------------------------------- older families


def _deepseek(d: Dims) -> dict:
    # DeepSeek-MoE 16B: dense first layer, 2 shared experts, softmax routing.
    return {
        **common_config(d, "deepseek", "DeepseekForCausalLM"),
        "num_key_value_heads": d.heads,
        "intermediate_size": d.intermediate,
        "moe_intermediate_size": d.moe_hidden,
        "n_shared_experts": 2,
        "n_routed_experts": d.experts,
        "num_experts_per_tok": d.top_k,
        "moe_layer_freq": 1,
        "first_k_dense_replace": _dense_first(d),
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
    }


def _dots1(d: Dims) -> dict:
    return {
        **common_config(d, "dots1", "Dots1ForCausalLM"),
        "head_dim": d.head_dim,
        "intermediate_size": d.intermediate,
        "first_k_dense_replace": _dense_first(d),
        "moe_intermediate_size": d.moe_hidden,
        "n_routed_experts": d.experts,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_experts_per_tok": d.top_k,
        "routed_scaling_factor": 2.5,
        "scoring_func": "noaux_tc",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000000.0,
    }


def _ernie4_5_moe(d: Dims) -> dict:
    return {
        **common_config(d, "ernie4_5_moe", "Ernie4_5_MoeForCausalLM"),
        "head_dim": d.head_dim,
        "intermediate_size": d.intermediate,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "use_bias": False,
        "moe_num_experts": d.experts,
        "moe_layer_start_index": _dense_first(d),
        "moe_intermediate_size": d.moe_hidden,
        "moe_k": d.top_k,
        "moe_layer_interval": 1,
        "moe_use_aux_free": True,
        "moe_num_shared_experts": 1,
    }


def _exaone_moe(d: Dims) -> dict:
    types = ["full_attention" if i % 4 == 3 else "sliding_attention" for i in range(d.layers)]
    return {
        **common_config(d, "exaone_moe", "ExaoneMoEForCausalLM"),
        "head_dim": d.head_dim,
        "intermediate_size": d.intermediate,
        "moe_intermediate_size": d.moe_hidden,
        "num_experts": d.experts,
        "num_experts_per_tok": d.top_k,
        "num_shared_experts": 1,
        "rms_norm_eps": 1e-5,
        "sliding_window": 128,
        "layer_types": types,
        "is_moe_layer": [i >= _dense_first(d) for i in range(d.layers)],
        "routed_scaling_factor": 2.5,
        "num_nextn_predict_layers": 1,
    }


def _hunyuan(d: Dims) -> dict:
    # Hunyuan-A13B: a shared MLP beside the experts, cross-layer KV sharing (CLA) off.
    return {
        **common_config(d, "hunyuan", "HunYuanMoEV1ForCausalLM"),
        "intermediate_size": d.intermediate,
        "attention_bias": False,
        "moe_topk": d.top_k,
        "num_experts": d.experts,
        "num_shared_expert": 1,
        "use_mixed_mlp_moe": True,
        "use_qk_norm": True,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "dynamic", "alpha": 1000.0, "factor": 1.0},
        "use_cla": False,
        "cla_share_factor": 2,
        "moe_intermediate_size": d.moe_hidden,
    }


def _longcat_flash(d: Dims) -> dict:
    # LongCat-Flash: two MLA attentions per layer, zero (identity) experts beside the real ones.
    return {
        "architectures": ["LongcatFlashForCausalLM"],
        "model_type": "longcat_flash",
        "attention_method": "MLA",
        "zero_expert_type": "identity",
        "hidden_size": d.hidden,
        "ffn_hidden_size": d.intermediate,
        "moe_topk": d.top_k,
        "expert_ffn_hidden_size": d.moe_hidden,
        "n_routed_experts": d.experts,
        "zero_expert_num": 2,
        "num_layers": d.layers,
        "num_hidden_layers": d.layers,  # read by the quantizer's per-layer bits
        "vocab_size": d.vocab,
        "max_position_embeddings": 32768,
        "num_attention_heads": d.heads,
        "kv_lora_rank": 64,
        "q_lora_rank": 96,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "routed_scaling_factor": 6.0,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000000.0,
        "mla_scale_q_lora": True,
        "mla_scale_kv_lora": True,
        "attention_bias": False,
        "router_bias": False,
        "tie_word_embeddings": False,
    }


def _mellum(d: Dims) -> dict:
    types = ["full_attention" if i % 2 == 0 else "sliding_attention" for i in range(d.layers)]
    return {
        **common_config(d, "mellum", "MellumForCausalLM"),
        "intermediate_size": d.intermediate,
        "num_experts": d.experts,
        "num_experts_per_tok": d.top_k,
        "moe_intermediate_size": d.moe_hidden,
        "rms_norm_eps": 1e-6,
        "head_dim": d.head_dim,
        "norm_topk_prob": True,
        "sliding_window": 128,
        "layer_types": types,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    }


def _klear(d: Dims) -> dict:
    return {
        **common_config(d, "Klear", "KlearForCausalLM"),
        "intermediate_size": d.intermediate,
        "attention_bias": False,
        "mlp_only_layers": [],
        "num_experts": d.experts,
        "num_experts_per_tok": d.top_k,
        "decoder_sparse_step": 1,
        "n_shared_experts": 1,
        "moe_intermediate_size": d.moe_hidden,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "norm_topk_prob": True,
        "head_dim": d.head_dim,
    }


def _afmoe(d: Dims) -> dict:
    # Arcee Trinity: dense first layers, sliding / full attention 3 : 1, sigmoid routing.
    types = ["full_attention" if i % 4 == 3 else "sliding_attention" for i in range(d.layers)]
    return {
        **common_config(d, "afmoe", "AfmoeForCausalLM"),
        "layer_types": types,
        "head_dim": d.head_dim,
        "intermediate_size": d.intermediate,
        "moe_intermediate_size": d.moe_hidden,
        "num_experts": d.experts,
        "num_experts_per_tok": d.top_k,
        "num_shared_experts": 1,
        "num_dense_layers": _dense_first(d),
        "route_norm": True,
        "route_scale": 2.826,
        "score_func": "sigmoid",
        "sliding_window": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000,
    }


def _phimoe(d: Dims) -> dict:
    return {
        **common_config(d, "phimoe", "PhiMoEForCausalLM"),
        "intermediate_size": d.moe_hidden,
        "num_local_experts": d.experts,
        "num_experts_per_tok": d.top_k,
        "original_max_position_embeddings": 4096,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        # Phi-3.5-MoE's long-context rope (mlx-lm 0.31 requires the block)
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0 + 0.05 * i for i in range(d.hidden // d.heads // 2)],
            "long_factor": [1.0 + 0.5 * i for i in range(d.hidden // d.heads // 2)],
            "short_mscale": 1.243,
            "long_mscale": 1.243,
        },
    }


def _phixtral(d: Dims) -> dict:
    return {
        "architectures": ["PhiForCausalLM"],
        "model_type": "phixtral",
        "num_vocab": d.vocab,
        "model_dim": d.hidden,
        "num_heads": d.heads,
        "num_layers": d.layers,
        "num_hidden_layers": d.layers,  # read by the quantizer's per-layer bits
        "rotary_dim": d.head_dim // 2,
        "num_experts_per_tok": d.top_k,
        "num_local_experts": d.experts,
    }


def _step3p5(d: Dims) -> dict:
    types = ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(d.layers)]
    return {
        **common_config(d, "step3p5", "Step3p5ForCausalLM"),
        "num_attention_groups": d.kv_heads,
        "head_dim": d.head_dim,
        "intermediate_size": d.intermediate,
        "rms_norm_eps": 1e-5,
        "sliding_window": 128,
        "layer_types": types,
        "moe_num_experts": d.experts,
        "moe_top_k": d.top_k,
        "moe_intermediate_size": d.moe_hidden,
        "share_expert_dim": d.moe_hidden,
        "moe_layers_enum": ",".join(str(i) for i in range(_dense_first(d), d.layers)),
        "moe_router_scaling_factor": 3.0,
        "norm_expert_weight": True,
    }


# ERNIE 4.5's MTP head: numbered blocks beside the model's layers.
ERNIE_MTP = Mtp("model.mtp_block.0", norms=("model.mtp_emb_norm.0.weight", "model.mtp_hidden_norm.0.weight"),
                projs=("model.mtp_linear_proj.0",))

PRESETS_2026 = [
    Preset("deepseek_v41", _deepseek_v41, mlx_lm_since="0.32", layers=3, notes="mlx-lm >= 0.32; hyper-connections, "
           "compressed KV, a layer cache of its own (not rewound: decode runs layer by layer)"),
    Preset("kimi_k3", _kimi_k3, mlx_lm_since="0.32", layers=4, min_layers=2, vlm=VlmLayout("native"),
           mtp=deepseek_mtp("language_model.model.layers.{n}"),
           notes="mlx-lm >= 0.32; KDA + MLA, attention residuals, latent MoE (experts at "
           "routed_expert_hidden_size); names start with language_model."),
    Preset("mistral4", _mistral4, mlx_lm_since="0.32", layers=3, notes="mlx-lm >= 0.32; MLA, shared expert"),
    Preset("gemma4_text", _gemma4_text, layers=3,
           vlm=VlmLayout("wrapper", model_type="gemma4", architectures=("Gemma4ForConditionalGeneration",),
                         text_model_type="gemma4_text"),
           notes="dense MLP and MoE side by side in every layer; tied embeddings"),
    Preset("mimo_v2_flash", _mimo_v2_flash, layers=4, min_layers=2, mtp=qwen_mtp("model.mtp"),
           notes="sliding / global attention with sinks, dense first layer"),
    Preset("minimax_m3_vl", _minimax_m3_vl, mlx_lm_since="0.32", layers=3, vlm=VlmLayout("native"),
           notes="mlx-lm >= 0.32; the language model of MiniMax-M3 (names start with "
           "language_model.), dense first layer, shared expert"),
    Preset("muse_spark", _muse_spark, mlx_lm_since="0.32", metal_only=True, layers=2,
           notes="mlx-lm >= 0.32; attention runs through Metal-only kernels in stock mlx-lm: "
           "no forward pass on CPU or CUDA"),
    Preset("bailing_moe_v3", _bailing_moe_v3, mlx_lm_since="0.32", layers=4, min_layers=2, mtp=deepseek_mtp(),
           notes="mlx-lm >= 0.32; KDA + MLA groups, dense first layer, shared expert"),
    Preset("bailing_hybrid", _bailing_hybrid, mlx_lm_since="0.32", layers=4, min_layers=2, mtp=deepseek_mtp(),
           notes="mlx-lm >= 0.32; linear attention + MLA groups, dense first layer"),
    Preset("bailing_moe_linear", _bailing_moe_linear, layers=4, min_layers=2,
           notes="linear attention groups, dense first layer, shared expert"),
    Preset("bailing_moe", _bailing_moe, layers=3, notes="dense first layer, shared expert"),
    Preset("jamba", _jamba, layers=4, notes="Mamba / attention hybrid, MoE every other layer"),
    Preset("granitemoehybrid", _granitemoehybrid, layers=4,
           notes="Mamba-2 / attention hybrid, shared MLP, tied embeddings"),
    Preset("deepseek_v32", _deepseek_v32, layers=3, mtp=deepseek_mtp(), notes="DeepSeek-V3 plus the indexer"),
    Preset("glm_moe_dsa", _glm_moe_dsa, layers=3, mtp=deepseek_mtp(), notes="GLM-5: the deepseek_v32 model"),
    Preset("solar_open", _solar_open, layers=3, mtp=deepseek_mtp(), notes="the glm4_moe model"),
    Preset("deepseek", _deepseek, layers=3, notes="dense first layer, 2 shared experts"),
    Preset("dots1", _dots1, layers=3, notes="dense first layer, shared expert"),
    Preset("ernie4_5_moe", _ernie4_5_moe, layers=3, mtp=ERNIE_MTP, notes="dense first layer, shared expert"),
    Preset("exaone_moe", _exaone_moe, layers=4, mtp=qwen_mtp(), notes="sliding / full attention, dense first layer"),
    Preset("hunyuan", _hunyuan, notes="shared MLP beside the experts"),
    Preset("longcat_flash", _longcat_flash, mtp=qwen_mtp("model.mtp"), notes="two attentions per layer, zero experts"),
    Preset("longcat_flash_ngram", _longcat_flash_ngram, mtp=qwen_mtp("model.mtp"),
           notes="LongCat-Flash with n-gram embeddings"),
    Preset("prism_hadamard_qwen35", _prism_hadamard_qwen35, mlx_lm_since="0.32", layers=4, min_layers=2,
           hidden=512, moe_hidden=128, default_bits=2, default_group_size=128, pack=hadamard_pack.pack,
           vlm=VlmLayout("native"),
           notes="mlx-lm >= 0.32; qwen3_5 with every linear and the embedding 2-bit in a "
           "Hadamard-rotated basis (`modules` manifest, sign vectors), experts plain 2-bit group 128"),
    Preset("kimi_vl", _kimi_vl, layers=3, notes="the deepseek_v3 model under language_model."),
    Preset("mellum", _mellum, mlx_lm_since="0.32", notes="mlx-lm >= 0.32; sliding / full attention"),
    Preset("Klear", _klear, notes="shared expert"),
    Preset("afmoe", _afmoe, layers=4, notes="dense first layer, sliding / full attention"),
    Preset("phimoe", _phimoe, experts=8, top_k=2),
    Preset("phixtral", _phixtral, experts=4, top_k=2),
    Preset("step3p5", _step3p5, layers=3, mtp=deepseek_mtp(), notes="dense first layer, shared expert, sliding / full"),
]
