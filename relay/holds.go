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
// number rather than by timing. Only calls of attempt 0 are held: a
// restored episode's calls pass.
type Holds struct {
	mu    sync.Mutex
	holds []*Hold
}

// Hold is one rule of Holds: call Call of Episode ("" for every episode).
type Hold struct {
	Episode string
	Call    int

	mu      sync.Mutex
	seen    map[string]bool // call ids held so far
	changed chan struct{}   // closed and replaced at each new arrival
	open    chan struct{}
	once    sync.Once
}

// Add holds call n of episode ("" for every episode) from now on.
func (h *Holds) Add(episode string, n int) *Hold {
	g := &Hold{Episode: episode, Call: n, seen: map[string]bool{}, changed: make(chan struct{}), open: make(chan struct{})}
	h.mu.Lock()
	h.holds = append(h.holds, g)
	h.mu.Unlock()
	return g
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

// match is the hold for a call of episode ep, numbered n, at attempt.
func (h *Holds) match(ep string, n int, attempt string) *Hold {
	if attempt != "0" {
		return nil
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, g := range h.holds {
		if g.Call == n && (g.Episode == "" || g.Episode == ep) {
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
