#!/usr/bin/env bash
# The shared en<->de model's plateau: four variants at once, validation curves only (no test).
set -u
t0=$(date +%s)
mkdir -p /tmp/site && tar xJf .gpu/site.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION=0.04
M=$PWD/.gpu/multi30k; W=/tmp/w; mkdir -p $W/logs
common="--config recipes/multi30k-cpu.toml --gpu --num-workers 1 --set optim.update_freq=2 --set train.max_steps=3800 --set train.cpus_per_worker=2 --set train.max_minutes=${MIN:-4.2} --storage-path $W/runs"
both="--train en-de:$M/train --train de-en:$M/train --valid en-de:$M/val --valid de-en:$M/val"
pids=""
go() { n=$1; shift; timeout ${RUN_S:-300} python3 -m raymt.train $common --name $n $both "$@" > $W/logs/$n.log 2>&1 & pids="$pids $!"; }
go w1000-s1 --set optim.warmup_steps=1000 --set train.seed=1
go w1000-s2 --set optim.warmup_steps=1000 --set train.seed=2
go w500-s2 --set train.seed=2
go prenorm-s1 --set model.pre_norm=true --set train.seed=1
for p in $pids; do wait $p; echo "pid $p rc $?" >> $W/logs/rc.txt; done
for r in $W/runs/*/; do [ -d "$r" ] || continue; n=$(basename $r); mkdir -p $W/logs/$n; cp $r/logs/metrics.csv $W/logs/$n/ 2>/dev/null; done
tar czf $OUT/diag.tgz -C $W logs
for f in $W/logs/*.log; do echo "== $f"; grep -E "valid loss" $f | tail -n 4 | cut -c 30-; done
echo "total $(( $(date +%s) - t0 ))s"
