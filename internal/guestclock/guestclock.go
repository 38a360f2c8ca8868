// Package guestclock owns setting a resumed sandbox's wall clock from
// inside the sandbox. The target is computed where the clock is set, from
// the sandbox's own uptime read a few microseconds earlier, so no
// round-trip to the host stands between the reading and the setting: the
// clock lands on pause_wall + (uptime − pause_uptime) to within the time
// two system calls take, whatever the provider's exec or RPC latency.
//
// The microVM's guest agent calls Set for its clock request; other
// providers run the in-sandbox binary's `clock` command through their exec
// API, which calls Set too.
package guestclock

import (
	"errors"
	"fmt"
	"math"

	"golang.org/x/sys/unix"
)

// Target is what the wall clock is set to: with Continuous, PauseWall +
// (uptime − PauseUptime), as if no time had passed outside the sandbox
// while it was saved; otherwise Wall.
type Target struct {
	Continuous  bool    `json:"continuous,omitempty"`
	PauseWall   float64 `json:"pause_wall,omitempty"`
	PauseUptime float64 `json:"pause_uptime,omitempty"`
	Wall        float64 `json:"wall,omitempty"`
}

// Fix is what setting the clock did: the uptime it was computed at, and
// the wall clock (unix seconds) before and after.
type Fix struct {
	Uptime float64 `json:"uptime"`
	Before float64 `json:"before"`
	After  float64 `json:"after"`
}

// maxWall is the latest time the clock may be set to (year 2200).
const maxWall = 7258118400

// Check says what is wrong with t, or nil.
func (t Target) Check() error {
	bad := func(x float64) bool { return math.IsNaN(x) || math.IsInf(x, 0) }
	if t.Continuous {
		if bad(t.PauseWall) || bad(t.PauseUptime) || t.PauseWall <= 0 || t.PauseWall >= maxWall || t.PauseUptime < 0 {
			return fmt.Errorf("continuous clock: pause wall %v and pause uptime %v: want a unix time and seconds since boot", t.PauseWall, t.PauseUptime)
		}
		return nil
	}
	if bad(t.Wall) || t.Wall <= 0 || t.Wall >= maxWall {
		return fmt.Errorf("wall clock %v out of range", t.Wall)
	}
	return nil
}

// At is the wall clock (unix seconds) t asks for at uptime; an error when
// that is out of range (a continuous target whose uptime is before the
// pause: the sandbox was rebooted, not restored).
func (t Target) At(uptime float64) (float64, error) {
	if err := t.Check(); err != nil {
		return 0, err
	}
	if !t.Continuous {
		return t.Wall, nil
	}
	if uptime < t.PauseUptime {
		return 0, fmt.Errorf("continuous clock: uptime %.6f is before the pause's %.6f: the sandbox was rebooted, not restored", uptime, t.PauseUptime)
	}
	return t.PauseWall + (uptime - t.PauseUptime), nil
}

// Clocks is the system's clocks, injected for tests.
type Clocks struct {
	Boottime func() (unix.Timespec, error)
	Realtime func() (unix.Timespec, error)
	Settime  func(unix.Timespec) error
}

// System is the running system's CLOCK_BOOTTIME (what /proc/uptime shows,
// and what the supervisor's acknowledgements record as uptime) and
// CLOCK_REALTIME.
var System = Clocks{
	Boottime: func() (unix.Timespec, error) {
		var ts unix.Timespec
		return ts, unix.ClockGettime(unix.CLOCK_BOOTTIME, &ts)
	},
	Realtime: func() (unix.Timespec, error) {
		var ts unix.Timespec
		return ts, unix.ClockGettime(unix.CLOCK_REALTIME, &ts)
	},
	Settime: func(ts unix.Timespec) error { return unix.ClockSettime(unix.CLOCK_REALTIME, &ts) },
}

// ErrNotPermitted is returned (wrapped) when the system refuses to set the
// clock (no CAP_SYS_TIME in the initial user namespace).
var ErrNotPermitted = errors.New("not permitted to set the clock")

// Set sets the wall clock to t, computed at the uptime read just before.
func (c Clocks) Set(t Target) (Fix, error) {
	if err := t.Check(); err != nil {
		return Fix{}, err
	}
	before, err := c.Realtime()
	if err != nil {
		return Fix{}, fmt.Errorf("read the wall clock: %w", err)
	}
	up, err := c.Boottime()
	if err != nil {
		return Fix{}, fmt.Errorf("read the uptime: %w", err)
	}
	f := Fix{Uptime: seconds(up), Before: seconds(before)}
	want, err := t.At(f.Uptime)
	if err != nil {
		return f, err
	}
	if err := c.Settime(timespec(want)); err != nil {
		if errors.Is(err, unix.EPERM) {
			return f, fmt.Errorf("%w: %v", ErrNotPermitted, err)
		}
		return f, fmt.Errorf("set the wall clock: %w", err)
	}
	f.After = want
	return f, nil
}

func seconds(ts unix.Timespec) float64 { return float64(ts.Sec) + float64(ts.Nsec)/1e9 }

// timespec splits unix seconds without going through a float's rounding
// of the whole nanosecond count.
func timespec(s float64) unix.Timespec {
	sec := math.Floor(s)
	ns := int64(math.Round((s - sec) * 1e9))
	if ns >= 1e9 {
		sec, ns = sec+1, ns-1e9
	}
	return unix.Timespec{Sec: int64(sec), Nsec: ns}
}
