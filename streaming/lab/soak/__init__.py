"""A seeded chaos soak of a host started through `expert-stream` on 127.0.0.1: clients send
streamed and plain requests to two streamed models and a dense one while faults land at random
times; every answer is compared with stock mlx-lm's greedy answer, or must be an error that
names the model and says why. `expert-stream soak` runs it; `run_soak` is the same in Python.

Rooms: models (checkpoints and stock answers), host_process (config files and the server
process), client (one request and its verdict), faults (what is injected), tally (counts,
resources, the printed summary), driver (the run)."""

from .driver import SoakPlan, run_soak

__all__ = ["SoakPlan", "run_soak"]
