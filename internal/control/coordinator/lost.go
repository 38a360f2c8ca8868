package coordinator

import (
	"context"
	"errors"
	"fmt"
	"time"

	"stasis/errdefs"
	"stasis/internal/control/checkpoint"
	"stasis/internal/control/episode"
	"stasis/internal/storage/store"
)

// ErrLost is in the error of a wait or a verify that found the episode's
// sandbox gone (deleted, expired, or its keeper dead): the episode is now
// marked lost, and a restore of a checkpoint brings it back.
var ErrLost = errdefs.Errorf(errdefs.ErrConflict, "its sandbox is gone: the episode is lost; restore a checkpoint of it to bring it back")

// sandboxGone reports whether err says a sandbox is gone or dead: not
// there, expired, or no longer running (its keeper died).
func sandboxGone(err error) bool {
	return errors.Is(err, errdefs.ErrNotFound) || errors.Is(err, errdefs.ErrExpired) || errors.Is(err, errdefs.ErrConflict)
}

// markLost writes the row of an episode whose sandbox is gone (cause says
// how), deleting what is left of the sandbox first: lostRow. If the
// delete fails, the row keeps naming the sandbox and Retire deletes it.
func (c *Coordinator) markLost(ctx context.Context, r store.Episode, cause error) error {
	gone := errors.Is(cause, errdefs.ErrNotFound)
	if !gone {
		// Expired, or its keeper died: delete what is left of it.
		if derr := c.deleteSandbox(ctx, r.Sandbox); derr != nil {
			c.log.Warn("delete a dead sandbox", "episode", r.ID, "sandbox", r.Sandbox, "err", derr)
		} else {
			gone = true
		}
	}
	_, verr := c.o.Store.GetVerdict(ctx, r.ID, r.Attempt)
	return c.o.Store.PutEpisode(ctx, lostRow(r, gone, verr == nil))
}

// noticeLost checks that live episode id's sandbox is still there and
// its supervisor answers (or left its receipt); when the sandbox is gone,
// or the supervisor is gone without a receipt (killed: the episode can
// neither go on nor be verified), the episode is dropped from the live
// ones and marked lost, and the error says so (matching ErrLost). A check that cannot take the
// coordinator's operation lock (a prepare or a restore runs) marks
// nothing: the operation, or the next check, will.
func (c *Coordinator) noticeLost(ctx context.Context, id string) error {
	e, ok := c.Live(id)
	if !ok {
		return nil
	}
	sb := e.SandboxID()
	_, cause := c.o.Env.Provider.Get(ctx, sb)
	if cause == nil {
		cause = c.supervisorGone(ctx, e)
	}
	if !sandboxGone(cause) {
		return nil
	}
	if !c.op.TryLock() {
		return nil
	}
	defer c.op.Unlock()
	if errors.Is(cause, errSupervisorGone) && !errors.Is(c.supervisorGone(ctx, e), errSupervisorGone) {
		return nil // it answers after all
	}
	c.mu.Lock()
	if c.live[id] != e {
		c.mu.Unlock()
		return nil
	}
	delete(c.live, id)
	c.mu.Unlock()
	c.log.Warn("episode lost: its sandbox or its supervisor is gone", "episode", id, "sandbox", sb, "err", cause)
	lost := fmt.Errorf("episode %s: sandbox %s: %w (%v)", id, sb, ErrLost, cause)
	row, err := c.o.Store.GetEpisode(ctx, id)
	if err == nil && row.Sandbox == sb {
		err = c.markLost(ctx, row, cause)
	}
	if err != nil {
		return fmt.Errorf("%w; and recording it failed: %v", lost, err)
	}
	return lost
}

// errSupervisorGone is the cause of a loss whose sandbox runs on but whose
// supervisor is gone without a receipt.
var errSupervisorGone = errdefs.Errorf(errdefs.ErrConflict, "its supervisor is gone and left no receipt (killed?)")

// supervisorGone is errSupervisorGone (with the status's error) when
// live episode e's supervisor is gone without a receipt, else nil.
func (c *Coordinator) supervisorGone(ctx context.Context, e *episode.Episode) error {
	if _, err := e.Status(ctx); checkpoint.IsUnreachable(err) {
		return fmt.Errorf("%w: %v", errSupervisorGone, err)
	}
	return nil
}

// CheckLiveness checks every live episode's sandbox and supervisor and marks each whose
// sandbox or supervisor is gone lost (noticeLost); it returns those.
func (c *Coordinator) CheckLiveness(ctx context.Context) []string {
	var lost []string
	for _, id := range c.LiveIDs() {
		if err := c.noticeLost(ctx, id); errors.Is(err, ErrLost) {
			lost = append(lost, id)
		}
	}
	return lost
}

// watch runs CheckLiveness every interval until Close.
func (c *Coordinator) watch(interval time.Duration) {
	defer c.watching.Done()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		<-c.stop
		cancel()
	}()
	for {
		select {
		case <-c.stop:
			return
		case <-c.clock.After(interval):
			c.CheckLiveness(ctx)
		}
	}
}
