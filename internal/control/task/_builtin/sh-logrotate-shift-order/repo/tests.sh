#!/bin/sh
# Test runner: prints "PASS: name" or "FAIL: name" for each test.
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/rotate-test.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
failed=0

rotate() { sh "$here/rotate.sh" "$@"; }

# content FILE TEXT: succeeds if FILE holds exactly TEXT.
content() { [ -f "$1" ] && [ "$(cat "$1")" = "$2" ]; }

test_first_rotation() {
	echo one >"$1/app.log"
	rotate "$1/app.log" || return 1
	content "$1/app.log.1" one && [ -f "$1/app.log" ] && [ ! -s "$1/app.log" ]
}

test_missing_log_fails() {
	! rotate "$1/nope.log" 2>/dev/null && ! rotate 2>/dev/null && ! rotate "$1/x" abc 2>/dev/null
}

test_name_with_spaces() {
	echo hi >"$1/my app.log"
	rotate "$1/my app.log" 3 && content "$1/my app.log.1" hi
}

test_second_rotation_shifts_by_one() {
	echo first >"$1/app.log"
	rotate "$1/app.log" || return 1
	echo second >"$1/app.log"
	rotate "$1/app.log" || return 1
	content "$1/app.log.1" second && content "$1/app.log.2" first
}

test_keep_limit_drops_oldest() {
	for n in 1 2 3 4 5; do
		echo "gen$n" >"$1/app.log"
		rotate "$1/app.log" 3 || return 1
	done
	content "$1/app.log.1" gen5 && content "$1/app.log.2" gen4 &&
		content "$1/app.log.3" gen3 && [ ! -e "$1/app.log.4" ]
}

for t in first_rotation missing_log_fails name_with_spaces \
	second_rotation_shifts_by_one keep_limit_drops_oldest; do
	mkdir "$tmp/$t"
	if (test_$t "$tmp/$t") >/dev/null 2>&1; then
		echo "PASS: $t"
	else
		echo "FAIL: $t"
		failed=1
	fi
done
exit $failed
