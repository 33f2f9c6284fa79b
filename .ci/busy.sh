#!/usr/bin/env bash
# Runs the command it is given (`make test-busy`: the default suite) with CPU-bound processes beside it
# for its whole length, as on a user's machine busy with other work: BUSY_BURNERS of them (default 2,
# a 2-core machine's every core), each a shell loop. They stop when the command ends, however it ends
# (the trap), and each is bounded by `timeout` (BUSY_LIMIT_S, default an hour) should this script be
# killed outright. Exits with the command's status.
set -euo pipefail
burners=()
command_pid=
stop_burners() {
	if [ -n "$command_pid" ]; then
		kill "$command_pid" 2>/dev/null || true # a signal to this script ends the command too
	fi
	for pid in "${burners[@]}"; do
		kill "$pid" 2>/dev/null || true # timeout passes the signal on to its loop
	done
	for pid in "${burners[@]}"; do
		wait "$pid" 2>/dev/null || true
	done
}
trap stop_burners EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
for _ in $(seq "${BUSY_BURNERS:-2}"); do
	timeout "${BUSY_LIMIT_S:-3600}" sh -c 'while :; do :; done' &
	burners+=("$!")
done
echo "busy.sh: ${#burners[@]} CPU-bound processes beside: $*" >&2
# in the background and waited for, so a signal to this script is handled at once (not after the command)
"$@" &
command_pid=$!
status=0
wait "$command_pid" || status=$?
command_pid=
exit "$status"
