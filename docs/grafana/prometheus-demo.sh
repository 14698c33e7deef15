#!/usr/bin/env bash
# A real Prometheus (Debian's `prometheus` package) scraping a real `listen` that follows the
# simulated engines of a replay, and the replay's own head: then every query of the dashboard
# (superfluid-warm.json) evaluated by that Prometheus, as Grafana would ask it.
#
#   apt-get install prometheus && cargo build --release && docs/grafana/prometheus-demo.sh [REPLAY ARGS]
#
# Default replay: the whole Mooncake trace over 8 engines. Prints each panel's queries with what
# Prometheus answered at the end of the run, and the replay's report.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ $# -gt 0 ] || set -- --trace traces/mooncake-conversation.jsonl
bin=target/release/superfluid-warm
replay=target/release/replay
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT
nodes=8
engine_port=${ENGINE_PORT:-17600}
listen_metrics=127.0.0.1:${LISTEN_METRICS_PORT:-19464}
replay_metrics=127.0.0.1:${REPLAY_METRICS_PORT:-19465}
prometheus_addr=127.0.0.1:${PROMETHEUS_PORT:-19090}
nats_port=${NATS_PORT:-14222}

cat >"$work/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
scrape_configs:
  - job_name: listen
    static_configs: [{targets: ['$listen_metrics']}]
  - job_name: replay
    static_configs: [{targets: ['$replay_metrics']}]
EOF
prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
  --web.listen-address="$prometheus_addr" >"$work/prometheus.log" 2>&1 &

# With a NATS server, `listen` is also a sharing head (a bridge: it publishes the engines'
# batches to the stream and applies the stream), so the sharing panels have data too.
share=()
nats=$(command -v nats-server || ls /usr/sbin/nats-server 2>/dev/null || true)
if [ -n "$nats" ]; then
  "$nats" -js -a 127.0.0.1 -p "$nats_port" -sd "$work/js" >"$work/nats.log" 2>&1 &
  share=(--nats "nats://127.0.0.1:$nats_port" --stream demo --head listen)
  sleep 0.5
fi
specs=()
for ((i = 0; i < nodes; i++)); do
  p=$((engine_port + 2 * i))
  specs+=(--engine "node-$i=tcp://127.0.0.1:$p,replay=tcp://127.0.0.1:$((p + 1))")
done
# `listen` first: it connects to the engines before they bind (ZMQ retries). A subscriber
# still joins a few batches in (ZMQ's slow joiner): it replays them from the engine.
"$bin" listen "$work/listen.redb" "${specs[@]}" --model mooncake-conversation --status-every 0 \
  --metrics "$listen_metrics" "${share[@]}" >"$work/listen.out" 2>"$work/listen.log" &
listen_pid=$!
sleep 1
started=$(date +%s)
"$replay" --nodes $nodes --engine-events --engine-port "$engine_port" --metrics "$replay_metrics" \
  --no-back-to-back "$@" >"$work/replay.out" 2>"$work/replay.log" &
replay_pid=$!
# A scrape of listen while the replay runs, linted by Prometheus' own promtool.
sleep 20
curl -sf "http://$listen_metrics/metrics" >"$work/listen.prom"
echo "== promtool check metrics (listen's exposition, mid-replay):"
promtool check metrics <"$work/listen.prom" && echo "   no problems"
wait $replay_pid || { echo "the replay failed:"; cat "$work/replay.log" "$work/replay.out"; exit 1; }
# The queries are evaluated as of the replay's last second: its head's series end with it.
ended=$(($(date +%s) - 1))
sleep 3 # the last scrapes

query() { # an instant query; prints each series as labels=value
  curl -sfG "http://$prometheus_addr/api/v1/query" --data-urlencode "query=$1" --data-urlencode "time=$ended" |
    python3 -c 'import json,sys
r=json.load(sys.stdin)["data"]["result"]
def fmt(v):
    x=float(v)
    return "%.4g"%x
print("; ".join("%s=%s"%(",".join("%s:%s"%kv for kv in sorted(s["metric"].items()) if kv[0] != "__name__") or "-", fmt(s["value"][1])) for s in r[:8]) or "(no data)")'
}
# The rate window covers the whole run, as Grafana's $__rate_interval would a zoomed-out panel.
window="$((ended - started))s"
echo "== the dashboard's queries as of the replay's last second (window $window; instance $listen_metrics is listen, $replay_metrics the replay's head):"
python3 - docs/grafana/superfluid-warm.json "$window" <<'EOF' >"$work/queries.tsv"
import json, sys
d = json.load(open(sys.argv[1]))
for p in d["panels"]:
    for t in p["targets"]:
        print(p["title"] + "\t" + t["expr"].replace("$__rate_interval", sys.argv[2]))
EOF
while IFS=$'\t' read -r title expr; do
  printf '%s | %s\n    %s\n' "$title" "$expr" "$(query "$expr")"
done <"$work/queries.tsv"
echo "== peaks over the run:"
for expr in "max_over_time(superfluid_warm_queue_blocks{job=\"listen\"}[$window])" \
  "max_over_time(superfluid_warm_uncommitted_bytes{job=\"listen\"}[$window])" \
  "histogram_quantile(0.99, sum by (le) (rate(superfluid_warm_engine_lag_seconds_bucket{job=\"listen\"}[$window])))" \
  "histogram_quantile(0.99, sum by (le) (rate(superfluid_warm_commit_duration_seconds_bucket{job=\"listen\"}[$window])))" \
  "sum(superfluid_warm_engine_batches_total{job=\"listen\"})" "sum(superfluid_warm_engine_batches_total{job=\"replay\"})" \
  "superfluid_warm_requests_total{job=\"replay\"}" "superfluid_warm_warm_tokens_total{job=\"replay\"} / superfluid_warm_request_tokens_total{job=\"replay\"}"; do
  printf '%s\n    %s\n' "$expr" "$(query "$expr")"
done
kill -TERM $listen_pid
wait $listen_pid || true
echo "== listen's log (warnings and what an operator hears of):"
grep -v "engine connected" "$work/listen.log" | head -20
echo "== the replay's report:"
cat "$work/replay.out"
