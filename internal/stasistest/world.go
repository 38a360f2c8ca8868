package stasistest

import (
	"context"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"stasis/internal/control/relay"
	"stasis/internal/control/system"
)

// World is the system a test runs on, assembled by system.Open as the
// server assembles it: the scripted model solving the built-in tasks, the
// gateway, a provider (local unless an option says otherwise), the record
// store and the coordinator, on a state directory of the test's. Model
// calls can be held at the gateway (Hold). Crash and Reopen take the
// host side down and up again while the sandboxes keep running, as a
// killed and restarted server does.
type World struct {
	*system.System
	t     testing.TB
	cfg   system.Config
	holds relay.Holds
}

// NewWorld opens a world for t, each option adjusting its configuration
// first. By default the test binary is the stasis binary (on the host and
// in the sandboxes) and verify's Go build cache seeds are shared across
// the test process (SeedDir). When the test ends, the world is closed,
// every sandbox left is deleted (a test that passed must have retired its
// episodes: one left is an error), and no process may be left.
func NewWorld(t testing.TB, opts ...func(*system.Config)) *World {
	t.Helper()
	// Runs last: after the cleanups of every world of the test (a test
	// may open several, the nodes of a cluster), so that one world's check
	// does not find another's sandboxes still there.
	if _, checked := checkedTests.LoadOrStore(t, true); !checked {
		t.Cleanup(func() {
			checkedTests.Delete(t)
			NoChildrenLeft(t)
		})
	}
	w := &World{t: t}
	w.cfg = system.Config{
		State: t.TempDir(), Exe: Exe(), ExeEnv: Env, Binary: Exe(), BinaryEnv: EnvMap,
		SeedDir: SeedDir(t), Concurrency: 4,
		GatewayMiddleware: func(h http.Handler) http.Handler { return w.holds.Middleware(h) },
	}
	for _, o := range opts {
		o(&w.cfg)
	}
	sock, err := system.GatewaySocket(w.cfg.State)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(filepath.Dir(sock)) })
	t.Cleanup(w.cleanup)
	w.ReopenWith()
	return w
}

// checkedTests are the tests whose leftover-process check is registered.
var checkedTests sync.Map

// Hold holds call n (counted from 1) of the first attempt of episode ("":
// of every episode) at the gateway until it is released; the hold's Wait
// says when calls have arrived there.
func (w *World) Hold(episode string, n int) *relay.Hold {
	h := w.holds.Add(episode, n)
	w.t.Cleanup(h.Release)
	return h
}

// HoldAttempt holds the call numbered call (the number in its id: the
// relay of attempt a counts from a×1 000 000+1) of attempt of episode
// ("": of every episode) at the gateway until it is released.
func (w *World) HoldAttempt(episode string, attempt, call int) *relay.Hold {
	h := w.holds.AddAttempt(episode, attempt, call)
	w.t.Cleanup(h.Release)
	return h
}

// Unhold releases h and forgets it: a later hold of the same call holds
// it again.
func (w *World) Unhold(h *relay.Hold) { w.holds.Remove(h) }

// Crash takes the host side down without retiring anything: the
// coordinator, gateway, store and model stop, the sandboxes keep running.
func (w *World) Crash() {
	w.t.Helper()
	if w.System == nil {
		return
	}
	if err := w.System.Close(); err != nil {
		w.t.Errorf("close the system: %v", err)
	}
	w.System = nil
}

// Reopen opens the system again on the same state directory (after
// Crash), as a restarted server does: it finishes or undoes what the last
// one was doing and re-attaches the running episodes.
func (w *World) Reopen() { w.t.Helper(); w.ReopenWith() }

// ReopenWith is Reopen with the world's configuration adjusted by opts
// first, from now on (a new model upstream, a coordinator with a step
// hook).
func (w *World) ReopenWith(opts ...func(*system.Config)) {
	w.t.Helper()
	for _, o := range opts {
		o(&w.cfg)
	}
	w.Crash()
	s, err := system.Open(context.Background(), w.cfg)
	if err != nil {
		w.t.Fatal(err)
	}
	w.System = s
}

func (w *World) cleanup() {
	if w.System == nil {
		// Reopen failed, or the test left it crashed: the sandboxes are
		// reaped by a system opened for the purpose.
		s, err := system.Open(context.Background(), w.cfg)
		if err != nil {
			w.t.Errorf("open the world to clean it up: %v", err)
			return
		}
		w.System = s
	}
	ctx := context.Background()
	p := w.Provider
	left, err := p.List(ctx, nil)
	if err != nil {
		w.t.Errorf("list the sandboxes left: %v", err)
	}
	if len(left) > 0 && !w.t.Failed() {
		w.t.Errorf("%d sandboxes left behind (first %s): a test retires its episodes", len(left), left[0].ID)
	}
	for _, sb := range left {
		if err := p.Delete(ctx, sb.ID); err != nil {
			w.t.Errorf("delete sandbox %s: %v", sb.ID, err)
		}
	}
	w.Crash()
}
