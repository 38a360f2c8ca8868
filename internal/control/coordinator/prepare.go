package coordinator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"sync"

	"stasis/errdefs"
	"stasis/internal/control/checkpoint"
	"stasis/internal/control/episode"
	"stasis/internal/insandbox/supervisor"
	"stasis/internal/storage/store"
)

// The steps of a prepare, as the step hook sees them.
const (
	stepPause       = "pause"       // before an episode's pause is journaled and sent
	stepSnapshot    = "snapshot"    // the pause acknowledged, before the snapshot
	stepSnapshotted = "snapshotted" // the snapshot made, before its id is journaled
	stepRecord      = "record"      // before the episode's record is put
	stepRecorded    = "recorded"    // the episode's record put, before the checkpoint is committed
	stepCommit      = "commit"      // before the checkpoint is committed (or failed)
	stepContinue    = "continue"    // before an episode's pause is continued
	stepClose       = "close"       // before the journal is closed
)

// The steps of a start, as the step hook sees them.
const (
	stepStart   = "start"   // the start journaled, before anything is made
	stepStarted = "started" // the episode started, before its row is written
)

// Prepare takes checkpoint id of every live episode: each is paused (stop
// mode), snapshotted and recorded, with bounded concurrency; an episode
// whose harness has ended is recorded as finished with its verify result;
// then the checkpoint is committed (every record durable, then one atomic
// mark) and every paused episode continues. If any episode fails, the
// checkpoint is marked failed, the snapshots it made are deleted, and every
// episode continues; the previous committed checkpoint is untouched.
//
// An episode that cannot be checkpointed (its own failure: status, pause,
// snapshot) is a straggler: by default (StragglersExclude) the checkpoint
// is committed without it, its snapshot deleted, the episode continued and
// listed in the result as excluded with the reason, so one misbehaving
// episode does not hold every other one's checkpoint hostage, and the next
// checkpoint tries it again. With StragglersFail, or when no episode could
// be checkpointed, or when the record store fails, the checkpoint fails as
// above.
//
// Each pause and each snapshot is journaled before it is made: a prepare
// the server dies in is finished or undone by the next coordinator (New).
func (c *Coordinator) Prepare(ctx context.Context, id string) (Result, error) {
	return c.PrepareWith(ctx, id, PrepareOptions{})
}

// PrepareWith is Prepare with this checkpoint's options.
func (c *Coordinator) PrepareWith(ctx context.Context, id string, po PrepareOptions) (Result, error) {
	if err := CheckStragglers(po.Stragglers); err != nil {
		return Result{}, err
	}
	policy := po.Stragglers
	if policy == "" {
		policy = c.o.Stragglers
	}
	if policy == "" {
		policy = StragglersExclude
	}
	// The starts under way finish first (their episodes are in this
	// checkpoint); those asked from now on wait for it to end.
	c.starts.Lock()
	defer c.starts.Unlock()
	c.op.Lock()
	defer c.op.Unlock()
	start := c.clock.Now()
	ids := c.LiveIDs()
	fail := func(err error) {
		if po.Finish != nil {
			_, _ = po.Finish(context.WithoutCancel(ctx), 0, err)
		} else {
			_ = c.o.Store.Fail(context.WithoutCancel(ctx), id, err.Error())
		}
	}
	if po.Finish == nil {
		manifest, _ := json.Marshal(map[string]any{"episodes": ids, "provider": c.o.Env.Provider.Name()})
		if err := c.o.Store.Begin(ctx, id, manifest); err != nil {
			return Result{}, err
		}
	}
	res := Result{Checkpoint: id, Phases: map[string]float64{}}
	x := c.newOp(jPrepare)
	if err := x.note(ctx, jPrepare, "", jdoc{Checkpoint: id}); err != nil {
		fail(err)
		return res, fmt.Errorf("checkpoint %s failed: %w", id, err)
	}
	results, figs, paused := c.prepareAll(ctx, x, id, ids)
	if x.dead() {
		return res, c.crashed(x)
	}
	out := decidePrepare(policy, ids, results)
	res.Phases["prepare"] = c.since(start)
	if err := x.step(stepCommit, ""); err != nil {
		return res, c.crashed(x)
	}
	err := out.Err
	switch {
	case err != nil:
		fail(err)
	case po.Finish != nil:
		t := c.clock.Now()
		var st store.State
		if st, err = po.Finish(ctx, out.Records, nil); err == nil && st == store.StateFailed {
			err = errdefs.Errorf(errdefs.ErrConflict, "the checkpoint failed as this node finished its share (another node's share failed, or the records did not add up)")
		}
		res.Phases["commit"] = c.since(t)
	default:
		t := c.clock.Now()
		err = c.o.Store.Commit(ctx, id, out.Records)
		res.Phases["commit"] = c.since(t)
		c.progress(Progress{Phase: "commit", Done: 1, Total: 1})
	}
	t := c.clock.Now()
	cerr := c.continueAll(ctx, x, paused)
	res.Phases["continue"] = c.since(t)
	if x.dead() {
		return res, c.crashed(x)
	}
	doomed := out.DeleteSnapshots
	if err != nil && out.Commit {
		// The commit itself failed: no record names any snapshot.
		doomed = madeSnapshots(results)
	}
	c.deleteSnapshots(ctx, id, doomed)
	for eid, why := range out.Excluded {
		c.log.Warn("checkpoint without an episode that could not be checkpointed", "checkpoint", id, "episode", eid, "reason", why)
		figs[eid] = EpisodeFigures{Episode: eid, Excluded: true, Reason: why}
	}
	if err := x.step(stepClose, ""); err != nil {
		return res, c.crashed(x)
	}
	if jerr := x.close(ctx, nil); jerr != nil {
		// The next coordinator finishes it (it deletes nothing a record
		// names, and continues the pauses again).
		c.log.Warn("close the journal of a prepare", "checkpoint", id, "err", jerr)
	}
	if err != nil {
		return res, fmt.Errorf("checkpoint %s failed: %w", id, errors.Join(err, cerr))
	}
	for _, eid := range ids {
		res.Episodes = append(res.Episodes, figs[eid])
	}
	res.Seconds = c.since(start)
	return res, cerr
}

