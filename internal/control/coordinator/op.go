package coordinator

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"stasis/internal/storage/store"
)

// Clock is the time a coordinator goes by: when a restore's forks expire,
// when the liveness check runs, how long each phase took.
type Clock interface {
	Now() time.Time
	After(d time.Duration) <-chan time.Time
}

type realClock struct{}

func (realClock) Now() time.Time                         { return time.Now() }
func (realClock) After(d time.Duration) <-chan time.Time { return time.After(d) }

// errCrashed is what an operation returns when the step hook (tests)
// crashed it: it stopped where it was, undoing and closing nothing, as a
// server killed there would.
var errCrashed = errors.New("crashed by the step hook")

// op is one prepare or restore under way: its journal and its steps. The
// executor journals what a step is about to create before it creates it,
// and calls step before each step, where the tests' hook may crash it.
type op struct {
	c       *Coordinator
	id      string
	kind    string // jPrepare or jRestore
	crashed atomic.Bool
}

func (c *Coordinator) newOp(kind string) *op {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return &op{c: c, kind: kind, id: fmt.Sprintf("%s-%d-%s", kind, c.clock.Now().UnixNano(), hex.EncodeToString(b))}
}

// step is called before each step of the operation. Once the hook has
// crashed it, every later step of the operation fails too (its other
// episodes' goroutines stop at their next step).
func (x *op) step(name, episode string) error {
	if x.crashed.Load() {
		return errCrashed
	}
	if h := x.c.o.stepHook; h != nil {
		if err := h(x.kind, name, episode); err != nil {
			x.crashed.Store(true)
			return fmt.Errorf("%w: %s %s %s: %w", errCrashed, x.kind, name, episode, err)
		}
	}
	return nil
}

// dead reports whether the hook crashed the operation: its caller returns
// at once, cleaning up nothing.
func (x *op) dead() bool { return x.crashed.Load() }

// note journals a step of the operation, durably, before it is taken.
func (x *op) note(ctx context.Context, kind, episode string, d jdoc) error {
	if x.dead() {
		return errCrashed
	}
	doc, err := json.Marshal(d)
	if err != nil {
		return err
	}
	if _, err := x.c.o.Store.AppendJournal(context.WithoutCancel(ctx), store.JournalEntry{Op: x.id, Kind: kind, Episode: episode, Doc: doc}); err != nil {
		return fmt.Errorf("journal the %s step: %w", kind, err)
	}
	return nil
}

// close closes the operation's journal, putting es with it.
func (x *op) close(ctx context.Context, es []store.Episode) error {
	if x.dead() {
		return errCrashed
	}
	return x.c.o.Store.CloseJournal(context.WithoutCancel(ctx), x.id, es)
}
