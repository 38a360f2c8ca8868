// Package testwait owns the tests' one way of waiting for a condition:
// polling it, with a deadline, instead of sleeping for a guessed time.
package testwait

import (
	"testing"
	"time"
)

// Interval is how often Until polls.
const Interval = 5 * time.Millisecond

// Until polls cond every Interval until it holds, and fails the test,
// naming what it waited for, if it does not hold within timeout.
func Until(t testing.TB, what string, timeout time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not within %s: %s", timeout, what)
		}
		time.Sleep(Interval) // poll interval, bounded by the deadline above
	}
}
