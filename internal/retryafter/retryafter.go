// Package retryafter owns reading HTTP's Retry-After header, which the
// relay, the mini harness and the E2B and OpenSandbox clients all honour,
// and waiting before a retry.
package retryafter

import (
	"context"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Parse reads a Retry-After value: delay-seconds, or an HTTP date (a wait
// until then from now; a past date is 0). ok is false when the value is
// absent or unreadable.
func Parse(h string, now time.Time) (d time.Duration, ok bool) {
	h = strings.TrimSpace(h)
	if h == "" {
		return 0, false
	}
	if s, err := strconv.Atoi(h); err == nil && s >= 0 {
		return time.Duration(s) * time.Second, true
	}
	if t, err := http.ParseTime(h); err == nil {
		return max(t.Sub(now), 0), true
	}
	return 0, false
}

// Wait waits d, or less when ctx ends first (its error is returned then).
// A d of 0 or less waits nothing and returns nil.
func Wait(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
