#!/bin/sh
# envget.sh - read one variable from a dotenv file without sourcing it.
#
# usage: envget.sh FILE KEY [DEFAULT]
#
# FILE holds lines like
#     KEY=value
#     export KEY="quoted value"
#     # comments and blank lines are ignored
# When KEY is assigned more than once the last assignment wins. Prints the
# value (without surrounding quotes); prints DEFAULT, or fails with status 1
# when no DEFAULT is given, if KEY is not set.
set -u

if [ $# -lt 2 ] || [ $# -gt 3 ]; then
	echo "usage: envget.sh FILE KEY [DEFAULT]" >&2
	exit 2
fi
file=$1 key=$2
case $key in
'' | [0-9]* | *[!A-Za-z0-9_]*)
	echo "envget: invalid key: $key" >&2
	exit 2
	;;
esac
if [ ! -r "$file" ]; then
	echo "envget: cannot read $file" >&2
	exit 2
fi

line=$(grep -E "(export[[:space:]]+)?$key=" "$file" | tail -n 1)
if [ -z "$line" ]; then
	if [ $# -eq 3 ]; then
		printf '%s\n' "$3"
		exit 0
	fi
	exit 1
fi
value=${line#*=}
# strip one pair of matching surrounding quotes
printf '%s\n' "$value" | sed -e 's/^"\(.*\)"$/\1/' -e "s/^'\\(.*\\)'\$/\\1/"
