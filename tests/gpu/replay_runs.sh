# Usage (device, after `source tests/gpu/setup.sh`):
#   bash tests/gpu/replay_runs.sh OUTDIR TRACE.npz NAME "RUNS" [synth flags...]
# Makes a checkpoint shaped like TRACE (synth --like-trace, plus the flags), then runs the replay
# benchmark for each RUN: SHARE-SPEC (share of each layer's experts in the budget, speculate
# true/false), or "full" (every expert, stock side by side). Each streamed run is capped at its
# budget + CAP_EXTRA GiB (cgroup v2; CAP_EXTRA=none: no cap), the page cache dropped before it. One JSON line per run in
# OUTDIR/NAME.jsonl, a summary line each on stdout.
set -u
OUT=$1; TRACE=$2; NAME=$3; RUNS=$4; shift 4
CK=/tmp/ck-$NAME; ES="python3 -m expert_stream.plugin.cli"; t0=$(date +%s)
[ -f $CK/config.json ] || $ES synth --like-trace $TRACE --out $CK "$@" 2>&1 | tail -1
echo "synth $NAME t=$(( $(date +%s) - t0 ))s"
budget() { python3 -c "
from expert_stream.streaming.footprint import checkpoint_footprint as f
x = f('$CK'); e = x.num_experts[0]
print(round(x.budget_gib_for_slots(max(x.top_k, round($1 * e))) + 0.001, 3))"; }
for R in $RUNS; do
  if [ "$R" = full ]; then S=1.0; SPEC=auto; STOCK=yes; else S=${R%-*}; SPEC=${R#*-}; STOCK=no; fi
  B=$(budget $S); CAP=0
  set -- --set speculate=$SPEC; [ "$SPEC" = auto ] && set --
  if [ "${CAP_EXTRA:-4}" != none ]; then CAP=$(python3 -c "print(round($B + ${CAP_EXTRA:-4}, 1))"); set -- "$@" --memory-cap $CAP; fi
  $ES bench $CK --budget-gib $B --routing $TRACE --stock $STOCK "$@" \
     --prompt-tokens ${P:-256} --gen-tokens ${G:-48} --disk-gb ${DISKGB:-1} --json \
     > /tmp/run.json 2> $OUT/$NAME-$R.log
  rc=$?
  python3 - "$NAME" "$R" "$B" "$CAP" "$rc" <<'PY' >> $OUT/$NAME.jsonl
import json, sys
name, run, budget, cap, rc = sys.argv[1:]
try:
    r = json.load(open("/tmp/run.json"))
except Exception as exc:
    r = {"error": f"no report: {exc}"}
r.update(name=name, run=run, budget_gib=float(budget), cap_gib=float(cap), rc=int(rc))
print(json.dumps(r))
PY
  tail -1 $OUT/$NAME.jsonl | python3 -c "
import json, sys; r = json.loads(sys.stdin.read()); ro = r.get('routing') or {}
keys = ('decode_tok_s', 'stock_tok_s', 'ratio_to_stock', 'misses_per_token', 'bytes_per_token', 'read_gbps_run',
        'disk_gbps', 'ratio_to_bound', 'ratio_to_bound_run', 'peak_rss_gb', 'rc', 'error')
print('$NAME', '$R', {k: (round(r[k], 4) if isinstance(r[k], float) else r[k]) for k in keys if k in r},
      'sim', ro.get('sim_misses_per_token'), 'spec', {k: v for k, v in (r.get('speculation') or {}).items() if k in ('steps', 'passes_thrown', 'paused', 'layered')})"
  echo "t=$(( $(date +%s) - t0 ))s"
done
