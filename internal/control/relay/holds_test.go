package relay

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"
)

// TestHolds: a hold stops the call it names (attempt 0 only) until
// released, counts distinct calls (a retry of one is not a second), lets
// other calls by, and drops a call whose client went away.
func TestHolds(t *testing.T) {
	var reached atomic.Int32
	var h Holds
	srv := httptest.NewServer(h.Middleware(http.HandlerFunc(func(w http.ResponseWriter, q *http.Request) {
		reached.Add(1)
	})))
	defer srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	send := func(ctx context.Context, id, attempt string) error {
		q, _ := http.NewRequestWithContext(ctx, "POST", srv.URL, nil)
		q.Header.Set(HeaderCallID, id)
		q.Header.Set(HeaderAttempt, attempt)
		resp, err := http.DefaultClient.Do(q)
		if err == nil {
			resp.Body.Close()
		}
		return err
	}
	one := h.Add("ep", 3)
	every := h.Add("", 5)

	// Calls no hold names pass at once.
	for _, c := range [][2]string{{"ep/2", "0"}, {"ep/3", "1"}, {"other/3", "0"}} {
		if err := send(ctx, c[0], c[1]); err != nil {
			t.Fatal(err)
		}
	}
	if reached.Load() != 3 {
		t.Fatalf("%d calls passed, want 3", reached.Load())
	}
	// ep/3 at attempt 0 waits, twice (a retry), counted once.
	done := make(chan error, 2)
	go func() { done <- send(ctx, "ep/3", "0") }()
	go func() { done <- send(ctx, "ep/3", "0") }()
	if err := one.Wait(ctx, 1); err != nil {
		t.Fatal(err)
	}
	// Every episode's call 5: two episodes.
	go func() { done <- send(ctx, "a/5", "0") }()
	go func() { done <- send(ctx, "b/5", "0") }()
	if err := every.Wait(ctx, 2); err != nil {
		t.Fatal(err)
	}
	if one.Held() != 1 || every.Held() != 2 || reached.Load() != 3 {
		t.Fatalf("held %d and %d, passed %d", one.Held(), every.Held(), reached.Load())
	}
	one.Release()
	for range 2 {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	if reached.Load() != 5 {
		t.Fatalf("after the release %d calls passed, want 5", reached.Load())
	}
	every.Release()
	for range 2 {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	if reached.Load() != 7 {
		t.Fatalf("%d calls passed, want 7", reached.Load())
	}
	// A held call whose client goes away is dropped: its hold is never
	// released, and the handler returns without passing it on.
	never := h.Add("c", 6)
	gone, stop := context.WithCancel(ctx)
	late := make(chan error, 1)
	go func() { late <- send(gone, "c/6", "0") }()
	if err := never.Wait(ctx, 1); err != nil {
		t.Fatal(err)
	}
	stop()
	if err := <-late; err == nil {
		t.Fatal("a call whose client went away was answered")
	}
	if reached.Load() != 7 {
		t.Fatalf("%d calls passed, want 7", reached.Load())
	}
	// Wait gives up with its context.
	short, cancelShort := context.WithCancel(ctx)
	cancelShort()
	if err := every.Wait(short, 99); err == nil {
		t.Fatal("Wait past its context")
	}
}

// TestHoldsMatch: which hold, if any, a call meets, by its episode, its
// number and its attempt; the first hold added that names a call holds
// it, and a removed one holds nothing (a later one for the same call
// does).
func TestHoldsMatch(t *testing.T) {
	var h Holds
	a0 := h.Add("ep", 3)                   // attempt 0's call 3
	a2 := h.AddAttempt("ep", 2, 2000004)   // attempt 2's fourth call
	any1 := h.AddAttempt("", 1, 1000002)   // every episode's attempt 1, second call
	first := h.AddAttempt("x", 1, 1000005) // two holds of one call: the first
	second := h.AddAttempt("x", 1, 1000005)
	gone := h.AddAttempt("y", 3, 3000001)
	h.Remove(gone)
	again := h.AddAttempt("y", 3, 3000001)
	for _, c := range []struct {
		ep      string
		n       int
		attempt string
		want    *Hold
	}{
		{"ep", 3, "0", a0},
		{"ep", 3, "1", nil},
		{"ep", 3, "", nil},
		{"ep", 3, "x", nil},
		{"other", 3, "0", nil},
		{"ep", 4, "0", nil},
		{"ep", 2000004, "2", a2},
		{"ep", 2000004, "0", nil},
		{"ep", 2000004, "3", nil},
		{"ep", 1000002, "1", any1},
		{"other", 1000002, "1", any1},
		{"other", 1000002, "2", nil},
		{"x", 1000005, "1", first},
		{"y", 3000001, "3", again},
	} {
		if got := h.match(c.ep, c.n, c.attempt); got != c.want {
			t.Errorf("call %s/%d at attempt %q: hold %+v, want %+v", c.ep, c.n, c.attempt, got, c.want)
		}
	}
	select {
	case <-gone.open:
	default:
		t.Error("a removed hold is not released")
	}
	h.Remove(first)
	if got := h.match("x", 1000005, "1"); got != second {
		t.Errorf("after the first is removed the call meets %+v, want the second", got)
	}
	h.Remove(first) // removing twice is harmless
}
