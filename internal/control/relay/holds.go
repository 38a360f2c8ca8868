package relay

import (
	"context"
	"net/http"
	"strconv"
	"strings"
	"sync"
)

// Holds is gateway middleware that holds chosen model calls before they
// reach the gateway, each until it is let go. A benchmark stops every
// episode at a known call with it, and a test one episode, by the call's
// number rather than by timing. A hold names the attempt whose calls it
// holds: Add's, attempt 0 (a restored episode's calls pass); AddAttempt's,
// any one.
type Holds struct {
	mu    sync.Mutex
	holds []*Hold
}

// Hold is one rule of Holds: the call numbered Call of attempt Attempt of
// Episode ("" for every episode). Call is the number in the call's id,
// which the relay of an attempt counts from where the episode says
// (attempt a's from a×1 000 000+1).
type Hold struct {
	Episode string
	Attempt int
	Call    int

	mu      sync.Mutex
	seen    map[string]bool // call ids held so far
	changed chan struct{}   // closed and replaced at each new arrival
	open    chan struct{}
	once    sync.Once
}

// Add holds call n of attempt 0 of episode ("" for every episode) from
// now on.
func (h *Holds) Add(episode string, n int) *Hold { return h.AddAttempt(episode, 0, n) }

// AddAttempt holds the call numbered call (the number in its id) of
// attempt of episode ("" for every episode) from now on. Where two holds
// name one call, the one added first holds it.
func (h *Holds) AddAttempt(episode string, attempt, call int) *Hold {
	g := &Hold{Episode: episode, Attempt: attempt, Call: call, seen: map[string]bool{}, changed: make(chan struct{}), open: make(chan struct{})}
	h.mu.Lock()
	h.holds = append(h.holds, g)
	h.mu.Unlock()
	return g
}

// Remove releases g and forgets it: a hold added later for the same call
// holds it again.
func (h *Holds) Remove(g *Hold) {
	g.Release()
	h.mu.Lock()
	defer h.mu.Unlock()
	for i, x := range h.holds {
		if x == g {
			h.holds = append(h.holds[:i:i], h.holds[i+1:]...)
			return
		}
	}
}

// Release lets every call the hold holds, and every later one, through.
func (g *Hold) Release() { g.once.Do(func() { close(g.open) }) }

// Held is how many distinct calls have arrived at the hold.
func (g *Hold) Held() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.seen)
}

// Wait waits until n distinct calls have arrived (1 for one episode's), or
// ctx ends.
func (g *Hold) Wait(ctx context.Context, n int) error {
	for {
		g.mu.Lock()
		ch, have := g.changed, len(g.seen)
		g.mu.Unlock()
		if have >= n {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	}
}

// arrive counts call id and reports whether it must wait.
func (g *Hold) arrive(id string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.seen[id] {
		g.seen[id] = true
		close(g.changed)
		g.changed = make(chan struct{})
	}
}

// match is the hold for a call of episode ep, numbered n, at attempt (as
// the header gives it).
func (h *Holds) match(ep string, n int, attempt string) *Hold {
	a, err := strconv.Atoi(attempt)
	if err != nil {
		return nil
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, g := range h.holds {
		if g.Call == n && g.Attempt == a && (g.Episode == "" || g.Episode == ep) {
			return g
		}
	}
	return nil
}

// Middleware holds the calls that reach next while their hold is not
// released; a call whose client goes away meanwhile is dropped.
func (h *Holds) Middleware(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, q *http.Request) {
		id := q.Header.Get(HeaderCallID)
		ep, num, _ := strings.Cut(id, "/")
		n, err := strconv.Atoi(num)
		if g := h.match(ep, n, q.Header.Get(HeaderAttempt)); err == nil && g != nil {
			g.arrive(id)
			select {
			case <-g.open:
			case <-q.Context().Done():
				return
			}
		}
		next.ServeHTTP(w, q)
	})
}
