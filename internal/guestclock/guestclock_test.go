package guestclock

import (
	"errors"
	"math"
	"testing"

	"golang.org/x/sys/unix"
)

func fixed(boot, real unix.Timespec, set *[]unix.Timespec, err error) Clocks {
	return Clocks{
		Boottime: func() (unix.Timespec, error) { return boot, nil },
		Realtime: func() (unix.Timespec, error) { return real, nil },
		Settime: func(ts unix.Timespec) error {
			if err != nil {
				return err
			}
			*set = append(*set, ts)
			return nil
		},
	}
}

func TestSetContinuous(t *testing.T) {
	var set []unix.Timespec
	// Paused at wall 1_800_000_000.25 and uptime 100.5; restored, the
	// uptime reads 130.75 and the wall (the host's, as the service set it)
	// 1_800_009_999.
	c := fixed(unix.Timespec{Sec: 130, Nsec: 750_000_000}, unix.Timespec{Sec: 1_800_009_999}, &set, nil)
	f, err := c.Set(Target{Continuous: true, PauseWall: 1_800_000_000.25, PauseUptime: 100.5})
	if err != nil {
		t.Fatal(err)
	}
	want := unix.Timespec{Sec: 1_800_000_030, Nsec: 500_000_000}
	if len(set) != 1 || set[0] != want {
		t.Fatalf("set %v, want %v", set, want)
	}
	if f.Uptime != 130.75 || f.Before != 1_800_009_999 || math.Abs(f.After-1_800_000_030.5) > 1e-6 {
		t.Fatalf("fix %+v", f)
	}
}

func TestSetWall(t *testing.T) {
	var set []unix.Timespec
	c := fixed(unix.Timespec{Sec: 5}, unix.Timespec{Sec: 1_700_000_000}, &set, nil)
	if _, err := c.Set(Target{Wall: 1_800_000_000.000001}); err != nil {
		t.Fatal(err)
	}
	if len(set) != 1 || set[0].Sec != 1_800_000_000 || set[0].Nsec < 500 || set[0].Nsec > 1500 {
		t.Fatalf("set %v", set)
	}
}

func TestRefused(t *testing.T) {
	var set []unix.Timespec
	c := fixed(unix.Timespec{Sec: 50}, unix.Timespec{Sec: 1_700_000_000}, &set, nil)
	for name, tg := range map[string]Target{
		"rebooted":      {Continuous: true, PauseWall: 1_700_000_000, PauseUptime: 60},
		"nan wall":      {Wall: math.NaN()},
		"zero wall":     {},
		"inf pause":     {Continuous: true, PauseWall: math.Inf(1), PauseUptime: 1},
		"past 2200":     {Wall: maxWall + 1},
		"negative up":   {Continuous: true, PauseWall: 1_700_000_000, PauseUptime: -1},
		"no pause wall": {Continuous: true, PauseUptime: 1},
	} {
		if _, err := c.Set(tg); err == nil {
			t.Errorf("%s: %+v was accepted", name, tg)
		}
	}
	if len(set) != 0 {
		t.Fatalf("a refused target set the clock: %v", set)
	}
	c = fixed(unix.Timespec{Sec: 50}, unix.Timespec{Sec: 1_700_000_000}, &set, unix.EPERM)
	if _, err := c.Set(Target{Wall: 1_800_000_000}); !errors.Is(err, ErrNotPermitted) {
		t.Fatalf("EPERM: %v", err)
	}
}

func TestTimespecRounds(t *testing.T) {
	for _, c := range []struct {
		in   float64
		want unix.Timespec
	}{
		{1.5, unix.Timespec{Sec: 1, Nsec: 500_000_000}},
		{1.9999999999, unix.Timespec{Sec: 2, Nsec: 0}},
		{1_800_000_000.123456, unix.Timespec{Sec: 1_800_000_000, Nsec: 123_456_001}},
	} {
		got := timespec(c.in)
		if got.Sec != c.want.Sec || math.Abs(float64(got.Nsec-c.want.Nsec)) > 1000 {
			t.Errorf("timespec(%v) = %v, want %v", c.in, got, c.want)
		}
	}
}
