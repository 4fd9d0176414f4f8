#!/usr/bin/env bash
# Issue 30 done-when 2 on one H200: en->de alone, de->en alone and the tagged shared model,
# seeds 1 and 2, all six at once (one Ray instance each, 2 CPUs a worker), the CPU recipe's
# global batch (1 GPU worker x 4096 tokens x update_freq 2 = 8192 tokens, lr 5e-3, warmup 500).
set -u
t0=$(date +%s)
mkdir -p /tmp/site && tar xJf .gpu/site.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION=0.04
nvidia-smi -L > $OUT/info.txt; nproc >> $OUT/info.txt; python3 -c "import torch, ray; print(torch.__version__, ray.__version__)" >> $OUT/info.txt 2>&1
M=$PWD/.gpu/multi30k; W=/tmp/w; mkdir -p $W/logs
common="--config recipes/multi30k-cpu.toml ${GPUFLAG---gpu} --num-workers 1 --set optim.update_freq=2 --set train.max_steps=${STEPS:-3800} --set train.cpus_per_worker=${CPW:-2} --set train.max_minutes=${MIN:-5.5} --storage-path $W/runs"
one="--train $M/train --valid $M/val --test $M/test_2016_flickr"
both="--train en-de:$M/train --train de-en:$M/train --valid en-de:$M/val --valid de-en:$M/val --test en-de:$M/test_2016_flickr --test de-en:$M/test_2016_flickr"
pids=""
for s in ${SEEDS:-1 2}; do
  timeout ${RUN_S:-470} python3 -m raymt.train $common --set train.seed=$s --name ende-s$s $one > $W/logs/ende-s$s.log 2>&1 & pids="$pids $!"
  timeout ${RUN_S:-470} python3 -m raymt.train $common --set train.seed=$s --name deen-s$s --src-lang de --tgt-lang en $one > $W/logs/deen-s$s.log 2>&1 & pids="$pids $!"
  timeout ${RUN_S:-470} python3 -m raymt.train $common --set train.seed=$s --name both-s$s $both > $W/logs/both-s$s.log 2>&1 & pids="$pids $!"
done
(while sleep 20; do echo "$(( $(date +%s) - t0 ))s $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader) load $(cut -d' ' -f1 /proc/loadavg)"; done) > $W/logs/gpu-util.log 2>&1 &
mon=$!
for p in $pids; do wait $p; echo "pid $p rc $?" >> $W/logs/rc.txt; done
kill $mon
for f in $W/logs/*-s*.log; do echo "== $f"; grep -E "^test|wall time|Error|error" $f | head -8; done > $OUT/summary.txt
for r in $W/runs/*/; do [ -d "$r" ] || continue; n=$(basename $r); mkdir -p $W/logs/$n; cp $r/logs/metrics.csv $W/logs/$n/ 2>/dev/null; cp $r/*.json $W/logs/$n/ 2>/dev/null; done
tar czf $OUT/m30k.tgz -C $W logs
echo "total $(( $(date +%s) - t0 ))s" >> $OUT/summary.txt
cat $OUT/summary.txt
