#!/bin/sh
# Test runner: prints "PASS: name" or "FAIL: name" for each test.
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/envget-test.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
failed=0

envget() { sh "$here/envget.sh" "$@"; }

# expect WANT CMD...: succeeds if CMD succeeds and prints exactly WANT.
expect() {
	want=$1
	shift
	got=$("$@") && [ "$got" = "$want" ]
}

test_plain_and_quoted() {
	printf 'NAME=demo\nexport GREETING="hello world"\nSINGLE='\''x y'\''\n' >"$1/.env"
	expect demo envget "$1/.env" NAME &&
		expect "hello world" envget "$1/.env" GREETING &&
		expect "x y" envget "$1/.env" SINGLE
}

test_value_with_equals_and_last_wins() {
	printf 'URL=http://a/?x=1\nURL=http://b/?y=2\n' >"$1/.env"
	expect "http://b/?y=2" envget "$1/.env" URL
}

test_default_and_missing() {
	printf 'A=1\n' >"$1/.env"
	expect fallback envget "$1/.env" MISSING fallback &&
		! envget "$1/.env" MISSING && ! envget "$1/.env" 'bad-key' 2>/dev/null
}

test_longer_key_not_matched() {
	printf 'DB_HOST=db1\nREPLICA_DB_HOST=db2\n' >"$1/.env"
	expect db1 envget "$1/.env" DB_HOST
}

test_commented_assignment_ignored() {
	printf 'PORT=8080\n# PORT=9090 (old setting)\n#PORT=7070\n' >"$1/.env"
	expect 8080 envget "$1/.env" PORT
}

for t in plain_and_quoted value_with_equals_and_last_wins default_and_missing \
	longer_key_not_matched commented_assignment_ignored; do
	mkdir "$tmp/$t"
	if (test_$t "$tmp/$t") >/dev/null 2>&1; then
		echo "PASS: $t"
	else
		echo "FAIL: $t"
		failed=1
	fi
done
exit $failed
