"""mlx_lm.server's pipeline mode with expert streaming (`mlx.launch ... expert-stream mlx-lm-server
--config X -- --pipeline`): one process per rank, each keeping its own layers' trunk and
streaming its own layers' experts.

mlx_lm.server loads through `mlx_lm.utils.sharded_load` (imported into its own namespace), which
builds the model lazily, lets `model.model.pipeline(group)` pick the rank's layers and then
evaluates. For a streamed folder the plugin replaces that whole call by the engine's pipeline
load (`load_streamed(..., pipeline_group=group)`: the one load path's steps, with the expert blocks swapped
after `pipeline()` and before any evaluation, and only this rank's shards indexed). Any other
folder (dense, not in the config) runs the stock function untouched.

Between two requests every rank passes `ResponseGenerator._next_request` together (it shares
the next request through mlx.distributed): there the ranks gather their counters (rank_stats)
and decide reloads (pipeline_reload)."""

from __future__ import annotations

import logging
from pathlib import Path

from expert_stream.plugin.hosts import interception
from expert_stream.plugin.hosts.mlx_lm import compat
from expert_stream.plugin.hosts.mlx_lm.rank_stats import RankStats

log = logging.getLogger("expert_stream")

class PipelineMode:
    """This process is one rank of mlx_lm.server's pipeline (chosen once, at start)."""

    def __init__(self, group):
        self.group = group
        self.rank = group.rank()
        self.ranks = RankStats(group)
        self.reloads = None  # pipeline_reload.RankReload, once installed

    @classmethod
    def detect(cls, host_args: list[str]) -> "PipelineMode | None":
        """A pipeline when mlx_lm.server gets --pipeline and mlx.launch started more than one rank
        (mlx_lm.server's own rule: a group of one loads as a single process)."""
        if "--pipeline" not in host_args:
            return None
        import mlx.core as mx

        group = mx.distributed.init()
        return cls(group) if group.size() > 1 else None

    def install(self, internals, state) -> None:
        """Patch sharded_load (both names), the first load and the loop's request sharing."""
        from expert_stream.plugin.hosts.base import refuse
        from expert_stream.plugin.hosts.mlx_lm.pipeline_reload import RankReload

        refuse("mlx_lm.server (mlx-lm) pipeline mode", internals.version, compat.pipeline_problems(internals.server))
        compat.replace_sharded_load(internals, _streaming_sharded_load)
        self.reloads = RankReload(self.group, state)

        def first_load_failed(exc):
            # Agreed by all ranks; each request loads again and gets the error, instead of the
            # generation loop of every rank ending.
            log.error("expert-stream: rank %d: loading the default model failed: %s", self.rank, exc)

        def between_requests(model):  # every rank passes here together
            found = [(m, h) for m, h in interception.handles().items() if h.model is model]
            asked = self.ranks.exchange(model, found[0][1] if found else None, found[0][0] if found else None,
                                        self.reloads.wanted)
            if asked:  # some rank asked for a reload: all decide it here, together
                self.reloads.step()

        compat.hook_request_loop(internals, first_load_failed, between_requests)

    def status(self) -> dict:
        return self.ranks.status()


def refuse_tensor_parallel(internals) -> None:
    """Several ranks without --pipeline (mlx_lm.server's tensor parallelism): a streamed entry's
    load is refused (each rank would stream every layer, then `shard()` would split the slots);
    dense entries load through the stock sharded_load."""
    import mlx.core as mx

    if mx.distributed.init().size() > 1:
        compat.replace_sharded_load(internals, _streaming_sharded_load)


def _streaming_sharded_load(original):
    def sharded_load(repo, pipeline_group=None, tensor_group=None, return_config=False, **kwargs):
        target = interception.target_for(repo)
        if target is None:
            return original(repo, pipeline_group, tensor_group, return_config, **kwargs)
        return _load_rank(Path(repo), target, pipeline_group, tensor_group, return_config, **kwargs)

    return sharded_load


def _load_rank(path: Path, target, pipeline_group, tensor_group, return_config, *, tokenizer_config=None,
               trust_remote_code=False, **_):
    from mlx_lm.utils import load_tokenizer

    from expert_stream.plugin import plugins
    from expert_stream.plugin.hosts.base import HostError
    from expert_stream.streaming.loader import load_streamed
    from expert_stream.streaming.settings import StreamSettings

    if pipeline_group is None or tensor_group is not None:
        raise HostError(f"{target.model_id}: a streamed model runs only in mlx_lm.server's pipeline mode "
                        "(each rank its own layers); start every rank with --pipeline")
    settings = StreamSettings.from_mapping(target.settings, where=f"{target.model_id}.expert_stream")
    with interception.stock_loads():  # the engine builds the model with the stock load_model
        model, config, handle = load_streamed(
            path, settings, hooks=plugins.load_hooks(), pipeline_group=pipeline_group,
            trust_remote_code=trust_remote_code or target.trust_remote_code, memory=target.memory,
            where=f"{target.model_id}.expert_stream")
    tokenizer = load_tokenizer(path, tokenizer_config or {"trust_remote_code": True},  # as sharded_load
                               eos_token_ids=config.get("eos_token_id"))
    interception.adopt(target, model, path, handle, handle.settings)
    log.info("expert-stream: rank %d streams layers %s-%s of %s", pipeline_group.rank(), model.model.start_idx,
             model.model.end_idx - 1, target.model_id)
    return (model, tokenizer, config) if return_config else (model, tokenizer)
