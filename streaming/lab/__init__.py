"""The lab: what measures and tests the engine without being part of it. Synthetic checkpoints
(synthetic/), the benchmark and its routing replay (bench.py, replay.py, replay_sim.py), the
memory cap and page-cache control of timed runs, the disk probe and the eviction-policy
simulator. The runtime (the parent package) never imports from here."""
