#!/usr/bin/env bash
# Drive the real `lowvram chat` in a tmux terminal and check what the screen shows:
# the model loads, a question gets a streamed reply, the engine panel is filled,
# F1 opens the help, Ctrl+S saves the transcript, Ctrl+Q quits with status 0.
#
#   scripts/tmux_chat_check.sh [chat arguments...]     e.g. --model DIR --profile cpu
#
# LOWVRAM_CHAT_CMD overrides the command (default: lowvram chat). Exits non-zero,
# printing the screen, at the first check that fails.
set -euo pipefail

command -v tmux >/dev/null || { echo "tmux_chat_check: tmux is not installed (apt-get install -y tmux)" >&2; exit 2; }
chat_cmd=${LOWVRAM_CHAT_CMD:-lowvram chat}
session="lowvram-chat-check-$$"
workdir=$(mktemp -d)
transcripts="$workdir/transcripts"

cleanup() {
    tmux kill-session -t "$session" 2>/dev/null || true
    rm -rf "$workdir"
}
trap cleanup EXIT

screen() { tmux capture-pane -p -t "$session"; }

fail() {
    echo "tmux_chat_check: FAILED: $1" >&2
    echo "---- screen ----" >&2
    screen >&2 || true
    exit 1
}

# wait_for PATTERN SECONDS: until the screen matches the extended regex
wait_for() {
    local deadline=$((SECONDS + $2))
    until screen | grep -Eq -- "$1"; do
        ((SECONDS < deadline)) || fail "no '$1' on the screen after $2 s"
        sleep 0.2
    done
}

wait_gone() {
    local deadline=$((SECONDS + $2))
    while screen | grep -Eq -- "$1"; do
        ((SECONDS < deadline)) || fail "'$1' still on the screen after $2 s"
        sleep 0.2
    done
}

args=$(printf ' %q' "$@" --transcripts "$transcripts")
tmux new-session -d -s "$session" -x 120 -y 36 \
    "env TERM=xterm-256color $chat_cmd$args; echo \"CHAT-EXIT=\$?\"; sleep 600"

wait_for '· profile ' 120          # the header names the profile once the model is loaded
wait_for 'Ask something' 10

tmux send-keys -t "$session" -l 'What is 17 + 25?'
tmux send-keys -t "$session" Enter
wait_for 'What is 17 \+ 25\?' 10
wait_for '─ [0-9]+ tokens? ─' 60  # the finished reply's border gives its length

for gauge in 'memory [0-9.]+ [MG]iB / [0-9.]+ GiB' 'KV pages [0-9]+/[0-9]+' 'decode [0-9.]+ tok/s' \
             'latency [0-9.]+ ms' 'controller '; do
    screen | grep -Eq -- "$gauge" || fail "the engine panel shows no '$gauge'"
done

tmux send-keys -t "$session" F1
wait_for 'Keys and commands' 10
tmux send-keys -t "$session" Escape
wait_gone 'Keys and commands' 10

tmux send-keys -t "$session" C-s
deadline=$((SECONDS + 10))
until ls "$transcripts"/*.json >/dev/null 2>&1 && ls "$transcripts"/*.md >/dev/null 2>&1; do
    ((SECONDS < deadline)) || fail "Ctrl+S wrote no transcript to $transcripts"
    sleep 0.2
done
grep -q 'What is 17 + 25?' "$transcripts"/*.md || fail "the saved transcript lacks the question"

tmux send-keys -t "$session" C-q
wait_for 'CHAT-EXIT=0' 20
echo "tmux_chat_check: ok"