// madeSnapshots is every snapshot a prepare made, sorted.
func madeSnapshots(results map[string]prepareResult) []string {
	var out []string
	for _, r := range results {
		if r.Snapshot != "" {
			out = append(out, r.Snapshot)
		}
	}
	sort.Strings(out)
	return out
}

// DeleteSnapshots deletes snapshots that checkpoint ckpt made and that no
// checkpoint names (a checkpoint over several nodes that failed after this
// node's share was in), retrying transient failures.
func (c *Coordinator) DeleteSnapshots(ctx context.Context, ckpt string, snaps []string) {
	c.deleteSnapshots(ctx, ckpt, snaps)
}

// deleteSnapshots deletes snapshots no checkpoint names, retrying
// transient failures.
func (c *Coordinator) deleteSnapshots(ctx context.Context, ckpt string, snaps []string) {
	for _, err := range c.removeSnapshots(context.WithoutCancel(ctx), snaps) {
		c.log.Warn("delete snapshots no checkpoint names", "checkpoint", ckpt, "err", err)
	}
}

// prepareAll pauses, snapshots and records every episode of ids into
// checkpoint id, with bounded concurrency. paused: the pause in force of
// each episode paused.
func (c *Coordinator) prepareAll(ctx context.Context, x *op, id string, ids []string) (map[string]prepareResult, map[string]EpisodeFigures, map[string]int64) {
	var (
		mu      sync.Mutex
		results = map[string]prepareResult{}
		figs    = map[string]EpisodeFigures{}
		paused  = map[string]int64{}
	)
	_ = c.each(ids, "prepare", func(eid string) error {
		f, seq, rec, err := c.prepareOne(ctx, x, eid)
		r := prepareResult{Episode: eid, Snapshot: f.Snapshot, Err: err, Cancelled: err != nil && ctx.Err() != nil}
		if err == nil {
			if r.Err = x.step(stepRecord, eid); r.Err == nil {
				if perr := c.o.Store.Put(ctx, id, rec); perr != nil {
					r.Err = fmt.Errorf("episode %s: %w: %w", eid, errRecord, perr)
				} else {
					r.Recorded = true
					r.Err = x.step(stepRecorded, eid)
				}
			}
		}
		mu.Lock()
		defer mu.Unlock()
		results[eid] = r
		if seq > 0 {
			paused[eid] = seq
		}
		if r.Err == nil {
			figs[eid] = f
		}
		return r.Err
	})
	return results, figs, paused
}

// prepareOne pauses and snapshots one episode and makes its record. seq
// is the pause in force (0 when none).
func (c *Coordinator) prepareOne(ctx context.Context, x *op, eid string) (f EpisodeFigures, seq int64, rec store.Record, err error) {
	f.Episode = eid
	if err := x.step(stepPause, eid); err != nil {
		return f, 0, rec, err
	}
	e, ok := c.Live(eid)
	if !ok {
		return f, 0, rec, errdefs.Errorf(errdefs.ErrConflict, "episode %s is not live", eid)
	}
	row, err := c.o.Store.GetEpisode(ctx, eid)
	if err != nil {
		return f, 0, rec, err
	}
	st, err := e.Status(ctx)
	if err != nil {
		return f, 0, rec, fmt.Errorf("episode %s: status: %w", eid, err)
	}
	if st.State == supervisor.StateExited {
		rec, err = c.finishedRecord(ctx, e, row)
		f.Finished = true
		return f, 0, rec, err
	}
	seq = row.PauseSeq + 1
	row.PauseSeq = seq
	if err := c.o.Store.PutEpisode(ctx, row); err != nil {
		return f, 0, rec, err
	}
	if err := x.note(ctx, jPause, eid, jdoc{Sandbox: e.SandboxID(), Seq: seq, Name: e.SnapshotName(seq)}); err != nil {
		return f, 0, rec, fmt.Errorf("episode %s: %w", eid, err)
	}
	snap, err := e.PauseAndSnapshotWith(ctx, seq, func() error { return x.step(stepSnapshot, eid) })
	if err != nil {
		if x.dead() {
			return f, seq, rec, err
		}
		if checkpoint.IsRefused(err) {
			// The harness ended between the status and the pause, or the
			// supervisor's sequence is past ours (burned from inside the
			// sandbox, or another controller): then no pause is in force,
			// and the episode cannot be recorded.
			if st2, serr := e.Status(ctx); serr == nil && st2.State == supervisor.StateExited {
				rec, err = c.finishedRecord(ctx, e, row)
				f.Finished = true
				return f, 0, rec, err
			}
			return f, 0, rec, fmt.Errorf("episode %s: its supervisor refused pause %d, yet its harness runs (a sequence ahead of the server's, burned from inside the sandbox?): %w", eid, seq, err)
		}
		// The pause may be in force; continue it with the rest.
		return f, seq, rec, fmt.Errorf("episode %s: %w", eid, err)
	}
	if err := x.step(stepSnapshotted, eid); err != nil {
		return f, seq, rec, err
	}
	f.Snapshot = snap.ID
	if err := x.note(ctx, jSnapshot, eid, jdoc{Snapshot: snap.ID}); err != nil {
		return f, seq, rec, fmt.Errorf("episode %s: %w", eid, err)
	}
	f.PauseS, f.SnapshotS = snap.Pause.Seconds(), snap.Took.Seconds()
	if info, err := c.o.Env.Provider.GetSnapshot(ctx, snap.ID); err == nil {
		f.Bytes, f.NewBytes = info.Bytes, info.NewBytes
	}
	return f, seq, pauseRecord(snap, row, e.SandboxID()), nil
}

