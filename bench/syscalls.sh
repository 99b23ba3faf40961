#!/bin/bash
# syscalls.sh counts, for each contender's process, the system calls and
# context switches per message of one run (BENCHMARKS.md §6): it runs bench
# with -rounds 1 and attaches perf stat to each child as it starts, before
# the child is told to go. Counts, unlike CPU time, move little with the
# load: they say how often the process went to the kernel, and how often it
# went to sleep and was woken.
#
#   bench/syscalls.sh [-n N] [other bench flags] -only plain,rabbitmw-redis
#
# Needs perf (Debian's linux-perf) with the syscalls tracepoints, and the
# servers bench needs. Run from the bench directory or the repository root.
set -euo pipefail
cd "$(dirname "$0")"

dir=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$dir"' EXIT
go build -o "$dir/bench" .
perf stat -e raw_syscalls:sys_enter true >/dev/null 2>&1 || {
	echo "syscalls.sh: perf cannot count the syscalls tracepoints here" >&2
	exit 1
}

events=raw_syscalls:sys_enter,syscalls:sys_enter_write,syscalls:sys_enter_read,syscalls:sys_enter_futex,syscalls:sys_enter_epoll_pwait,syscalls:sys_enter_nanosleep,context-switches,task-clock

# watch attaches perf stat to each child of bench as it appears, its file
# named after the child's contender, until bench exits.
watch() {
	local seen=" " perfs=""
	while kill -0 "$1" 2>/dev/null; do
		for p in $(pgrep -f "$dir/bench -child" || true); do
			case "$seen" in *" $p "*) continue ;; esac
			seen="$seen$p "
			name=$(tr '\0' '\n' <"/proc/$p/cmdline" 2>/dev/null | grep -o '"contender":"[^"]*"' | cut -d'"' -f4 || true)
			if [ -n "$name" ]; then
				perf stat -x, -e "$events" -p "$p" -o "$dir/perf.$name" 2>/dev/null &
				perfs="$perfs $!"
			fi
		done
		sleep 0.02
	done
	[ -z "$perfs" ] || wait $perfs
}

"$dir/bench" -rounds 1 -stack=false "$@" >"$dir/out.txt" 2>&1 &
bench=$!
watch "$bench"
wait "$bench" || {
	cat "$dir/out.txt" >&2
	exit 1
}
grep -E "^round|deliveries acked" "$dir/out.txt"

printf '\n%-26s %10s %8s %7s %7s %7s %7s %7s %8s %11s\n' contender messages syscalls write read futex epoll nsleep switches "CPU ms/1000"
for f in "$dir"/perf.*; do
	name=${f##*/perf.}
	n=$(grep "^$name: " "$dir/out.txt" | grep -o '[0-9]* deliveries acked' | cut -d' ' -f1)
	[ -n "$n" ] || continue
	awk -F, -v name="$name" -v n="$n" '
		$3 ~ /sys_enter$/ && $3 ~ /raw/ { all = $1 }
		$3 ~ /enter_write$/ { w = $1 }
		$3 ~ /enter_read$/ { r = $1 }
		$3 ~ /enter_futex$/ { fx = $1 }
		$3 ~ /epoll_pwait$/ { ep = $1 }
		$3 ~ /nanosleep$/ { ns = $1 }
		$3 ~ /context-switches/ { cs = $1 }
		$3 ~ /task-clock/ { ms = $1 }
		END {
			printf "%-26s %10d %8.2f %7.2f %7.2f %7.2f %7.2f %7.2f %8.2f %11.0f\n", name, n, all/n, w/n, r/n, fx/n, ep/n, ns/n, cs/n, ms/n*1000
		}' "$f"
done
echo
echo "per message: system calls (all, then by kind), context switches; CPU: the process's task-clock per 1,000 messages over the whole child, its start and warm-up included"
