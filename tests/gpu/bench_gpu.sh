# Usage (device): bash tests/gpu/bench_gpu.sh OUTDIR   (env RUNS: which of quarter quarter-layered
# quarter-lookahead quarter-cuda quarter-cuda-layered quarter-everyN full;
# PROF=1 first profiles speculative decode with prof_steps.py)
set -u
OUT=$1; CK=/tmp/q30-48; ES="python3 -m expert_stream.plugin.cli"; t0=$(date +%s)
[ -f $CK/synth.json ] || $ES synth --arch qwen3_moe --out $CK --layers 48 --experts 128 --top-k 8 \
   --hidden 2048 --moe-hidden 768 --bits 4 --dtype bfloat16 2>&1 | tail -1
set -- $(python3 -c "from expert_stream.streaming.footprint import checkpoint_footprint as f; x=f('$CK'); print(round(x.budget_gib_for_slots(32)+0.001,3), round(x.budget_gib_for_slots(128)+0.001,3))")
QUARTER=$1; FULL=$2; echo "quarter $QUARTER GiB, full $FULL GiB"
run() { name=$1; shift
  $ES bench $CK --prompt-tokens ${P:-512} --gen-tokens ${G:-64} --disk-gb ${DISKGB:-2} "$@" --json > $OUT/$name.json 2> $OUT/$name.log
  echo "$name rc=$? t=$(( $(date +%s) - t0 ))s"
  python3 -c "import json;r=json.load(open('$OUT/$name.json'));print({k:(round(v,4) if isinstance(v,float) else v) for k,v in r.items() if k in ('decode_tok_s','prefill_tok_s','bound_tok_s','ratio_to_bound','stock_tok_s','ratio_to_stock','miss_rate','disk_gbps','t_compute_s','t_disk_s','bytes_per_token','speculation','token_agreement_with_stock','decode_misses_per_layer')})" 2>&1 | tail -1; }
if [ -n "${PROF:-}" ]; then python3 tests/gpu/prof_steps.py $CK $QUARTER > $OUT/prof_steps.txt 2>&1; echo "prof t=$(( $(date +%s) - t0 ))s"; fi
for R in ${RUNS:-quarter quarter-layered full}; do case $R in
  quarter) run quarter --budget-gib $QUARTER --stock yes;;
  quarter-layered) run quarter-layered --budget-gib $QUARTER --stock no --set speculate=false;;
  quarter-lookahead) run quarter-lookahead --budget-gib $QUARTER --stock no --set speculate=false --set prefetch=true;;
  quarter-cuda) run quarter-cuda --budget-gib $QUARTER --stock yes --set slot_write=cuda;;
  quarter-cuda-layered) run quarter-cuda-layered --budget-gib $QUARTER --stock no --set slot_write=cuda --set speculate=false;;
  quarter-every*) run $R --budget-gib $QUARTER --stock no --set speculate_check_every=${R#quarter-every};;
  full) run full --budget-gib $FULL --stock yes;;
esac; done
