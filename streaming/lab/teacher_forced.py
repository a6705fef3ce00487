"""Teacher-forced decode over a text file (benchmark lab code).

The file's first tokens are the prompt, prefilled as mlx-lm prefills; each following token of
the file is then fed as the next decode token, whatever the model would have generated, so the
model's own router decides the experts on real text. It runs through mlx-lm's own generation
loop (`generate_step`): a sampler that returns the file's next token and a logits processor
that keeps each step's logits, whose bytes are hashed for a bitwise comparison with another run
(stock mlx-lm) on the same tokens.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import ExpertStreamError


class CorpusError(ExpertStreamError):
    """A corpus file that cannot be read, or is too short for the tokens asked."""


def corpus_tokens(path, tokenizer, prompt_tokens: int, gen_tokens: int) -> np.ndarray:
    """The first prompt_tokens + gen_tokens tokens of the file, by the model's tokenizer."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CorpusError(f"--corpus {path}: cannot read it as UTF-8 text ({exc})") from None
    ids = tokenizer.encode(text)
    need = prompt_tokens + gen_tokens
    if len(ids) < need:
        raise CorpusError(
            f"--corpus {path}: {len(ids)} tokens with the model's tokenizer, but --prompt-tokens "
            f"{prompt_tokens} + --gen-tokens {gen_tokens} need {need}: use a longer file or fewer tokens"
        )
    return np.asarray(ids[:need], dtype=np.int32)


def check_corpora(model_dir: Path, files: list[Path], prompt_tokens: int, gen_tokens: int) -> None:
    """Every file readable and long enough, by the model's tokenizer (before any run starts)."""
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(Path(model_dir))
    for path in files:
        corpus_tokens(path, tokenizer, prompt_tokens, gen_tokens)


def logits_digest(logits: mx.array) -> str:
    """A hash of the logits' bytes: equal digests are equal bits."""
    raw = logits.view(mx.uint16) if logits.dtype == mx.bfloat16 else logits  # numpy has no bfloat16
    return hashlib.blake2b(np.ascontiguousarray(np.array(raw)).tobytes(), digest_size=16).hexdigest()


class _Forcing:
    """generate_step's sampler and logits processor for one teacher-forced run."""

    def __init__(self, fed: np.ndarray):
        self.fed = fed  # the tokens after the prompt, in order
        self.calls = 0
        self.logits: list = []

    def sample(self, logprobs: mx.array) -> mx.array:
        # Call j comes with the logits after the j-th fed token (j = 0: the prompt's last);
        # its answer is fed next. The loop builds one step past the last it yields: any token.
        token = self.fed[min(self.calls, self.fed.size - 1)]
        self.calls += 1
        return mx.array([int(token)], dtype=mx.int32)

    def keep(self, tokens: mx.array, logits: mx.array) -> mx.array:
        self.logits.append(logits)
        return logits

    def digest(self, step: int) -> str:
        logits, self.logits[step] = self.logits[step], None
        return logits_digest(logits)


def teacher_forced_generation(model, tokens: np.ndarray, prompt_tokens: int, prefill_step: int,
                              on_start=None, on_first=None, *, warmup_steps: int) -> dict:
    """Prefill tokens[:prompt_tokens], then feed the rest one decode step each. Like
    bench.timed_generation: a warm-up generation first (a prompt of the same length, the cache
    left as a previous request leaves it), prefill time ends when the first step's logits are
    out, decode rate is over the steps after it. `on_first` runs outside both timings."""
    from mlx_lm.generate import generate_step

    prompt = mx.array(tokens[:prompt_tokens], dtype=mx.int32)
    fed = np.asarray(tokens[prompt_tokens:])
    for _ in generate_step(prompt[::-1], model, max_tokens=warmup_steps, prefill_step_size=prefill_step):
        pass
    if on_start is not None:
        on_start()
    forcing = _Forcing(fed)
    digests = []
    t0 = time.perf_counter()
    t_first = t_decode = None
    steps = generate_step(prompt, model, max_tokens=int(fed.size), sampler=forcing.sample,
                          logits_processors=[forcing.keep], prefill_step_size=prefill_step)
    for n, (token, _) in enumerate(steps):
        if token != int(fed[n]):
            raise RuntimeError(f"teacher forcing fed token {token} at step {n}, not the corpus's {int(fed[n])}")
        digests.append(forcing.digest(n))  # waits for the step, as a sampled token would
        if n == 0:
            t_first = time.perf_counter()
            if on_first is not None:
                on_first()
            t_decode = time.perf_counter()
    t_end = time.perf_counter()
    decode_s = max(t_end - t_decode, 1e-9)
    return {
        "tokens": fed.tolist(),
        "digests": digests,
        "prefill_s": t_first - t0,
        "prefill_tok_s": prompt.size / (t_first - t0),
        "decode_s": decode_s,
        "decode_tok_s": (len(digests) - 1) / decode_s if len(digests) > 1 else 0.0,
    }


def compare_digests(run: list[str], reference: list[str]) -> dict:
    """Steps compared, steps equal and the first differing step (None: all equal)."""
    n = min(len(run), len(reference))
    differ = [i for i in range(n) if run[i] != reference[i]]
    return {"steps_compared": n, "steps_equal": n - len(differ), "first_differing_step": differ[0] if differ else None}