// pauseRecord is the record of a paused episode's snapshot.
func pauseRecord(snap episode.Snapshot, row store.Episode, sandboxID string) store.Record {
	s := snap.State
	pw, pu := s.PauseWall, s.PauseUptime
	id := s.Identity
	rec := store.Record{
		Schema: store.RecordSchema, Episode: row.ID, Provider: s.Provider, Sandbox: s.Descriptor,
		SnapshotID: snap.ID, KeepsProcesses: s.KeepsProcesses, PauseSeq: s.PauseSeq, PauseMode: string(s.PauseMode),
		PauseConfirmed: s.PauseConfirmed, PauseFrozen: s.PauseFrozen, Identity: &id, PauseWall: &pw, PauseUptime: &pu,
		RelayDelivered: s.RelayDelivered, RelayPosition: s.RelayPosition, RelayUnmatched: s.RelayUnmatched, LedgerHead: s.LedgerHead, LedgerTip: s.LedgerTip, HarnessSession: s.HarnessSession, Attempt: s.Attempt, DeadlineLeftS: s.DeadlineLeftS,
		Image: s.Image, ImageRef: row.Image,
	}
	if len(rec.Sandbox) == 0 {
		rec.Sandbox, _ = json.Marshal(map[string]string{"id": sandboxID})
	}
	return rec
}

// finishedRecord verifies an ended episode (capture once) and records it
// as finished, with its ledger's tip: a restore of the checkpoint takes
// the ledger back to the history the verdict was made on.
func (c *Coordinator) finishedRecord(ctx context.Context, e *episode.Episode, row store.Episode) (store.Record, error) {
	v, _, err := e.Verify(ctx)
	if err != nil {
		return store.Record{}, err
	}
	c.MarkEnded(ctx, row.ID)
	doc, err := json.Marshal(v)
	if err != nil {
		return store.Record{}, err
	}
	tip, err := c.o.Env.Gateway.Tip(row.ID)
	if err != nil {
		return store.Record{}, fmt.Errorf("episode %s: its ledger's tip: %w", row.ID, err)
	}
	desc, _ := json.Marshal(map[string]string{"id": e.SandboxID()})
	return store.Record{
		Schema: store.RecordSchema, Episode: row.ID, Provider: row.Provider, Sandbox: desc,
		Attempt: e.Attempt(), Finished: true, Result: doc, LedgerTip: tip.Hash,
	}, nil
}

// continueAll continues the pause in force of each episode in paused
// that is live.
func (c *Coordinator) continueAll(ctx context.Context, x *op, paused map[string]int64) error {
	ids := make([]string, 0, len(paused))
	for id := range paused {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	return c.each(ids, "continue", func(id string) error {
		if err := x.step(stepContinue, id); err != nil {
			return err
		}
		return c.continuePause(ctx, id, paused[id])
	})
}

// continuePause continues pause seq of live episode id (a repeated or
// stale continue is answered, not failed). It is retried: an episode must
// not stay paused because one exec failed.
func (c *Coordinator) continuePause(ctx context.Context, id string, seq int64) error {
	e, ok := c.Live(id)
	if !ok {
		return nil
	}
	err := retry(func() error {
		if _, err := e.Session().Continue(context.WithoutCancel(ctx), seq); err != nil && !checkpoint.IsRefused(err) {
			return err
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("episode %s: continue %d: %w", id, seq, err)
	}
	return nil
}

// crashed is the error of an operation the step hook crashed.
func (c *Coordinator) crashed(x *op) error {
	return fmt.Errorf("%s %s: %w", x.kind, x.id, errCrashed)
}
