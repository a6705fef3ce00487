"""Human-readable summaries shared by the commands."""

from __future__ import annotations

GB = 1e9


def print_stats(report: dict) -> None:
    """A short cache summary: where the model came from, speed, hit rate, bytes read."""
    stats = report["stats"]
    totals = stats["totals"]
    print(f"model:     {report['model_dir']}")
    budget = stats["budget"]
    print(f"budget:    {budget['budget_gib']} GiB{' (auto)' if budget['auto'] else ''} -> "
          f"{stats['slot_bytes'] / GB:.3f} GB of expert slots "
          f"in {stats['streamed_layers']} streamed layers ({stats['resident_layers']} resident)")
    print(f"prompt:    {report['prompt_tokens']} tokens at {report['prompt_tps']} tok/s")
    print(f"generate:  {report['generation_tokens']} tokens at {report['generation_tps']} tok/s")
    print(f"cache:     hit rate {totals['hit_rate']:.1%} ({totals['hits']} hits, {totals['misses']} misses, "
          f"{totals['evictions']} evictions)")
    print(f"reads:     {totals['bytes_read'] / GB:.3f} GB in {totals['read_seconds']:.2f} s waited "
          f"(reader {stats['reader']}, page cache {stats['cache_bypass']})")
    note = f" ({stats['decode_path_note']})" if stats.get("decode_path_note") else ""
    print(f"decode:    {stats.get('decode_path', 'python')} path{note}, {totals['syncs']} host waits for routing")
