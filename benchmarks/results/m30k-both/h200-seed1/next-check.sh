#!/usr/bin/env bash
# Issue 45 done-when 2 on one lent GPU (prepared 2026-12-06, not run yet): pre-norm (the cure the
# CPU arms found) on en->de, de->en and the shared en<->de model, seeds 1-3, nine runs at once to
# update 1,000, validation curves only. Three at once kept an H200 at 98% (gpu-util.log), so nine
# take about three times as long an update: ~6 minutes. EXTRA adds settings to every run.
set -u
t0=$(date +%s)
mkdir -p /tmp/site && tar xJf .gpu/site.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION=0.04
M=$PWD/.gpu/multi30k; W=/tmp/w; mkdir -p $W/logs
common="--config recipes/multi30k-cpu.toml --gpu --num-workers 1 --set optim.update_freq=2 --set train.max_steps=1000 --set train.cpus_per_worker=1 --set train.max_minutes=${MIN:-6.5} --set model.pre_norm=true ${EXTRA:-} --storage-path $W/runs"
one="--train $M/train --valid $M/val"
both="--train en-de:$M/train --train de-en:$M/train --valid en-de:$M/val --valid de-en:$M/val"
pids=""
go() { n=$1; shift; timeout ${RUN_S:-450} python3 -m raymt.train $common --name $n "$@" > $W/logs/$n.log 2>&1 & pids="$pids $!"; }
for s in ${SEEDS:-1 2 3}; do
  go ende-s$s --set train.seed=$s $one
  go deen-s$s --set train.seed=$s --src-lang de --tgt-lang en $one
  go both-s$s --set train.seed=$s $both
done
(while sleep 20; do echo "$(( $(date +%s) - t0 ))s $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader) load $(cut -d' ' -f1 /proc/loadavg)"; done) > $W/logs/gpu-util.log 2>&1 &
mon=$!
for p in $pids; do wait $p; echo "pid $p rc $?" >> $W/logs/rc.txt; done
kill $mon
for r in $W/runs/*/; do [ -d "$r" ] || continue; n=$(basename $r); mkdir -p $W/logs/$n; cp $r/logs/metrics.csv $W/logs/$n/ 2>/dev/null; done
tar czf $OUT/seeds.tgz -C $W logs
for f in $W/logs/*-s*.log; do echo "== $f"; grep -E "valid loss" $f | tail -n 4 | cut -c 30-; done
echo "total $(( $(date +%s) - t0 ))s"
