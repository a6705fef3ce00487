# Usage (device, repo root, after `source .gpu-b/activate.sh; source tests/gpu/setup.sh`):
#   bash tests/gpu/peers_all.sh OUTDIR [LAYERS]
# Same checkpoint and budgets as bench_gpu.sh (quarter = 32 slots/layer, full = 128), then
# bigrig and boyle (each in a fresh process) at each budget. Env: P, G, PEERS, PEER_ARGS, TMO, BUDGETS.
set -u
OUT=$1; LAYERS=${2:-48}
CK=/tmp/q30-$LAYERS
ES="python3 -m expert_stream.plugin.cli"
t0=$(date +%s)
mkdir -p $OUT
[ -f $CK/synth.json ] || $ES synth --arch qwen3_moe --out $CK --layers $LAYERS --experts 128 --top-k 8 \
   --hidden 2048 --moe-hidden 768 --bits 4 --dtype bfloat16 2>&1 | tail -3
echo "synth done in $(( $(date +%s) - t0 )) s"; du -sh $CK
Q=$(python3 -c "from expert_stream.streaming.footprint import checkpoint_footprint as f; x=f('$CK'); print(round(x.budget_gib_for_slots(32)+0.001,3), round(x.budget_gib_for_slots(128)+0.001,3))")
set -- $Q; QUARTER=$1; FULL=$2
echo "budgets: quarter $QUARTER GiB, full $FULL GiB"
for B in ${BUDGETS:-quarter full}; do
  [ $B = quarter ] && GIB=$QUARTER || GIB=$FULL
  python3 tests/gpu/peers_bench.py $CK --budget-gib $GIB --prompt-tokens ${P:-512} --gen-tokens ${G:-64} \
     --peers ${PEERS:-bigrig,boyle} --timeout ${TMO:-240} ${PEER_ARGS:-} --json > $OUT/peers-$B.json 2> $OUT/peers-$B.log
  echo "peers $B rc=$? $(( $(date +%s) - t0 )) s"
  python3 -c "import json;d=json.load(open('$OUT/peers-$B.json'));[print(' ',p,{k:v[k] for k in ('decode_tok_s_median','prefill_s_median','errors')}) for p,v in d['summary'].items()];[print('  ',r['peer'],'decode',r.get('stats_decode',{}).get('hit_rate'),r.get('mapping',{}).get('full_layers'),r.get('error')) for r in d['results']]" 2>&1 | tail -8
done
