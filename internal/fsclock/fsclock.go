// Package fsclock owns what stasis knows of the clock file timestamps come
// from: how far apart two changes must be for a timestamp to tell them
// apart.
package fsclock

import (
	"time"

	"golang.org/x/sys/unix"
)

// RacyWindow is how close to a look at a file or directory its timestamp
// may be for an unchanged timestamp to prove nothing changed since: a
// change within the same timestamp tick would not show. Timestamps come
// from the kernel's coarse clock, which advances a tick (1 to 10 ms) at a
// time; the window is two of its ticks (20 ms if the tick cannot be read).
func RacyWindow() time.Duration {
	var ts unix.Timespec
	if err := unix.ClockGetres(unix.CLOCK_REALTIME_COARSE, &ts); err != nil || ts.Nano() <= 0 {
		return 20 * time.Millisecond
	}
	return 2 * time.Duration(ts.Nano())
}
