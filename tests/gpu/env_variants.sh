# Usage (device): bash tests/gpu/env_variants.sh OUTDIR ROUNDS "VARIANT..." "ENV..."
# spec_variants.py (speculation schedules and stock, interleaved) once per MLX environment
# setting, each in its own process: MLX reads its CUDA settings once per process. An ENV entry
# is "default" or NAME=VALUE[,NAME=VALUE].
set -u
OUT=$1; ROUNDS=$2; VARIANTS=$3; ENVS=$4; CK=/tmp/q30-48; ES="python3 -m expert_stream.plugin.cli"; t0=$(date +%s)
[ -f $CK/synth.json ] || $ES synth --arch qwen3_moe --out $CK --layers 48 --experts 128 --top-k 8 \
   --hidden 2048 --moe-hidden 768 --bits 4 --dtype bfloat16 2>&1 | tail -1
Q=$(python3 -c "from expert_stream.streaming.footprint import checkpoint_footprint as f; print(round(f('$CK').budget_gib_for_slots(32)+0.001,3))")
echo "synth t=$(( $(date +%s) - t0 ))s quarter $Q GiB"
for E in $ENVS; do
  SETS=$([ "$E" = default ] || echo "$E" | tr ',' ' ')
  F=$OUT/env-$(echo "$E" | tr -c 'A-Za-z0-9_\n' '-')  # plain file names travel back from $OUT
  env $SETS python3 tests/gpu/spec_variants.py $CK $Q $ROUNDS $VARIANTS > $F.jsonl 2> $F.log
  echo "== $E rc=$? t=$(( $(date +%s) - t0 ))s"
  python3 - $F.jsonl <<'PY'
import json, sys, collections
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
by = collections.defaultdict(list)
for r in rows: by[r["variant"]].append(r["decode_tok_s"])
print({v: (round(sum(x) / len(x), 1), x) for v, x in by.items()})
PY
done
