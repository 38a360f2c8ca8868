#!/bin/sh
# renext.sh - change the extension of every matching file in a directory.
#
# usage: renext.sh [-n] DIR FROM TO
#
#   renext.sh photos jpeg jpg     renames photos/*.jpeg to photos/*.jpg
#   -n                            dry run: only print what would be renamed
#
# Prints "OLD -> NEW" for each file and a final count. A file is skipped,
# with a warning, when the new name already exists.
set -eu

dry_run=0
if [ "${1:-}" = "-n" ]; then
	dry_run=1
	shift
fi
if [ $# -ne 3 ]; then
	echo "usage: renext.sh [-n] DIR FROM TO" >&2
	exit 2
fi
dir=${1%/} from=${2#.} to=${3#.}
if [ ! -d "$dir" ]; then
	echo "renext: $dir: not a directory" >&2
	exit 1
fi

count=0
for path in "$dir"/*."$from"; do
	[ -f "$path" ] || continue
	name=${path##*/}
	new=${name%."$from"}.$to
	if [ -e "$dir/$new" ]; then
		echo "renext: $dir/$new already exists, skipping $name" >&2
		continue
	fi
	echo "$name -> $new"
	if [ "$dry_run" -eq 0 ]; then
		mv "$dir/$name" "$dir/$new"
	fi
	count=$((count + 1))
done
echo "$count file(s) renamed"
