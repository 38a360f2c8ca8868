package coordinator

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"stasis/errdefs"
	"stasis/internal/storage/store"
	"stasis/sandbox"
)

// SnapshotFinder is implemented by providers that can find a snapshot by
// the sandbox it was taken of and its name (the local provider): a
// prepare interrupted between making a snapshot and journaling its id
// leaves a snapshot that only this finds. Without it, recovery says which
// snapshot may be left.
type SnapshotFinder interface {
	FindSnapshots(ctx context.Context, sandboxID, name string) ([]sandbox.SnapshotInfo, error)
}

// recoverRestores reads the journal, finishes or undoes every restore in
// it (planRecovery), and returns the prepares, which recoverPrepares
// finishes once the episodes are attached. A recovery step that fails
// leaves its operation in the journal for the next coordinator.
func (c *Coordinator) recoverRestores(ctx context.Context) ([]*opState, error) {
	entries, err := c.o.Store.Journal(ctx)
	if err != nil {
		return nil, err
	}
	ops, problems := foldJournal(entries)
	for _, p := range problems {
		c.log.Error("journal", "problem", p.Detail)
	}
	var prepares []*opState
	for _, s := range ops {
		if s.Kind == jPrepare {
			prepares = append(prepares, s)
			continue
		}
		if err := c.recoverFork(ctx, s); err != nil {
			c.log.Error("an interrupted restore could not be finished; the next start tries again", "op", s.ID, "checkpoint", s.Checkpoint, "err", err)
		}
	}
	return prepares, nil
}

// recoverFork undoes or rolls forward one interrupted restore, or undoes
// one interrupted branch.
func (c *Coordinator) recoverFork(ctx context.Context, s *opState) error {
	if err := c.outsideDecision(ctx, s); err != nil {
		return err
	}
	f := recoveryFacts{Alive: map[string]bool{}}
	infos, err := c.o.Env.Provider.List(ctx, map[string]string{labelOp: s.ID})
	if err != nil {
		return fmt.Errorf("list the restore's forks: %w", err)
	}
	for _, info := range infos {
		f.Labelled = append(f.Labelled, info.ID)
	}
	for _, d := range s.Decided {
		info, err := c.o.Env.Provider.Get(ctx, d.Sandbox)
		f.Alive[d.Sandbox] = err == nil && info.State == sandbox.StateRunning
	}
	acts, problems := planRecovery(s, f)
	for _, p := range problems {
		c.log.Warn("recovery", "op", s.ID, "problem", p.Detail)
	}
	rows := c.rowsOf(ctx, s.Decided, s.Finished)
	out := map[string]outcome{}
	x := &op{c: c, id: s.ID, kind: jRestore}
	var errs []error
	for _, a := range acts {
		switch a.Kind {
		case actDeleteSandbox:
			if err := c.deleteSandbox(ctx, a.Sandbox); err != nil {
				errs = append(errs, fmt.Errorf("delete fork %s: %w", a.Sandbox, err))
			}
		case actRollForward:
			out[a.Episode] = c.rollForward(ctx, x, a)
		case actUnregister:
			if err := c.undoCopies(ctx, s.ID, nil, []string{a.Episode}); err != nil {
				errs = append(errs, err)
			}
		case actLose:
			c.log.Warn("a restore's fork died before the restore was finished: the episode is lost", "op", s.ID, "episode", a.Episode, "sandbox", a.Sandbox)
			if err := c.deleteSandbox(ctx, a.Sandbox); err != nil {
				errs = append(errs, fmt.Errorf("delete fork %s: %w", a.Sandbox, err))
			}
			at, _ := c.gatewayAttempt(a.Episode)
			out[a.Episode] = outcome{Attempt: at}
		case actClose:
			if len(errs) > 0 {
				return errors.Join(errs...)
			}
			var es []store.Episode
			if s.Decided != nil {
				for _, err := range c.rewindFinished(s.Finished) {
					c.log.Warn("an interrupted restore's ended episode", "op", s.ID, "err", err)
				}
				es = restoredRows(rows, s.Decided, s.Finished, out)
			}
			if err := c.o.Store.CloseJournal(ctx, s.ID, es); err != nil {
				return err
			}
			if s.Readied != nil && c.o.Decisions != nil {
				c.o.Decisions.Finished(ctx, s.Ref, lostFailure(s.Decided, out))
			}
			how := "undone"
			if s.Decided != nil {
				how = "rolled forward"
			}
			c.log.Warn("a "+s.Kind+" the last server was in the middle of is "+how, "op", s.ID, "checkpoint", s.Checkpoint)
		}
	}
	return nil
}

// outsideDecision settles a restore that was ready and waiting on an
// outside decision (RestoreOptions.Ref) when its server died: if the
// decision went ahead, the ready plan is the decision to roll forward;
// if it was called off, the restore is undone as undecided. A decision
// that cannot be told yet (or no Options.Decisions to ask) leaves the
// restore in the journal, its forks untouched, for the next start.
func (c *Coordinator) outsideDecision(ctx context.Context, s *opState) error {
	if s.Kind != jRestore || s.Decided != nil || s.Ref == "" || s.Readied == nil {
		return nil
	}
	if c.o.Decisions == nil {
		return fmt.Errorf("restore %s of checkpoint %s was ready and waiting on the decision of %s when the server stopped: start this server as the node it was (--node, --store) to finish it", s.ID, s.Checkpoint, s.Ref)
	}
	went, err := c.o.Decisions.Went(ctx, s.Ref)
	if err != nil {
		return fmt.Errorf("restore %s of checkpoint %s: whether %s went ahead: %w", s.ID, s.Checkpoint, s.Ref, err)
	}
	if went {
		s.Decided, s.Finished = s.Readied, s.ReadiedFinished
	}
	return nil
}

