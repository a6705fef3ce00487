"""One rank of a pipeline run (started by mlx.launch from tests/hosts/test_pipeline.py): load the model
streamed with this rank's layers, prefill and decode greedily, save the logits (rank 0)."""

import json
import sys

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

import expert_stream
from expert_stream.streaming.errors import ExpertStreamError


def main(args):
    group = mx.distributed.init(backend="ring")
    path = args["path"].format(rank=group.rank())
    try:
        model, _, handle = expert_stream.load(path, pipeline_group=group, **args["settings"])
    except ExpertStreamError as exc:
        print(f"rank {group.rank()} refused: {exc}", flush=True)
        sys.exit(3)
    prompt = mx.array(np.array(args["prompt"], dtype=np.int32)[None])
    cache = make_prompt_cache(model)
    logits = []
    step = args["chunk"]
    for start in range(0, prompt.shape[1], step):
        out = model(prompt[:, start:start + step], cache=cache)
        mx.eval(out)
        logits.append(np.array(out).reshape(-1))
    token = mx.argmax(out[:, -1:], axis=-1)
    for _ in range(args["decode_steps"]):
        out = model(token, cache=cache)
        mx.eval(out)
        logits.append(np.array(out).reshape(-1))
        token = mx.argmax(out[:, -1:], axis=-1)
    np.save(args["out"].format(rank=group.rank()), np.concatenate(logits))
    stats = handle.stats()
    print(json.dumps({"rank": group.rank(), "streamed": [s.name for s in handle.streams],
                      "misses": stats["totals"]["misses"], "decode_path": stats["decode_path"]}), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
