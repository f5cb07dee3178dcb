#!/usr/bin/env bash
# The deployment of docs/remote_tier.md, one part per call: a conversation store, a shared KV
# tier, and the engine servers or Ray Serve replicas in front of them. Edit the variables or
# set them in the environment; each part runs in the foreground (run each under your service
# manager, or with & in a shell).
#
#   bash scripts/deploy_shared_kv.sh redis            # the KV tier (host A)
#   bash scripts/deploy_shared_kv.sh servers 2        # N plain servers on this host, no Ray
#   bash scripts/deploy_shared_kv.sh ray-head         # host A: the Ray head
#   bash scripts/deploy_shared_kv.sh ray-worker       # host B: join host A
#   bash scripts/deploy_shared_kv.sh replicas 2       # host A: N replicas behind one endpoint
#
# The store: a SQLite file on one host (STORE=/path/conv.db), a PostgreSQL URL across hosts
# (STORE=postgresql://user:pass@host-a:5432/pensieve; any PostgreSQL 14+ started as usual).
# The KV tier: Redis or Valkey (KV=redis://host-a:6380/0), or a directory on one host
# (KV=file:///var/lib/pensieve/kv).
set -euo pipefail
MODEL=${MODEL:-demo}
HOST_A=${HOST_A:-127.0.0.1}
STORE=${STORE:-/var/lib/pensieve/conversations.db}
REDIS_PORT=${REDIS_PORT:-6380}  # Ray's head takes 6379
REDIS_MAXMEMORY=${REDIS_MAXMEMORY:-64gb}
KV=${KV:-redis://$HOST_A:$REDIS_PORT/0}
PORT=${PORT:-8000}

case ${1:-} in
  redis)  # a memory bound with LRU eviction; nothing saved to disk (the tier is a cache)
    exec redis-server --port "$REDIS_PORT" --maxmemory "$REDIS_MAXMEMORY" \
      --maxmemory-policy allkeys-lru --save '' --bind 0.0.0.0 --protected-mode no ;;
  servers)  # N servers on this host, one GPU each, one store, one KV tier
    for ((i = 0; i < ${2:-2}; i++)); do
      CUDA_VISIBLE_DEVICES=$i pensieve serve "$MODEL" --port $((PORT + i)) \
        --store "$STORE" --kv-remote "$KV" &
    done
    wait ;;
  ray-head)
    exec ray start --head --port 6379 --block ;;
  ray-worker)
    exec ray start --address "$HOST_A:6379" --block ;;
  replicas)  # every replica gets the same --store and --kv-remote
    RAY_ADDRESS=auto exec pensieve serve "$MODEL" --data-parallel-size "${2:-2}" \
      --port "$PORT" --store "$STORE" --kv-remote "$KV" ;;
  *)
    sed -n '2,17p' "$0"
    exit 2 ;;
esac
