"""The architectures the project knows, registered through the same hook a third party uses.

Every family below keeps its routed experts in mlx-lm's SwitchGLU or SwitchMLP, so the engine's
generic lookup (find blocks by type, read top-k from the config) fits them all; a spec here names
the model_types, and says what is special about each family in `notes`. A family whose experts
look different (another module class, other tensor names) is a plugin with its own spec."""

from expert_stream.plugin.hookspecs import hookimpl
from expert_stream.streaming.architectures import ArchitectureSpec

# (name, model_types, notes); checked against the mlx-lm 0.31 model files that use SwitchGLU/SwitchMLP.
FAMILIES = (
    ("qwen3_moe", ("qwen3_moe", "qwen2_moe"), "SwitchGLU at mlp.switch_mlp; qwen2_moe adds a shared expert (resident)"),
    ("qwen3_next", ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"), "linear-attention hybrid; shared expert resident"),
    ("deepseek", ("deepseek", "deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2"),
     "first dense layers stay stock; shared experts resident; grouped top-k router"),
    ("kimi_linear", ("kimi_linear",), "deepseek-style MoE behind linear attention"),
    ("glm4_moe", ("glm4_moe", "glm4_moe_lite"), "deepseek-style router with correction bias"),
    ("gpt_oss", ("gpt_oss",), "SwitchGLU with expert biases, mxfp4 experts"),
    ("mixtral", ("mixtral", "phimoe"), "SwitchGLU at block_sparse_moe.switch_mlp"),
    ("olmoe", ("olmoe", "granitemoe", "granitemoehybrid"), "SwitchGLU, softmax router"),
    ("nemotron_h", ("nemotron_h",), "SwitchMLP with relu2; mamba / attention hybrid"),
    ("minimax", ("minimax",), "SwitchGLU at block_sparse_moe.switch_mlp, sigmoid router"),
    ("laguna", ("laguna",), "SwitchGLU experts (synthetic checkpoints of the project)"),
    ("other_moe", ("afmoe", "bailing_moe", "bailing_moe_linear", "dots1", "ernie4_5_moe", "exaone_moe",
                   "hunyuan", "jamba", "lfm2_moe", "llama4", "llama4_text", "longcat_flash",
                   "mimo_v2_flash", "step3p5", "Klear"),
     "SwitchGLU / SwitchMLP experts found by type; lookahead off where the router is not a plain gate"),
    ("moe_2026", ("deepseek_v41", "kimi_k3", "mistral4", "gemma4_text", "minimax_m3_vl", "muse_spark",
                  "bailing_moe_v3", "bailing_hybrid", "mellum", "phixtral"),
     "mlx-lm 0.32 families (gemma4_text and phixtral also 0.31); SwitchGLU experts found by type; "
     "lookahead off where the experts run at a latent width (kimi_k3, muse_spark)"),
)

BUILTIN_SPECS = tuple(ArchitectureSpec(name=name, model_types=types, notes=notes) for name, types, notes in FAMILIES)


@hookimpl
def register_architectures(register):
    for spec in BUILTIN_SPECS:
        register(spec)
