"""Decode speed, counted where it costs nothing: the first streamed layer of a model is called once
per forward pass, so the time from one single-token call of it to the next is one decode step
(every layer, sampling, and the host's own work between tokens, which is what a user waits for).
A host could count tokens too, but each host shapes its answers differently (chunks, usage
fields, pipeline ranks); the engine sees the same thing under every host and on every rank.

A call with more than one token (a prefill chunk, a batch) ends the run: the next single-token
call starts a new one, so the time spent in prefill is never counted as decode time. So does the
start of a generation, where the caller knows it (`new_run`: a prompt answered from the prompt
cache can begin with a single-token call after the server sat idle), and, for callers that do
not say, a gap longer than GAP_S.

Speculative decoding (a draft model) never calls the main model with one token: each verify
pass checks several and yields one to all of them. While such a generation runs, its loop counts
the tokens it yields instead (`counting_yields`, `generated`), and forward passes are ignored.

The same calls count the prompt tokens prefilled: the tokens of every forward pass of more than
one token (a prompt chunk: hosts run a streamed model one sequence at a time; what a host's
prompt cache held never gets here). A generation's last prompt token is its first decode step,
and so is a final chunk of one token; a speculative generation's loop says how many it prefills
(`prefilled`), since its verify passes look the same."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Optional

# No decode step of a served model takes a minute; a longer gap is the server idling.
GAP_S = 60.0


class DecodeClock:
    """Decode tokens, the seconds they took and the bytes read meanwhile, since load (or
    `reset`). Ticked on the compute thread; others read the three totals."""

    def __init__(self, bytes_read: Callable[[], int]):
        self._bytes_read = bytes_read  # the model's expert bytes read so far
        self._last: Optional[tuple[float, int]] = None  # (time, bytes) of the previous decode call
        self.tokens = 0
        self.seconds = 0.0
        self.bytes_read = 0
        self.prompt_tokens = 0  # prompt tokens prefilled
        self._by_yields = False  # a speculative generation counts its yielded tokens

    def tick(self, tokens: int) -> None:
        """A forward pass reached the first streamed layer with `tokens` tokens."""
        if self._by_yields:
            return
        if tokens != 1:
            self.prefilled(tokens)
            return
        self._step()

    def prefilled(self, tokens: int) -> None:
        """`tokens` prompt tokens went through the model at once (a prefill ends a decode run)."""
        self.prompt_tokens += tokens
        self._last = None

    def generated(self) -> None:
        """A speculative generation yielded a token (inside `counting_yields`)."""
        self._step()

    @contextmanager
    def counting_yields(self):
        """A generation whose loop calls `generated` per token; its forward passes do not count."""
        self._by_yields, self._last = True, None
        try:
            yield
        finally:
            self._by_yields, self._last = False, None

    def _step(self) -> None:
        now, read = time.perf_counter(), self._bytes_read()
        if self._last is not None and now - self._last[0] <= GAP_S:
            self.tokens += 1
            self.seconds += now - self._last[0]
            self.bytes_read += read - self._last[1]
        self._last = (now, read)

    def new_run(self) -> None:
        """A generation starts: the time since the previous call was not a decode step (and a
        speculative generation left unfinished, never closed, counts no more)."""
        self._last, self._by_yields = None, False

    def reset(self) -> None:
        self._last = None
        self.tokens, self.seconds, self.bytes_read, self.prompt_tokens = 0, 0.0, 0, 0

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "seconds": self.seconds, "bytes_read": self.bytes_read}
