#!/bin/sh
# Test runner: prints "PASS: name" or "FAIL: name" for each test.
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/renext-test.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
failed=0

renext() { sh "$here/renext.sh" "$@"; }

test_simple_names() {
	touch "$1/a.jpeg" "$1/b.jpeg" "$1/c.png"
	out=$(renext "$1" jpeg jpg) || return 1
	[ -f "$1/a.jpg" ] && [ -f "$1/b.jpg" ] && [ -f "$1/c.png" ] &&
		[ ! -e "$1/a.jpeg" ] && [ "$(echo "$out" | tail -n 1)" = "2 file(s) renamed" ]
}

test_existing_target_skipped() {
	echo old >"$1/x.jpeg"
	echo keep >"$1/x.jpg"
	renext "$1" .jpeg .jpg 2>/dev/null || return 1
	[ "$(cat "$1/x.jpg")" = keep ] && [ "$(cat "$1/x.jpeg")" = old ]
}

test_dry_run_changes_nothing() {
	touch "$1/a.jpeg"
	out=$(renext -n "$1" jpeg jpg) || return 1
	[ -f "$1/a.jpeg" ] && [ ! -e "$1/a.jpg" ] && echo "$out" | grep -qx 'a.jpeg -> a.jpg'
}

test_name_with_spaces() {
	echo data >"$1/holiday photo.jpeg"
	touch "$1/plain.jpeg"
	renext "$1" jpeg jpg || return 1
	[ "$(cat "$1/holiday photo.jpg")" = data ] && [ ! -e "$1/holiday photo.jpeg" ] &&
		[ -f "$1/plain.jpg" ]
}

test_dry_run_lists_name_with_spaces() {
	touch "$1/my  scan.jpeg"
	out=$(renext -n "$1" jpeg jpg) || return 1
	echo "$out" | grep -qx 'my  scan.jpeg -> my  scan.jpg' &&
		[ "$(echo "$out" | tail -n 1)" = "1 file(s) renamed" ]
}

for t in simple_names existing_target_skipped dry_run_changes_nothing \
	name_with_spaces dry_run_lists_name_with_spaces; do
	mkdir "$tmp/$t"
	if (test_$t "$tmp/$t") >/dev/null 2>&1; then
		echo "PASS: $t"
	else
		echo "FAIL: $t"
		failed=1
	fi
done
exit $failed
