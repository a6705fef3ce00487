"""mlx-expert-stream: run MoE models larger than memory by streaming routed experts from SSD.

    model, tokenizer, handle = expert_stream.load(path, budget_gib=12)

`load` goes through the plugin manager (architectures, readers registered by plugins) and then
the engine in `expert_stream.streaming`. `hookimpl` is the marker third-party plugins use.
"""

from expert_stream.plugin.hookspecs import hookimpl
from expert_stream.plugin.api import load

__all__ = ["hookimpl", "load"]
__version__ = "0.1.0"
