#!/usr/bin/env bash
# The first hour: seconds from `git clone` to the first answer of `make run`, as on a fresh
# machine (a fresh clone in a temporary folder, a fresh venv, empty pip and uv caches).
#
#   bash bench/first_answer.sh [--tree] [--install-from REV] [PORT]
#
# Clones this repository's HEAD into a temporary folder (--tree: copies this work tree's
# files instead, tracked and untracked but not ignored ones, what a clone of it would hold
# once committed), optionally with Makefile and pyproject.toml as they were at REV (the
# install before a change, on the same code), starts `make run` in the background on
# 127.0.0.1:PORT (default 8080), and asks `POST /v1/chat/completions` (model qwen3, the
# README's first request) every 0.1 s until it answers 200. Prints when each step of
# `make run` began and the first answer, in seconds from the start, or the log's tail if
# nothing answered within 120 s. Not part of `make bench` (it times the network, the disk
# and the interpreter's start-ups, not the proxy).
set -euo pipefail
tree=0
install_from=""
while [[ "${1:-}" == --* ]]; do
    case "$1" in
        --tree) tree=1; shift ;;
        --install-from) install_from="$2"; shift 2 ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
done
port="${1:-8080}"
src="$(cd "$(dirname "$0")/.." && pwd)"
tmp="$(mktemp -d /tmp/first-answer.XXXXXX)"
cleanup() {
    kill -- -"$(cat "$tmp/pid" 2>/dev/null)" 2>/dev/null || true
    for _ in 1 2 3 4 5; do rm -rf "$tmp" 2>/dev/null && break; sleep 0.5; done
}
trap cleanup EXIT
export PIP_CACHE_DIR="$tmp/pip-cache" UV_CACHE_DIR="$tmp/uv-cache"
now() { date +%s.%N; }
t0=$(now)
if ((tree)); then
    mkdir "$tmp/repo"
    (cd "$src" && git ls-files -z --cached --others --exclude-standard \
        | tar --null --ignore-failed-read -T - -cf - 2>/dev/null) | tar -xf - -C "$tmp/repo"
else
    git clone -q "$src" "$tmp/repo"
fi
if [[ -n "$install_from" ]]; then
    for f in Makefile pyproject.toml; do git -C "$src" show "$install_from:$f" >"$tmp/repo/$f"; done
fi
t_clone=$(now)
cd "$tmp/repo"
set -m
(make run LISTEN="127.0.0.1:$port" >"$tmp/run.log" 2>&1) &
echo $! >"$tmp/pid"
set +m
body='{"model":"qwen3","messages":[{"role":"user","content":"hi"}]}'
# The moment each step of `make run` starts, as its command line appears in the log.
steps=("llamaswap migrate" "llamaswap ensure-admin" "llamaswap serve")
declare -A seen=()
while :; do
    t=$(now)
    for step in "${steps[@]}"; do
        if [[ -z "${seen[$step]:-}" ]] && grep -q -- "$step" "$tmp/run.log" 2>/dev/null; then
            seen[$step]=$t
        fi
    done
    code=$(curl -s -o /dev/null -w '%{http_code}' -m 30 "http://127.0.0.1:$port/v1/chat/completions" \
        -H 'Content-Type: application/json' -d "$body" || true)
    if [[ "$code" == "200" ]]; then break; fi
    if (($(echo "$t - $t0 > 120" | bc))); then
        echo "no answer after 120 s (last status $code); the log's tail:"; tail -20 "$tmp/run.log"; exit 1
    fi
    sleep 0.1
done
t1=$(now)
printf 'source ready %.1f s' "$(echo "$t_clone - $t0" | bc)"
for step in "${steps[@]}"; do
    if [[ -n "${seen[$step]:-}" ]]; then
        printf ', `%s` from %.1f s' "$step" "$(echo "${seen[$step]} - $t0" | bc)"
    fi
done
printf ', first answer %.1f s (port %s; load average %s)\n' "$(echo "$t1 - $t0" | bc)" "$port" \
    "$(cut -d' ' -f1 /proc/loadavg)"
