package relay

import (
	"context"
	"sync"
	"time"
)

// Clock is the time the relay and the gateway go by: the readings that
// stamp ledger entries and Retry-After answers, and the timers behind
// heartbeats, retry backoffs, settlement flushes and the bound on a hold's
// flush. The system's clock is the default; tests hand in one they move.
type Clock interface {
	Now() time.Time
	// AfterFunc calls f in its own goroutine once d has passed, unless
	// stop is called first (stop reports whether it prevented the call).
	AfterFunc(d time.Duration, f func()) (stop func() bool)
}

// systemClock is the real Clock.
type systemClock struct{}

func (systemClock) Now() time.Time { return time.Now() }

func (systemClock) AfterFunc(d time.Duration, f func()) func() bool {
	return time.AfterFunc(d, f).Stop
}

// clockOr is c, or the system's clock when c is nil.
func clockOr(c Clock) Clock {
	if c == nil {
		return systemClock{}
	}
	return c
}

// sleep waits d on clock c (a retry backoff) unless ctx ends first.
func sleep(ctx context.Context, c Clock, d time.Duration) bool {
	done := make(chan struct{})
	stop := c.AfterFunc(d, func() { close(done) })
	defer stop()
	select {
	case <-done:
		return true
	case <-ctx.Done():
		return false
	}
}

// withTimeout is context.WithTimeout on clock c: the context ends d after
// now (its cause is then context.DeadlineExceeded), or when cancelled.
func withTimeout(ctx context.Context, c Clock, d time.Duration) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancelCause(ctx)
	stop := c.AfterFunc(d, func() { cancel(context.DeadlineExceeded) })
	return ctx, func() {
		stop()
		cancel(context.Canceled)
	}
}

// ticker sends on C each time d passes on its clock, dropping ticks a slow
// reader misses, as time.Ticker does, until Stop.
type ticker struct {
	C <-chan struct{}

	mu      sync.Mutex
	stopped bool
	stop    func() bool
}

func newTicker(c Clock, d time.Duration) *ticker {
	ch := make(chan struct{}, 1)
	t := &ticker{C: ch}
	var arm func()
	arm = func() {
		t.stop = c.AfterFunc(d, func() {
			t.mu.Lock()
			defer t.mu.Unlock()
			if t.stopped {
				return
			}
			arm()
			select {
			case ch <- struct{}{}:
			default:
			}
		})
	}
	t.mu.Lock()
	arm()
	t.mu.Unlock()
	return t
}

// Stop ends the ticks.
func (t *ticker) Stop() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.stopped = true
	t.stop()
}
