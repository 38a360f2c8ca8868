package model

import (
	"context"
	"slices"
	"sync"
)

// A Gate holds the model calls the server answers (chat completions and
// responses) until it lets them through, so that a test decides how many
// calls are answered, which ones and when, by count rather than by timing
// (Options.Gate). It changes nothing of what the server answers: a call
// let through is answered as it would have been without the gate. It
// counts every call it lets through, by the script played and the turn:
// the calls the model made.
//
// A call whose client goes away while it is held leaves without an
// answer and is not counted. A new Gate is closed: nothing passes until
// Release or Open.
type Gate struct {
	mu      sync.Mutex
	open    bool
	seq     int
	waiting []*heldCall
	passed  []GateCall
	changed chan struct{} // closed and replaced at each arrival or departure
}

// GateCall is one call at a gate.
type GateCall struct {
	// Seq numbers the calls in the order they arrived at the gate, from 1.
	Seq int
	// Script is the name of the script the call plays (its task's id for
	// a task's script), Turn the turn it asks for (the number of
	// assistant messages before it).
	Script string
	Turn   int
}

type heldCall struct {
	GateCall
	let chan struct{}
}

// NewGate returns a closed gate.
func NewGate() *Gate { return &Gate{changed: make(chan struct{})} }

// wake tells the waiters that the calls held changed. g.mu is held.
func (g *Gate) wake() {
	close(g.changed)
	g.changed = make(chan struct{})
}

// pass holds call c until it is let through (true) or ctx ends (false).
func (g *Gate) pass(ctx context.Context, script string, turn int) bool {
	g.mu.Lock()
	g.seq++
	c := GateCall{Seq: g.seq, Script: script, Turn: turn}
	if g.open {
		g.passed = append(g.passed, c)
		g.mu.Unlock()
		return true
	}
	h := &heldCall{GateCall: c, let: make(chan struct{})}
	g.waiting = append(g.waiting, h)
	g.wake()
	g.mu.Unlock()
	select {
	case <-h.let:
		return true
	case <-ctx.Done():
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	select {
	case <-h.let: // let through as the client went: answered all the same
		return true
	default:
	}
	g.waiting = slices.DeleteFunc(g.waiting, func(x *heldCall) bool { return x == h })
	g.wake()
	return false
}

// Waiting lists the calls held now, in the order they arrived.
func (g *Gate) Waiting() []GateCall {
	g.mu.Lock()
	defer g.mu.Unlock()
	out := make([]GateCall, len(g.waiting))
	for i, h := range g.waiting {
		out[i] = h.GateCall
	}
	return out
}

// Passed lists every call let through so far, in the order let through.
func (g *Gate) Passed() []GateCall {
	g.mu.Lock()
	defer g.mu.Unlock()
	return slices.Clone(g.passed)
}

// Release lets through at most n of the calls held now that match (every
// call when match is nil), the oldest first, and returns those it let
// through.
func (g *Gate) Release(n int, match func(GateCall) bool) []GateCall {
	g.mu.Lock()
	defer g.mu.Unlock()
	var out []GateCall
	keep := g.waiting[:0]
	for _, h := range g.waiting {
		if len(out) < n && (match == nil || match(h.GateCall)) {
			out = append(out, h.GateCall)
			g.passed = append(g.passed, h.GateCall)
			close(h.let)
			continue
		}
		keep = append(keep, h)
	}
	clear(g.waiting[len(keep):])
	g.waiting = keep
	if len(out) > 0 {
		g.wake()
	}
	return out
}

// Open lets every call through, those held and those to come, until
// Close.
func (g *Gate) Open() {
	g.mu.Lock()
	g.open = true
	g.mu.Unlock()
	g.Release(int(^uint(0)>>1), nil)
}

// Close holds the calls that come from now on.
func (g *Gate) Close() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.open = false
}

// Await waits until the calls held satisfy cond, or ctx ends.
func (g *Gate) Await(ctx context.Context, cond func(waiting []GateCall) bool) error {
	for {
		g.mu.Lock()
		ch := g.changed
		g.mu.Unlock()
		if cond(g.Waiting()) {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	}
}
