# plan's predicted decode range against bench's measured decode, on two synthetic checkpoints,
# on one machine, at a quarter of the experts. Usage: bash tests/gpu/plan_vs_bench.sh OUTDIR, on
# the CPU (ES=".venv/bin/expert-stream") or on the device after .gpu-b/activate.sh and setup.sh.
set -u
OUT=${1:-/tmp/plan_vs_bench}
mkdir -p "$OUT"
ES=${ES:-python3 -m expert_stream.plugin.cli}
$ES synth --arch qwen3_moe --out "$OUT/a" --layers 8 --experts 32 --top-k 4 --hidden 512 --moe-hidden 512 \
    --dtype float32 --bits 4 > /dev/null 2>&1
$ES synth --arch mixtral --out "$OUT/b" --layers 6 --experts 16 --top-k 2 --hidden 512 --moe-hidden 1024 \
    --dtype float32 --bits 4 > /dev/null 2>&1
for m in a b; do
    $ES plan "$OUT/$m" --json > "$OUT/plan-$m.json" 2> "$OUT/plan-$m.err"
    slots=$([ $m = a ] && echo 8 || echo 4)
    budget=$(python3 -c "import json; print(next(b['budget_gib'] for b in json.load(open('$OUT/plan-$m.json'))['budgets'] if b['slots_per_layer'] == $slots))")
    $ES bench "$OUT/$m" --budget-gib "$budget" --prompt-tokens 128 --gen-tokens 64 --stock no --disk-gb 0.2 --json \
        > "$OUT/bench-$m.json" 2> "$OUT/bench-$m.err"
    python3 - "$OUT" $m $slots <<'PY'
import json, sys
out, m, slots = sys.argv[1], sys.argv[2], int(sys.argv[3])
plan = json.load(open(f"{out}/plan-{m}.json"))
bench = json.load(open(f"{out}/bench-{m}.json"))
bench = bench[0] if isinstance(bench, list) else bench
row = next(b for b in plan["budgets"] if b["slots_per_layer"] == slots)
print(f"{m}: {slots} slots/layer: plan {row['tok_s'][0]}-{row['tok_s'][1]} tok/s (compute {plan['t_compute_ms']} ms, "
      f"disk {plan['disk_gbps']} GB/s); bench {bench['decode_tok_s']:.2f} tok/s (miss rate {bench['miss_rate']:.3f}, "
      f"t_compute {bench['t_compute_s'] * 1e3:.1f} ms)")
PY
done
