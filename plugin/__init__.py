"""The plugin side of mlx-expert-stream: pluggy hooks, host adapters (mlx-openai-server,
mlx_lm.server), config and hot reload, and the `expert-stream` command."""
