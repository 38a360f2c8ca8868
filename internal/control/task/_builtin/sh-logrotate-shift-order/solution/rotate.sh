#!/bin/sh
# rotate.sh - rotate a log file, keeping a fixed number of old copies.
#
# usage: rotate.sh LOGFILE [KEEP]
#
# LOGFILE is moved to LOGFILE.1, an existing LOGFILE.1 to LOGFILE.2, and so
# on; LOGFILE.KEEP (the oldest copy) is deleted. A new, empty LOGFILE is
# created. KEEP defaults to 5.
set -eu

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
	echo "usage: rotate.sh LOGFILE [KEEP]" >&2
	exit 2
fi
log=$1
keep=${2:-5}
case $keep in
'' | *[!0-9]* | 0)
	echo "rotate: KEEP must be a positive integer" >&2
	exit 2
	;;
esac
if [ ! -f "$log" ]; then
	echo "rotate: $log: no such file" >&2
	exit 1
fi

rm -f "$log.$keep"
i=$((keep - 1))
while [ "$i" -ge 1 ]; do
	if [ -f "$log.$i" ]; then
		mv "$log.$i" "$log.$((i + 1))"
	fi
	i=$((i - 1))
done
mv "$log" "$log.1"
: >"$log"
