package checkpoint

import (
	"errors"
	"slices"
	"testing"
	"time"
)

// TestBackoff: a step is run until it succeeds, at most Tries times, with
// doubling waits between runs and none after the last; the waits go to the
// injected Sleep, so no real time passes.
func TestBackoff(t *testing.T) {
	fail := errors.New("busy")
	for _, c := range []struct {
		name      string
		failures  int // runs that fail before one succeeds
		wantRuns  int
		wantWaits []time.Duration
		wantErr   error
	}{
		{"first run", 0, 1, nil, nil},
		{"third run", 2, 3, []time.Duration{10 * time.Millisecond, 20 * time.Millisecond}, nil},
		{"never", 99, 4, []time.Duration{10 * time.Millisecond, 20 * time.Millisecond, 40 * time.Millisecond}, fail},
	} {
		t.Run(c.name, func(t *testing.T) {
			var waits []time.Duration
			b := Backoff{Tries: 4, Base: 10 * time.Millisecond, Sleep: func(d time.Duration) { waits = append(waits, d) }}
			runs := 0
			err := b.Retry(func() error {
				runs++
				if runs <= c.failures {
					return fail
				}
				return nil
			})
			if !errors.Is(err, c.wantErr) || runs != c.wantRuns || !slices.Equal(waits, c.wantWaits) {
				t.Errorf("err %v, %d runs, waits %v; want %v, %d, %v", err, runs, waits, c.wantErr, c.wantRuns, c.wantWaits)
			}
		})
	}
}