// lostFailure says which decided episodes a recovery could not continue
// ("" if none, or if nothing was decided).
func lostFailure(decided []decision, out map[string]outcome) string {
	var lost []string
	for _, d := range decided {
		if !out[d.Episode].Continued {
			lost = append(lost, d.Episode)
		}
	}
	if len(lost) == 0 {
		if decided == nil {
			return "called off: every fork deleted"
		}
		return ""
	}
	return fmt.Sprintf("finished by a restarted server, but %s could not be continued and are lost", strings.Join(lost, ", "))
}

// rollForward finishes one decided episode of an interrupted restore: the
// gateway raised to its attempt if it was not, then its harness continued
// or started in its fork (not twice). An episode that cannot be continued
// is lost, its fork deleted.
func (c *Coordinator) rollForward(ctx context.Context, x *op, a action) outcome {
	d := a.Decision
	err := persist(func() error { return c.advance(d) })
	if err == nil {
		_, d, err = c.goDecided(ctx, x, d, nil, a.Gone)
	}
	if err == nil {
		return outcome{Continued: true, Attempt: d.Attempt, Mode: d.Mode}
	}
	c.log.Warn("an interrupted restore's episode could not be continued: it is lost", "episode", d.Episode, "sandbox", d.Sandbox, "err", err)
	if derr := c.deleteSandbox(ctx, d.Sandbox); derr != nil {
		c.log.Warn("delete the fork of a lost episode", "episode", d.Episode, "sandbox", d.Sandbox, "err", derr)
	}
	at, _ := c.gatewayAttempt(d.Episode)
	return outcome{Attempt: at}
}

// recoverPrepares finishes every interrupted prepare (planRecovery), once
// the episodes are attached (their pauses are continued), then fails any
// checkpoint still pending that no journal names (left by a stasis
// without the journal) and deletes its snapshots.
func (c *Coordinator) recoverPrepares(ctx context.Context, prepares []*opState) error {
	for _, s := range prepares {
		if err := c.recoverPrepare(ctx, s); err != nil {
			c.log.Error("an interrupted prepare could not be finished; the next start tries again", "op", s.ID, "checkpoint", s.Checkpoint, "err", err)
		}
	}
	failed, err := c.o.Store.RecoverPending(ctx, 0)
	if err != nil {
		return err
	}
	for _, id := range failed {
		c.log.Warn("a checkpoint left pending by an earlier server is marked failed, its snapshots deleted", "checkpoint", id)
		_, recs, err := c.o.Store.Get(ctx, id)
		if err != nil {
			return err
		}
		for _, r := range recs {
			if r.SnapshotID != "" && r.Provider == c.o.Env.Provider.Name() {
				if err := retry(func() error { return c.o.Env.Provider.DeleteSnapshot(ctx, r.SnapshotID) }); err != nil {
					c.log.Warn("delete a snapshot of a failed checkpoint", "checkpoint", id, "snapshot", r.SnapshotID, "err", err)
				}
			}
		}
	}
	return nil
}

// recoverPrepare finishes one interrupted prepare.
func (c *Coordinator) recoverPrepare(ctx context.Context, s *opState) error {
	f := recoveryFacts{Found: map[string][]string{}}
	ck, recs, err := c.o.Store.Get(ctx, s.Checkpoint)
	switch {
	case errors.Is(err, errdefs.ErrNotFound):
	case err != nil:
		return err
	default:
		f.State = ck.State
		for _, r := range recs {
			if r.SnapshotID != "" {
				f.Recorded = append(f.Recorded, r.SnapshotID)
			}
		}
	}
	finder, canFind := c.o.Env.Provider.(SnapshotFinder)
	f.CanFind = canFind
	for _, p := range s.Pauses {
		if p.Snapshot != "" || !canFind {
			continue
		}
		found, err := finder.FindSnapshots(ctx, p.Sandbox, p.Name)
		if err != nil {
			return fmt.Errorf("find the snapshot %s of sandbox %s: %w", p.Name, p.Sandbox, err)
		}
		for _, info := range found {
			f.Found[p.Sandbox+"/"+p.Name] = append(f.Found[p.Sandbox+"/"+p.Name], info.ID)
		}
	}
	acts, problems := planRecovery(s, f)
	for _, p := range problems {
		c.log.Warn("recovery", "op", s.ID, "problem", p.Detail)
	}
	var errs []error
	for _, a := range acts {
		switch a.Kind {
		case actFail:
			if err := c.o.Store.Fail(ctx, a.Checkpoint, "interrupted: the server stopped while taking it; its snapshots are deleted and the previous committed checkpoint is unchanged"); err != nil {
				errs = append(errs, err)
			}
		case actDeleteSnapshot:
			if err := retry(func() error { return c.o.Env.Provider.DeleteSnapshot(ctx, a.Snapshot) }); err != nil {
				errs = append(errs, fmt.Errorf("delete snapshot %s: %w", a.Snapshot, err))
			}
		case actContinue:
			if e, ok := c.Live(a.Episode); ok && e.SandboxID() == a.Sandbox {
				if err := c.continuePause(ctx, a.Episode, a.Seq); err != nil {
					errs = append(errs, err)
				}
			}
		case actClose:
			if len(errs) > 0 {
				return errors.Join(errs...)
			}
			if err := c.o.Store.CloseJournal(ctx, s.ID, nil); err != nil {
				return err
			}
			c.log.Warn("a prepare the last server was in the middle of is finished", "op", s.ID, "checkpoint", s.Checkpoint, "state", f.State)
		}
	}
	return nil
}
