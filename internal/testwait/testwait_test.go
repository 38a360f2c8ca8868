package testwait

import (
	"sync/atomic"
	"testing"
	"time"
)

func TestUntilReturnsOnceTheConditionHolds(t *testing.T) {
	var n atomic.Int32
	Until(t, "the third poll", 10*time.Second, func() bool { return n.Add(1) >= 3 })
	if n.Load() != 3 {
		t.Fatalf("polled %d times, want 3", n.Load())
	}
}

// fatalRecorder is a testing.TB whose Fatalf records the failure and ends
// the goroutine, as testing.T's does.
type fatalRecorder struct {
	testing.TB
	msg string
}

func (r *fatalRecorder) Helper() {}
func (r *fatalRecorder) Fatalf(format string, args ...any) {
	r.msg = format
	panic(r)
}

func TestUntilFailsAtTheDeadline(t *testing.T) {
	r := &fatalRecorder{TB: t}
	start := time.Now()
	func() {
		defer func() {
			if p := recover(); p != r {
				t.Fatalf("Until did not fail the test: %v", p)
			}
		}()
		Until(r, "never", 50*time.Millisecond, func() bool { return false })
	}()
	if took := time.Since(start); took < 50*time.Millisecond {
		t.Fatalf("failed after %s, before the deadline", took)
	}
	if r.msg == "" {
		t.Fatal("no failure message")
	}
}
