"""The two hosts the project ships adapters for."""

from expert_stream.plugin.hookspecs import hookimpl


@hookimpl
def register_hosts(register):
    from expert_stream.plugin.hosts.mlx_lm.server import MLX_LM_SERVER
    from expert_stream.plugin.hosts.openai.server import MLX_OPENAI_SERVER

    register(MLX_OPENAI_SERVER)
    register(MLX_LM_SERVER)
