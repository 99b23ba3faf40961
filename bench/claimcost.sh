#!/bin/bash
# claimcost.sh counts the instructions PostgreSQL runs per transaction of
# the PostgreSQL inbox's claim, against the hand-written inbox's INSERT and
# against variants of the claim with a part of it taken out (BENCHMARKS.md
# §2). It runs a throwaway PostgreSQL in single-user mode under
# valgrind's callgrind, which counts instructions, not seconds: the same
# figures whatever else the machine does. Single-user mode has no client
# protocol, so what it counts is the statements' own work (planning a
# prepared statement once, executing it, the WAL records, the commit), not
# the round trips. It does print each row a statement returns, in a
# verbose form that costs more than the row's message on the wire would:
# handret, the hand-written INSERT with RETURNING 1, shows how much.
#
# Each transaction is BEGIN; the claim (a prepared statement); the
# effect's INSERT (prepared); COMMIT. The per-transaction figure is the
# difference between runs of 3,000 and 1,000 transactions, over 2,000.
#
# The claim statement is a copy of claimInTxSQL in store/pgstore/store.go
# as of commit 79a7fd2; change both together.
#
# Needs PostgreSQL's server binaries (initdb, postgres) and valgrind. Run
# as root (it runs PostgreSQL as the postgres user) or as a user that may
# run PostgreSQL.
set -euo pipefail

bin=${PGBIN:-$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
as() { if [ "$(id -u)" = 0 ]; then su postgres -c "$*"; else sh -c "$*"; fi; }
[ "$(id -u)" = 0 ] && chown postgres "$dir"
as "$bin/initdb -D $dir/data -A trust" >/dev/null

claimSQL() { # name table where returning
	echo "PREPARE $1(bytea, bigint, text) AS INSERT INTO $2 AS c (key, token, lease_until, forget_at) SELECT \$1::bytea, NULL, statement_timestamp() + \$2::bigint * interval '1 microsecond', statement_timestamp() + \$2::bigint * interval '1 microsecond' WHERE $3 ON CONFLICT (key) DO NOTHING RETURNING $4;"
}
save="CASE WHEN set_config('rabbitmw.saved_lock_timeout', current_setting('lock_timeout'), true) IS NULL THEN false WHEN set_config('idle_in_transaction_session_timeout', \$3::text, true) IS NULL THEN false ELSE set_config('lock_timeout', '1000ms', true) IS NOT NULL END"
restore="set_config('lock_timeout', current_setting('rabbitmw.saved_lock_timeout'), true)"

prelude() {
	cat <<'EOF'
DROP TABLE IF EXISTS hin, eff, cl, cl2;
CREATE TABLE hin (id text PRIMARY KEY);
CREATE TABLE eff (id text NOT NULL);
CREATE TABLE cl (key bytea PRIMARY KEY, token bytea, lease_until timestamptz NOT NULL, forget_at timestamptz NOT NULL);
CREATE INDEX cl_f ON cl (forget_at);
CREATE TABLE cl2 (key bytea PRIMARY KEY, token bytea, lease_until timestamptz NOT NULL, forget_at timestamptz NOT NULL);
PREPARE hand(text) AS INSERT INTO hin (id) VALUES ($1) ON CONFLICT DO NOTHING;
PREPARE handret(text) AS INSERT INTO hin (id) VALUES ($1) ON CONFLICT DO NOTHING RETURNING 1;
PREPARE effect(text) AS INSERT INTO eff (id) VALUES ($1);
EOF
	claimSQL claim cl "$save" "$restore"
	claimSQL noindex cl2 "$save" "$restore"
	claimSQL idleonly cl "set_config('idle_in_transaction_session_timeout', \$3::text, true) IS NOT NULL" 1
	claimSQL noconfig cl true 1
}

# script variant n writes n transactions of variant.
script() {
	prelude
	for ((k = 0; k < $2; k++)); do
		id="m-$RANDOM$RANDOM$RANDOM-$k"
		echo "BEGIN;"
		if [ "${1#hand}" != "$1" ]; then
			echo "EXECUTE $1('$id');"
		else
			echo "EXECUTE $1('$id', 86400000000, '30000');"
		fi
		echo "EXECUTE effect('$id');"
		echo "COMMIT;"
	done
}

# count variant n prints the instructions of a run of n transactions.
count() {
	script "$1" "$2" >"$dir/in.sql"
	as "valgrind --tool=callgrind --callgrind-out-file=$dir/cg.out $bin/postgres --single -D $dir/data -c fsync=off -c synchronous_commit=off postgres <$dir/in.sql >$dir/out.txt 2>&1"
	if grep -qi error "$dir/out.txt"; then
		grep -i error "$dir/out.txt" >&2
		exit 1
	fi
	awk '/^summary:/ {print $2}' "$dir/cg.out"
}

printf '%-10s %s\n' variant "instructions per transaction"
for v in hand handret claim noindex idleonly noconfig; do
	a=$(count "$v" 1000)
	b=$(count "$v" 3000)
	printf '%-10s %d\n' "$v" $(((b - a) / 2000))
done
