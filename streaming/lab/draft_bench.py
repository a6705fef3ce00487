"""Speculative decoding with a draft model, beside single-token decode (benchmark lab code).

A verify pass runs the main model on num_draft + 1 tokens: it reads the union of their experts
once, and yields 1 to num_draft + 1 tokens. Whether that reads fewer bytes per generated token
than single-token decode depends on how many drafts are accepted and on how much the tokens of
one pass share experts. Each run here counts, per forward pass of the main model, the expert
bytes and misses, and reports them per generated token, with the acceptance.

- With a draft model (`run_with_draft`): mlx-lm's own generate_step and speculative_generate_step
  on the same prompt, each on a freshly loaded streamed model (the same cache state after the
  same prefill), greedy. The acceptance is the draft's against this main model. Stock mlx-lm
  runs the same speculative generation when asked, every token and log-probability compared.
- Under a replayed routing trace (`run_replayed`): the routing is the trace's by position, so a
  draft's tokens cannot change it and a draft's agreement cannot be measured; the acceptance is
  given (e.g. measured with a draft on a trained model). Each pass accepts a prefix of its
  drafts, each with that probability, and the KV cache is trimmed past it, as mlx-lm does. The
  rejected drafts of a pass route either as unrelated tokens (rows half a trace away:
  `rejected="unrelated"`, the conservative end) or as the tokens later accepted at their
  positions (`rejected="same"`, the optimistic end).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import ExpertStreamError


class DraftBenchError(ExpertStreamError):
    """A draft run that cannot be made as asked."""


@dataclass
class ForwardCount:
    tokens: int
    bytes_read: int
    misses: int
    hits: int
    seconds: float


class CountedModel:
    """The main model as mlx-lm's generation loops call it, counting each forward pass's expert
    reads (the streamed layers read during the call: each one syncs on its routing)."""

    def __init__(self, model, handle):
        self._model, self._handle = model, handle
        self.forwards: list[ForwardCount] = []

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, inputs, *args, **kwargs):
        before, t0 = self._handle.stats()["totals"], time.perf_counter()
        out = self._model(inputs, *args, **kwargs)
        mx.eval(out)
        after = self._handle.stats()["totals"]
        self.forwards.append(ForwardCount(int(inputs.shape[-1]), after["bytes_read"] - before["bytes_read"],
                                          after["misses"] - before["misses"], after["hits"] - before["hits"],
                                          time.perf_counter() - t0))
        return out


def decode_figures(forwards: list[ForwardCount], prompt_tokens: int, generated: int, drafted: int,
                   accepted: int) -> dict:
    """Figures of the forward passes after the prompt's prefill (the first passes that cover
    its tokens but the last, which both loops feed with the first decode step)."""
    covered, first = 0, 0
    while first < len(forwards) and covered < prompt_tokens - 1:
        covered += forwards[first].tokens
        first += 1
    decode = forwards[first:]
    nbytes = sum(f.bytes_read for f in decode)
    seconds = sum(f.seconds for f in decode)
    return {
        "generated": generated,
        "forwards": len(decode),
        "tokens_per_forward": generated / len(decode) if decode else None,
        "bytes_per_token": nbytes / generated if generated else None,
        "misses_per_token": sum(f.misses for f in decode) / generated if generated else None,
        # distinct experts each pass looked up (once for all its tokens), per generated token
        "experts_looked_up_per_token": sum(f.misses + f.hits for f in decode) / generated if generated else None,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": accepted / drafted if drafted else None,
        "decode_s": seconds,
        "tok_s": generated / seconds if seconds else None,
    }


@dataclass
class DraftRun:
    model_dir: Path
    budget_gib: float | str
    prompt: np.ndarray  # token ids
    gen_tokens: int
    num_draft: list[int]  # 0: single-token decode (generate_step)
    settings: dict = field(default_factory=dict)
    prefill_step: int = 512


def _generate(model, draft, prompt: mx.array, run: DraftRun, k: int):
    from mlx_lm.generate import generate_step, speculative_generate_step

    if k == 0:
        return [(int(t), lp, False) for t, lp in
                generate_step(prompt, model, max_tokens=run.gen_tokens, prefill_step_size=run.prefill_step)]
    return [(int(t), lp, bool(d)) for t, lp, d in
            speculative_generate_step(prompt, model, draft, num_draft_tokens=k, max_tokens=run.gen_tokens,
                                      prefill_step_size=run.prefill_step)]


def run_with_draft(run: DraftRun, draft_dir: Path, stock: bool = False) -> dict:
    """Each of run.num_draft on a fresh streamed model; with `stock`, stock mlx-lm's speculative
    generation with the same draft compared token by token, bitwise."""
    import expert_stream.streaming.loader as loader
    from mlx_lm.utils import load_model

    draft, _ = load_model(Path(draft_dir))
    prompt = mx.array(run.prompt, dtype=mx.int32)
    rows, outputs = [], {}
    for k in run.num_draft:
        model, _, handle = loader.load(run.model_dir, budget_gib=run.budget_gib, **run.settings)
        counted = CountedModel(model, handle)
        out = _generate(counted, draft, prompt, run, k)
        figures = decode_figures(counted.forwards, prompt.size, len(out), 0, 0)
        if k == 0:  # generate_step computes one token past the last it yields: count what it computed
            figures = decode_figures(counted.forwards, prompt.size, figures["forwards"], 0, 0)
        if k:  # the drafts each verify pass checked, and those accepted
            decode = counted.forwards[len(counted.forwards) - figures["forwards"]:]
            drafted = sum(f.tokens - 1 for f in decode)
            figures.update(drafted=drafted, accepted=sum(d for _, _, d in out),
                           acceptance=sum(d for _, _, d in out) / drafted if drafted else None)
        figures["num_draft"] = k
        outputs[k] = out
        rows.append(figures)
        handle.close()
    tokens = {k: [t for t, _, _ in out] for k, out in outputs.items()}
    base = tokens.get(0)
    for row in rows:
        row["same_tokens_as_single"] = None if base is None else tokens[row["num_draft"]] == base
    if stock:
        stock_model, _ = load_model(Path(run.model_dir))
        for row in rows:
            ref = _generate(stock_model, draft, prompt, run, row["num_draft"])
            mine = outputs[row["num_draft"]]
            row["bitwise_equal_to_stock"] = len(ref) == len(mine) and all(
                a[0] == b[0] and a[2] == b[2] and mx.array_equal(a[1], b[1]).item() for a, b in zip(ref, mine))
    return {"workload": "draft model", "draft_model": str(draft_dir), "runs": rows}


def accepted_prefix(rng: np.random.Generator, drafts: int, acceptance: float) -> int:
    """Drafts accepted in one pass: each in turn with probability `acceptance`, up to the first
    rejection."""
    n = 0
    while n < drafts and rng.random() < acceptance:
        n += 1
    return n


def run_replayed(run: DraftRun, trace_path: Path, start_row: int, acceptance: float, rejected: str = "unrelated",
                 seed: int = 0) -> dict:
    """Each of run.num_draft on a fresh streamed model whose MoE layers route as the trace says
    by token position (replay.py), the acceptance given."""
    import expert_stream.streaming.loader as loader
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from ..footprint import checkpoint_footprint
    from ..traces import load_trace
    from .replay import install

    if not 0.0 <= acceptance <= 1.0:
        raise DraftBenchError(f"--acceptance {acceptance}: a probability, 0 to 1")
    if rejected not in ("unrelated", "same"):
        raise DraftBenchError(f"rejected={rejected!r}: unrelated or same")
    fp = checkpoint_footprint(run.model_dir)
    trace = load_trace(Path(trace_path))
    rows_total = trace.num_tokens
    prompt = mx.array(run.prompt, dtype=mx.int32)
    out = []
    for k in run.num_draft:
        model, _, handle = loader.load(run.model_dir, budget_gib=run.budget_gib, **run.settings)
        replay = install(model, trace, fp.model_type, fp.num_experts[0], fp.top_k, where=str(run.model_dir))
        counted = CountedModel(model, handle)
        cache = make_prompt_cache(model)
        rng = np.random.default_rng(seed)
        position = 0
        for s in range(0, prompt.size - 1, run.prefill_step):  # the prompt but its last token, as mlx-lm
            chunk = prompt[s:min(s + run.prefill_step, prompt.size - 1)]
            replay.begin(start_row + position)
            counted(chunk[None], cache=cache)
            position += chunk.size
        generated = drafted = accepted = 0
        while generated < run.gen_tokens:
            drafts = min(k, run.gen_tokens - generated)
            n = accepted_prefix(rng, drafts, acceptance)
            rows = start_row + position + np.arange(drafts + 1)
            if rejected == "unrelated":
                rows[n + 1:] += rows_total // 2
            replay.begin_rows(rows % rows_total)
            counted(mx.repeat(prompt[-1:], drafts + 1)[None], cache=cache)  # the tokens do not matter: the routing is replayed
            trim_prompt_cache(cache, drafts - n)
            generated += n + 1
            position += n + 1
            drafted += drafts
            accepted += n
        figures = decode_figures(counted.forwards, prompt.size, generated, drafted, accepted)
        figures["num_draft"] = k
        out.append(figures)
        handle.close()
    return {"workload": f"replay of {trace.name} from row {start_row}", "acceptance_given": acceptance,
            "rejected_routing": rejected, "runs": out}
