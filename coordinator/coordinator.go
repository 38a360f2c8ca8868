// Package coordinator owns checkpoints of many episodes at once: starting
// episodes, Prepare (pause, snapshot and record every live episode with
// bounded concurrency, commit in one atomic step, continue), Restore
// (validate every record before touching a provider, fork every snapshot,
// then resume each episode in place or relaunch it, all or nothing), and
// Retire. Its durable state is the record store: episodes, checkpoints,
// records and verdicts, so a coordinator made on the same store after a
// crash or a restart finds the live episodes again.
//
// It sits above package episode (one episode on a provider) rather than in
// package checkpoint, which episode itself builds on.
package coordinator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"time"

	"stasis/checkpoint"
	"stasis/episode"
	"stasis/errdefs"
	"stasis/harness"
	"stasis/image"
	"stasis/relay"
	"stasis/sandbox"
	"stasis/store"
	"stasis/supervisor"
	"stasis/task"
)

// Options configure a Coordinator.
type Options struct {
	Env   *episode.Env
	Store store.Store
	// Tasks are the tasks episodes may name.
	Tasks []*task.Task
	// Concurrency bounds the episodes worked on at once in a prepare or a
	// restore (default 64). A restore spends most of its time waiting for
	// processes to start inside the sandboxes, so it gains from many at
	// once (stasis bench checkpoint).
	Concurrency int
	// Stragglers is what a checkpoint does with an episode that cannot be
	// paused, snapshotted or recorded (its supervisor refuses the pause,
	// its sequence is burned, its sandbox fails): StragglersExclude (the
	// default) commits the checkpoint without it, naming it and the reason
	// in the result; StragglersFail fails the checkpoint, naming it.
	Stragglers string
	// PullImages: a restore whose records name an image that is no
	// longer on this host pulls it again from the reference it was pulled
	// as (when that is a source, not a bare digest); otherwise such a
	// restore is refused before it touches the provider, saying how to
	// pull it.
	PullImages bool
	// Progress, when set, is told of each episode done in a phase.
	Progress func(Progress)
	Logger   *slog.Logger
}

// ImageStore is implemented by providers whose sandboxes run on images
// kept on this host (local): a restore checks that each record's image is
// still there before it forks anything.
type ImageStore interface {
	Images() *image.Store
}

// Straggler policies (Options.Stragglers, PrepareOptions.Stragglers).
const (
	StragglersExclude = "exclude"
	StragglersFail    = "fail"
)

// ErrStraggler is in the error of a checkpoint that failed because an
// episode could not be checkpointed (StragglersFail, or every episode
// straggled); the message names the episode and why.
var ErrStraggler = errdefs.Errorf(errdefs.ErrConflict, "an episode could not be checkpointed")

// ErrRefused is in the error of a restore or a branch that its validation
// refused before it touched anything (a missing snapshot or image, a live
// episode, a copy's name taken): nothing was changed. It is a conflict.
var ErrRefused = errdefs.Errorf(errdefs.ErrConflict, "refused; nothing was changed")

// refused is a validation's error: its message as written, matching
// ErrRefused and errdefs.ErrConflict.
type refused struct{ msg string }

func (e refused) Error() string { return e.msg }
func (e refused) Is(target error) bool {
	return target == ErrRefused || target == errdefs.ErrConflict
}

// CheckStragglers refuses an unknown straggler policy ("" is the default).
func CheckStragglers(policy string) error {
	switch policy {
	case "", StragglersExclude, StragglersFail:
		return nil
	}
	return errdefs.Errorf(errdefs.ErrInvalid, "stragglers %q: use %s (commit without the episodes that cannot be checkpointed, naming them) or %s (fail the checkpoint)", policy, StragglersExclude, StragglersFail)
}

// PrepareOptions are one checkpoint's choices.
type PrepareOptions struct {
	// Stragglers overrides Options.Stragglers for this checkpoint.
	Stragglers string
}

// Progress reports one step of a long operation.
type Progress struct {
	Phase   string // start, prepare, commit, continue, validate, fork, resume
	Episode string
	Done    int
	Total   int
}

// Coordinator drives the episodes of one record store.
type Coordinator struct {
	o   Options
	log *slog.Logger

	mu   sync.Mutex
	live map[string]*episode.Episode
	// op serialises prepares, restores and retires.
	op sync.Mutex
}

// New makes a coordinator over the store and finds its episodes again:
// each running or ended one whose sandbox still runs is attached; one whose
// sandbox is gone or dead (a crash took it) is marked lost, for a restore
// to bring back (an ended one whose verdict is captured stays ended), and
// what is left of its sandbox is deleted.
func New(ctx context.Context, o Options) (*Coordinator, error) {
	if o.Env == nil || o.Store == nil {
		return nil, errors.New("coordinator: an episode environment and a store are needed")
	}
	if o.Concurrency <= 0 {
		o.Concurrency = 64
	}
	c := &Coordinator{o: o, log: o.Logger, live: map[string]*episode.Episode{}}
	if c.log == nil {
		c.log = slog.New(slog.DiscardHandler)
	}
	var rows []store.Episode
	// An ended episode keeps its sandbox (for verify) until it is retired.
	for _, state := range []store.EpisodeState{store.EpisodeRunning, store.EpisodeEnded} {
		rs, err := o.Store.ListEpisodes(ctx, state)
		if err != nil {
			return nil, err
		}
		rows = append(rows, rs...)
	}
	for _, r := range rows {
		spec, err := c.specOf(r)
		if err != nil {
			return nil, err
		}
		e, err := episode.Attach(ctx, o.Env, spec, r.Sandbox, r.Attempt)
		if err == nil {
			c.live[r.ID] = e
			continue
		}
		if !errors.Is(err, errdefs.ErrNotFound) && !errors.Is(err, errdefs.ErrExpired) && !errors.Is(err, errdefs.ErrConflict) {
			return nil, err
		}
		c.log.Warn("episode lost: its sandbox is gone", "episode", r.ID, "sandbox", r.Sandbox, "err", err)
		gone := errors.Is(err, errdefs.ErrNotFound)
		if !gone {
			// Expired, or its keeper died: delete what is left of it. If
			// that fails, the row keeps naming it and Retire deletes it.
			if derr := c.deleteSandbox(ctx, r.Sandbox); derr != nil {
				c.log.Warn("delete a dead sandbox", "episode", r.ID, "sandbox", r.Sandbox, "err", derr)
			} else {
				gone = true
			}
		}
		if gone {
			r.Sandbox = ""
		}
		// An ended episode whose verdict is captured lost nothing but its
		// sandbox; any other needs a restore.
		if _, verr := o.Store.GetVerdict(ctx, r.ID, r.Attempt); r.State != store.EpisodeEnded || verr != nil {
			r.State = store.EpisodeLost
		}
		if err := o.Store.PutEpisode(ctx, r); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// retry is checkpoint.Retry: cleanups must not leave a sandbox, a snapshot or
// a paused harness behind because of one transient failure.
var retry = checkpoint.Retry

// deleteSandbox deletes a sandbox the coordinator owns, unless it is
// already gone (a session that failed deletes its own), retrying transient
// failures: every sandbox is deleted once.
func (c *Coordinator) deleteSandbox(ctx context.Context, id string) error {
	ctx = context.WithoutCancel(ctx)
	return retry(func() error {
		if _, err := c.o.Env.Provider.Get(ctx, id); errors.Is(err, errdefs.ErrNotFound) {
			return nil
		}
		return c.o.Env.Provider.Delete(ctx, id)
	})
}

func (c *Coordinator) spec(id, taskID, harnessName string, deadlineS float64, limits sandbox.Limits, img string) (episode.Spec, error) {
	t, err := task.Lookup(c.o.Tasks, taskID)
	if err != nil {
		return episode.Spec{}, fmt.Errorf("episode %s: %w", id, err)
	}
	a, err := harness.New(harnessName)
	if err != nil {
		return episode.Spec{}, fmt.Errorf("episode %s: %w", id, err)
	}
	spec := episode.Spec{ID: id, Task: t, Harness: a, Deadline: time.Duration(deadlineS * float64(time.Second)), Limits: limits, Image: img}
	spec.Image = c.o.Env.ImageOf(spec)
	return spec, nil
}

// specOf is the spec of a stored episode; a copy branched from another
// episode's checkpoint keeps that episode's paths in its sandbox.
func (c *Coordinator) specOf(row store.Episode) (episode.Spec, error) {
	id := row.ID
	if row.Origin != "" {
		id = row.Origin
	}
	spec, err := c.spec(id, row.Task, row.Harness, row.DeadlineS, row.Limits, row.Image)
	if row.Origin != "" {
		spec.Name = row.ID
	}
	return spec, err
}

func (c *Coordinator) progress(p Progress) {
	if c.o.Progress != nil {
		c.o.Progress(p)
	}
}

// Start starts an episode of a task with a harness, on the task's budget.
func (c *Coordinator) Start(ctx context.Context, id, taskID, harnessName string) (store.Episode, error) {
	return c.StartWithDeadline(ctx, id, taskID, harnessName, 0)
}

// StartWithDeadline is Start with the harness's time budget given (0: the
// task's); the store keeps it, so re-attaches and relaunches keep it too.
func (c *Coordinator) StartWithDeadline(ctx context.Context, id, taskID, harnessName string, deadline time.Duration) (store.Episode, error) {
	return c.StartWith(ctx, id, taskID, harnessName, StartOptions{Deadline: deadline})
}

// StartOptions are one episode's choices beyond its task and harness.
type StartOptions struct {
	// Deadline is the harness's time budget (0: the task's).
	Deadline time.Duration
	// Limits bound its sandbox (zero fields: the provider's defaults).
	Limits sandbox.Limits
	// Image is its sandboxes' image (empty: its task's, then the
	// environment's default).
	Image string
}

// StartWith is Start with o's choices; the store keeps them, so
// re-attaches, relaunches and restores keep them too.
func (c *Coordinator) StartWith(ctx context.Context, id, taskID, harnessName string, o StartOptions) (store.Episode, error) {
	deadline := o.Deadline
	if deadline < 0 {
		return store.Episode{}, errdefs.Errorf(errdefs.ErrInvalid, "episode %s: the deadline %s is negative", id, deadline)
	}
	if err := o.Limits.Check(); err != nil {
		return store.Episode{}, fmt.Errorf("episode %s: %w", id, err)
	}
	spec, err := c.spec(id, taskID, harnessName, deadline.Seconds(), o.Limits, o.Image)
	if err != nil {
		return store.Episode{}, err
	}
	if _, err := c.o.Store.GetEpisode(ctx, id); err == nil {
		return store.Episode{}, fmt.Errorf("episode %s: %w", id, errdefs.ErrExists)
	}
	e, err := episode.Start(ctx, c.o.Env, spec)
	if err != nil {
		return store.Episode{}, err
	}
	row := store.Episode{ID: id, Task: taskID, Harness: harnessName, Provider: c.o.Env.Provider.Name(), Sandbox: e.SandboxID(), State: store.EpisodeRunning, DeadlineS: deadline.Seconds(), Limits: o.Limits, Image: spec.Image, Environment: e.Environment().String()}
	if err := c.o.Store.PutEpisode(ctx, row); err != nil {
		_ = e.Close(context.WithoutCancel(ctx))
		return store.Episode{}, err
	}
	c.mu.Lock()
	c.live[id] = e
	c.mu.Unlock()
	return c.o.Store.GetEpisode(ctx, id)
}

// Live returns the live episode id, if any.
func (c *Coordinator) Live(id string) (*episode.Episode, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.live[id]
	return e, ok
}

// LiveIDs lists the live episodes, sorted.
func (c *Coordinator) LiveIDs() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	ids := make([]string, 0, len(c.live))
	for id := range c.live {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	return ids
}

// Verify verifies an episode once its harness has ended (capture once).
func (c *Coordinator) Verify(ctx context.Context, id string) (task.Verdict, bool, error) {
	if e, ok := c.Live(id); ok {
		v, rec, err := e.Verify(ctx)
		if err == nil {
			c.MarkEnded(ctx, id)
		}
		return v, rec, err
	}
	row, err := c.o.Store.GetEpisode(ctx, id)
	if err != nil {
		return task.Verdict{}, false, err
	}
	v, ok, err := c.o.Env.Verifier.Recorded(ctx, id, row.Attempt)
	if err != nil {
		return task.Verdict{}, false, err
	}
	if !ok {
		return task.Verdict{}, false, errdefs.Errorf(errdefs.ErrConflict, "episode %s (attempt %d) is not live and was never verified: restore it first", id, row.Attempt)
	}
	return v, true, nil
}

// MarkEnded records that a running episode's harness has ended (its
// sandbox stays, for verify). Other states are left as they are.
func (c *Coordinator) MarkEnded(ctx context.Context, id string) {
	row, err := c.o.Store.GetEpisode(ctx, id)
	if err == nil && row.State == store.EpisodeRunning {
		row.State = store.EpisodeEnded
		_ = c.o.Store.PutEpisode(ctx, row)
	}
}

// EpisodeFigures are one episode's part of a prepare or a restore.
type EpisodeFigures struct {
	Episode   string  `json:"episode"`
	Finished  bool    `json:"finished,omitempty"`
	Snapshot  string  `json:"snapshot,omitempty"`
	PauseS    float64 `json:"pause_s,omitempty"`
	SnapshotS float64 `json:"snapshot_s,omitempty"`
	Bytes     int64   `json:"bytes,omitempty"`
	NewBytes  int64   `json:"new_bytes,omitempty"`
	Resume    string  `json:"resume,omitempty"` // in_place | relaunch | none
	// ResumeWhy says why an episode was relaunched (its snapshot did not
	// keep processes, or the fork's supervisor was not the recorded
	// launch).
	ResumeWhy string `json:"resume_why,omitempty"`
	// Clock is what a resume in place did to the guest's wall clock.
	Clock  *episode.ClockFix `json:"clock,omitempty"`
	Reward *int              `json:"reward,omitempty"`
	// Excluded: the checkpoint was committed without this episode
	// (Options.Stragglers), for Reason; it has no record in it and goes on
	// running.
	Excluded bool   `json:"excluded,omitempty"`
	Reason   string `json:"reason,omitempty"`
}

// Result is a prepare's or a restore's outcome.
type Result struct {
	Checkpoint string           `json:"checkpoint"`
	Episodes   []EpisodeFigures `json:"episodes"`
	// Seconds per phase: pause+snapshot+record (prepare), commit,
	// continue; validate, fork, resume (restore).
	Phases  map[string]float64 `json:"phases"`
	Seconds float64            `json:"seconds"`
}

// each runs fn for every id with bounded concurrency, reporting progress,
// and returns the errors joined.
func (c *Coordinator) each(ids []string, phase string, fn func(id string) error) error {
	sem := make(chan struct{}, c.o.Concurrency)
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
		done int
	)
	for _, id := range ids {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			err := fn(id)
			mu.Lock()
			done++
			if err != nil {
				errs = append(errs, err)
			}
			n := done
			mu.Unlock()
			c.progress(Progress{Phase: phase, Episode: id, Done: n, Total: len(ids)})
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

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
	c.op.Lock()
	defer c.op.Unlock()
	start := time.Now()
	ids := c.LiveIDs()
	manifest, _ := json.Marshal(map[string]any{"episodes": ids, "provider": c.o.Env.Provider.Name()})
	if err := c.o.Store.Begin(ctx, id, manifest); err != nil {
		return Result{}, err
	}
	res := Result{Checkpoint: id, Phases: map[string]float64{}}
	var (
		mu      sync.Mutex
		figs    = map[string]EpisodeFigures{}
		paused  = map[string]int64{} // episode → pause seq in force
		snaps   []string
		records int
		// Stragglers excluded, with the snapshots made of them.
		excluded      = map[string]string{}
		excludedSnaps []string
	)
	err := c.each(ids, "prepare", func(eid string) error {
		f, seq, rec, err := c.prepareOne(ctx, eid)
		mu.Lock()
		defer mu.Unlock()
		if seq > 0 {
			paused[eid] = seq
		}
		if err != nil && policy == StragglersExclude && ctx.Err() == nil {
			excluded[eid] = err.Error()
			if f.Snapshot != "" {
				excludedSnaps = append(excludedSnaps, f.Snapshot)
			}
			return nil
		}
		if f.Snapshot != "" {
			snaps = append(snaps, f.Snapshot)
		}
		if err != nil {
			if ctx.Err() == nil {
				return fmt.Errorf("%w: %w", ErrStraggler, err)
			}
			return err
		}
		figs[eid] = f
		if err := c.o.Store.Put(ctx, id, rec); err != nil {
			return fmt.Errorf("episode %s: record: %w", eid, err)
		}
		records++
		return nil
	})
	if err == nil && len(ids) > 0 && records == 0 {
		// Nothing to commit: every episode straggled.
		var why []error
		for _, eid := range ids {
			why = append(why, errors.New(excluded[eid]))
		}
		err = fmt.Errorf("%w: none could: %w", ErrStraggler, errors.Join(why...))
		snaps = append(snaps, excludedSnaps...)
		excludedSnaps = nil
	}
	for _, s := range excludedSnaps {
		if derr := retry(func() error { return c.o.Env.Provider.DeleteSnapshot(context.WithoutCancel(ctx), s) }); derr != nil {
			c.log.Warn("delete the snapshot of an excluded episode", "snapshot", s, "err", derr)
		}
	}
	for eid, why := range excluded {
		c.log.Warn("checkpoint without an episode that could not be checkpointed", "checkpoint", id, "episode", eid, "reason", why)
		figs[eid] = EpisodeFigures{Episode: eid, Excluded: true, Reason: why}
	}
	res.Phases["prepare"] = time.Since(start).Seconds()
	if err == nil {
		t := time.Now()
		err = c.o.Store.Commit(ctx, id, records)
		res.Phases["commit"] = time.Since(t).Seconds()
		c.progress(Progress{Phase: "commit", Done: 1, Total: 1})
	} else {
		_ = c.o.Store.Fail(context.WithoutCancel(ctx), id, err.Error())
	}
	t := time.Now()
	cerr := c.continueAll(ctx, paused)
	res.Phases["continue"] = time.Since(t).Seconds()
	if err != nil {
		for _, s := range snaps {
			if derr := retry(func() error { return c.o.Env.Provider.DeleteSnapshot(context.WithoutCancel(ctx), s) }); derr != nil {
				c.log.Warn("delete a snapshot of a failed checkpoint", "snapshot", s, "err", derr)
			}
		}
		return res, fmt.Errorf("checkpoint %s failed: %w", id, errors.Join(err, cerr))
	}
	for _, eid := range ids {
		res.Episodes = append(res.Episodes, figs[eid])
	}
	res.Seconds = time.Since(start).Seconds()
	return res, cerr
}

// prepareOne pauses, snapshots and records one episode. seq is the pause
// in force (0 when none).
func (c *Coordinator) prepareOne(ctx context.Context, eid string) (f EpisodeFigures, seq int64, rec store.Record, err error) {
	f.Episode = eid
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
	snap, err := e.PauseAndSnapshot(ctx, seq, false)
	if err != nil {
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
	f.PauseS, f.SnapshotS = snap.Pause.Seconds(), snap.Took.Seconds()
	f.Snapshot = snap.ID
	if info, err := c.o.Env.Provider.GetSnapshot(ctx, snap.ID); err == nil {
		f.Bytes, f.NewBytes = info.Bytes, info.NewBytes
	}
	s := snap.State
	pw, pu := s.PauseWall, s.PauseUptime
	id := s.Identity
	rec = store.Record{
		Schema: store.RecordSchema, Episode: eid, Provider: s.Provider, Sandbox: s.Descriptor,
		SnapshotID: snap.ID, KeepsProcesses: s.KeepsProcesses, PauseSeq: s.PauseSeq, PauseMode: string(s.PauseMode),
		PauseConfirmed: s.PauseConfirmed, PauseFrozen: s.PauseFrozen, Identity: &id, PauseWall: &pw, PauseUptime: &pu,
		RelayDelivered: s.RelayDelivered, RelayPosition: s.RelayPosition, LedgerHead: s.LedgerHead, HarnessSession: s.HarnessSession, Attempt: s.Attempt, DeadlineLeftS: s.DeadlineLeftS,
		Image: s.Image, ImageRef: row.Image,
	}
	if len(rec.Sandbox) == 0 {
		rec.Sandbox, _ = json.Marshal(map[string]string{"id": e.SandboxID()})
	}
	return f, seq, rec, nil
}

// finishedRecord verifies an ended episode (capture once) and records it
// as finished.
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
	desc, _ := json.Marshal(map[string]string{"id": e.SandboxID()})
	return store.Record{
		Schema: store.RecordSchema, Episode: row.ID, Provider: row.Provider, Sandbox: desc,
		Attempt: e.Attempt(), Finished: true, Result: doc,
	}, nil
}

func (c *Coordinator) continueAll(ctx context.Context, paused map[string]int64) error {
	ids := make([]string, 0, len(paused))
	for id := range paused {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	return c.each(ids, "continue", func(id string) error {
		e, ok := c.Live(id)
		if !ok {
			return nil
		}
		// Retried: an episode must not stay paused because one exec failed
		// (a repeated continue is answered with its acknowledgement).
		err := retry(func() error {
			if _, err := e.Session().Continue(context.WithoutCancel(ctx), paused[id]); err != nil && !checkpoint.IsRefused(err) {
				return err
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("episode %s: continue %d: %w", id, paused[id], err)
		}
		return nil
	})
}

// checkImage makes sure the image a record's sandbox ran on is on this
// host, pulling it again when Options.PullImages allows.
func (c *Coordinator) checkImage(ctx context.Context, r store.Record) error {
	is, ok := c.o.Env.Provider.(ImageStore)
	if r.Image == "" || !ok {
		return nil
	}
	_, err := is.Images().Get(r.Image)
	if err == nil || !errors.Is(err, image.ErrNotFound) {
		return err
	}
	ref, perr := image.ParseRef(r.ImageRef)
	pullable := perr == nil && ref.Pullable()
	if !pullable {
		return fmt.Errorf("episode %s: its image %s is no longer on this host, and its record names no source to pull it from", r.Episode, r.Image)
	}
	if !c.o.PullImages {
		return fmt.Errorf("episode %s: its image %s is no longer on this host: pull it with `stasis image pull %s`, or start the server with --pull-images", r.Episode, r.Image, r.ImageRef)
	}
	im, err := is.Images().Pull(ctx, r.ImageRef, nil)
	if err != nil {
		return fmt.Errorf("episode %s: pull its image again from %s: %w", r.Episode, r.ImageRef, err)
	}
	if im.Digest != r.Image {
		return fmt.Errorf("episode %s: %s is now image %s, not the %s it ran on; pull that image by another reference", r.Episode, r.ImageRef, im.Digest, r.Image)
	}
	return nil
}

// Restore brings back every episode of committed checkpoint id. Every
// record is checked first, before any provider is touched; then every
// snapshot is forked; then each episode resumes in place (its snapshot kept
// the processes and the fork's supervisor shows the recorded identity) or
// is relaunched from its saved session, with the ledger cut or matched and
// the attempt raised. All or nothing: if any step fails, every sandbox the
// restore made is deleted and no episode's record in the store changes.
func (c *Coordinator) Restore(ctx context.Context, id string) (Result, error) {
	c.op.Lock()
	defer c.op.Unlock()
	start := time.Now()
	res := Result{Checkpoint: id, Phases: map[string]float64{}}
	recs, err := c.committed(ctx, id, "restores")
	if err != nil {
		return res, err
	}
	// Validate everything first.
	var problems []string
	specs := map[string]episode.Spec{}
	for _, r := range recs {
		if r.Provider != c.o.Env.Provider.Name() {
			problems = append(problems, fmt.Sprintf("episode %s: recorded on provider %s, this coordinator runs %s", r.Episode, r.Provider, c.o.Env.Provider.Name()))
		}
		if _, live := c.Live(r.Episode); live {
			problems = append(problems, fmt.Sprintf("episode %s is live: retire it before restoring it", r.Episode))
		}
		row, err := c.o.Store.GetEpisode(ctx, r.Episode)
		if err != nil {
			problems = append(problems, fmt.Sprintf("episode %s: %v", r.Episode, err))
			continue
		}
		spec, err := c.specOf(row)
		if err != nil {
			problems = append(problems, err.Error())
			continue
		}
		specs[r.Episode] = spec
		if !r.Finished {
			problems = append(problems, c.forkProblems(ctx, r)...)
		}
	}
	res.Phases["validate"] = time.Since(start).Seconds()
	c.progress(Progress{Phase: "validate", Done: 1, Total: 1})
	if len(problems) > 0 {
		return res, refused{fmt.Sprintf("checkpoint %s cannot be restored; nothing was changed:\n  %s", id, strings.Join(problems, "\n  "))}
	}

	// Fork every snapshot.
	t := time.Now()
	var (
		mu    sync.Mutex
		forks = map[string]string{}
	)
	toFork := []string{}
	byEp := map[string]store.Record{}
	for _, r := range recs {
		byEp[r.Episode] = r
		if !r.Finished {
			toFork = append(toFork, r.Episode)
		}
	}
	// cleanup deletes every fork, once: a relaunch that failed may have
	// deleted its own already.
	cleanup := func() {
		mu.Lock()
		defer mu.Unlock()
		for _, sb := range forks {
			if err := c.deleteSandbox(ctx, sb); err != nil {
				c.log.Warn("delete a fork of a failed restore", "sandbox", sb, "err", err)
			}
		}
	}
	err = c.each(toFork, "fork", func(eid string) error {
		r := byEp[eid]
		fs, err := c.o.Env.Provider.Fork(ctx, r.SnapshotID, 1, episode.ForkSpec(specs[eid]))
		if err != nil {
			return fmt.Errorf("episode %s: fork %s: %w", eid, r.SnapshotID, err)
		}
		mu.Lock()
		forks[eid] = fs[0].ID
		mu.Unlock()
		return nil
	})
	res.Phases["fork"] = time.Since(t).Seconds()
	if err != nil {
		cleanup()
		return res, fmt.Errorf("checkpoint %s: restore failed, every fork deleted, nothing changed: %w", id, err)
	}

	// Resume or relaunch each.
	t = time.Now()
	resumed := map[string]*episode.Episode{}
	figs := map[string]EpisodeFigures{}
	err = c.each(toFork, "resume", func(eid string) error {
		mu.Lock()
		sb := forks[eid]
		mu.Unlock()
		e, f, err := c.continueFork(ctx, specs[eid], sb, byEp[eid], "")
		if err != nil {
			return err
		}
		mu.Lock()
		resumed[eid], figs[eid] = e, f
		mu.Unlock()
		return nil
	})
	res.Phases["resume"] = time.Since(t).Seconds()
	if err != nil {
		cleanup()
		return res, fmt.Errorf("checkpoint %s: restore failed, every sandbox it made deleted: %w", id, err)
	}

	// Commit the new state of every episode, in one transaction; if that
	// fails, nothing is installed.
	rows := make([]store.Episode, 0, len(recs))
	for _, r := range recs {
		row, _ := c.o.Store.GetEpisode(ctx, r.Episode)
		f := EpisodeFigures{Episode: r.Episode, Finished: r.Finished, Resume: "none"}
		if r.Finished {
			// It ended before the checkpoint: no sandbox, its verdict (of
			// the attempt that ended) kept.
			row.State, row.Sandbox, row.Attempt = store.EpisodeEnded, "", r.Attempt
			var v task.Verdict
			if json.Unmarshal(r.Result, &v) == nil {
				f.Reward = &v.Reward
			}
		} else {
			e := resumed[r.Episode]
			f = figs[r.Episode]
			row.Sandbox, row.Attempt, row.State, row.Resume, row.PauseSeq = e.SandboxID(), e.Attempt(), store.EpisodeRunning, f.Resume, max(row.PauseSeq, r.PauseSeq)
		}
		rows = append(rows, row)
		res.Episodes = append(res.Episodes, f)
	}
	if err := c.o.Store.PutEpisodes(ctx, rows); err != nil {
		for _, e := range resumed {
			_ = e.Close(context.WithoutCancel(ctx))
		}
		cleanup()
		return res, fmt.Errorf("checkpoint %s: restore failed, every sandbox it made deleted: record the episodes: %w", id, err)
	}
	c.mu.Lock()
	for eid, e := range resumed {
		c.live[eid] = e
	}
	c.mu.Unlock()
	res.Seconds = time.Since(start).Seconds()
	return res, nil
}

// committed returns the records of checkpoint id, which must be committed
// for what was asked of it (verb: "restores", "branches").
func (c *Coordinator) committed(ctx context.Context, id, verb string) ([]store.Record, error) {
	ck, recs, err := c.o.Store.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	if ck.State != store.StateCommitted {
		return nil, errdefs.Errorf(errdefs.ErrConflict, "checkpoint %s is %s: only a committed checkpoint %s", id, ck.State, verb)
	}
	return recs, nil
}

// forkProblems says what keeps record r's snapshot from being forked
// here: its image gone, or the snapshot itself.
func (c *Coordinator) forkProblems(ctx context.Context, r store.Record) []string {
	var problems []string
	if err := c.checkImage(ctx, r); err != nil {
		problems = append(problems, err.Error())
	}
	if _, err := c.o.Env.Provider.GetSnapshot(ctx, r.SnapshotID); err != nil {
		problems = append(problems, fmt.Sprintf("episode %s: snapshot %s: %v", r.Episode, r.SnapshotID, err))
	}
	return problems
}

// continueFork continues record r's episode in sb, a fork of its snapshot:
// in place when the record allows it and the fork's supervisor is the
// recorded launch, relaunched from its saved session otherwise; as copy
// name (a branch) unless name is "". The figures say which, and why.
func (c *Coordinator) continueFork(ctx context.Context, spec episode.Spec, sb string, r store.Record, name string) (*episode.Episode, EpisodeFigures, error) {
	f := EpisodeFigures{Episode: r.Episode, Resume: "relaunch", ResumeWhy: fmt.Sprintf("the %s provider's snapshot kept files only (keeps_processes false): the harness is relaunched from its saved session", r.Provider)}
	if name != "" {
		f.Episode = name
	}
	st := checkpoint.State{Episode: r.Episode, PauseSeq: r.PauseSeq, RelayDelivered: r.RelayDelivered, RelayPosition: r.RelayPosition, LedgerHead: r.LedgerHead, HarnessSession: r.HarnessSession, Attempt: r.Attempt}
	if r.RestoresInPlace() {
		st.Identity, st.PauseWall, st.PauseUptime = *r.Identity, *r.PauseWall, *r.PauseUptime
		var e *episode.Episode
		var err error
		if name == "" {
			e, err = episode.ResumeInPlace(ctx, c.o.Env, spec, sb, st)
		} else {
			e, err = episode.ResumeCopy(ctx, c.o.Env, spec, sb, st, name)
		}
		if err == nil {
			cf := e.Clock()
			f.Resume, f.ResumeWhy, f.Clock = "in_place", "", &cf
			return e, f, nil
		}
		switch {
		case errors.Is(err, episode.ErrNotSameLaunch):
			f.ResumeWhy = err.Error()
		case errors.Is(err, checkpoint.ErrExited):
			// The recorded launch was in the fork, but its harness ended
			// before the continue could take effect (the fork still has
			// its files): relaunch it from its saved session there, as a
			// file-only snapshot would be, rather than fail every episode
			// of the restore.
			f.ResumeWhy = "the harness ended in the fork before the continue, so it is relaunched from its saved session: " + err.Error()
			if name != "" {
				// The copy's gateway registration and ledger exist already.
				spec.Name = name
				name = ""
			}
		default:
			return nil, f, err
		}
		c.log.Warn("resume in place impossible, relaunching", "episode", f.Episode, "why", f.ResumeWhy)
	} else if r.KeepsProcesses {
		f.ResumeWhy = "the record lacks the identity or the pause's clocks"
	}
	var e *episode.Episode
	var err error
	if name == "" {
		e, err = episode.RelaunchIn(ctx, c.o.Env, spec, sb, r.HarnessSession)
	} else {
		e, err = episode.RelaunchCopy(ctx, c.o.Env, spec, sb, r.HarnessSession, st.LedgerCut(), name)
	}
	return e, f, err
}

// Branch continues one episode of a committed checkpoint as len(copies)
// new episodes, named copies, each in its own fork of the episode's
// snapshot: RL users branch rollouts from one state. Where the snapshot
// kept the processes each copy resumes in place (episode.ResumeCopy),
// otherwise it is relaunched from the saved session (episode.RelaunchCopy);
// either way each copy has its own gateway registration and a ledger that
// starts as a copy of the episode's up to the recorded position. The
// episode itself is not touched: it may be live. All or nothing: if any
// copy fails, every sandbox and registration the branch made is undone
// and the store is unchanged.
func (c *Coordinator) Branch(ctx context.Context, id, episodeID string, copies []string) (Result, error) {
	c.op.Lock()
	defer c.op.Unlock()
	start := time.Now()
	res := Result{Checkpoint: id, Phases: map[string]float64{}}
	recs, err := c.committed(ctx, id, "branches")
	if err != nil {
		return res, err
	}
	var r *store.Record
	for i := range recs {
		if recs[i].Episode == episodeID {
			r = &recs[i]
		}
	}
	if r == nil {
		return res, fmt.Errorf("checkpoint %s has no record of episode %s: %w", id, episodeID, errdefs.ErrNotFound)
	}
	var problems []string
	if len(copies) == 0 {
		problems = append(problems, "no copies asked for")
	}
	if r.Finished {
		problems = append(problems, fmt.Sprintf("episode %s had ended at the checkpoint: there is no state to branch from", episodeID))
	}
	if r.Provider != c.o.Env.Provider.Name() {
		problems = append(problems, fmt.Sprintf("episode %s: recorded on provider %s, this coordinator runs %s", episodeID, r.Provider, c.o.Env.Provider.Name()))
	}
	seen := map[string]bool{}
	for _, name := range copies {
		switch {
		case !relay.ValidName(name):
			problems = append(problems, fmt.Sprintf("copy %q: use letters, digits, '.', '_' and '-', starting with a letter or digit, at most 128", name))
		case name == episodeID:
			problems = append(problems, fmt.Sprintf("copy %s: that is the episode's own name", name))
		case seen[name]:
			problems = append(problems, fmt.Sprintf("copy %s is named twice", name))
		default:
			if _, err := c.o.Store.GetEpisode(ctx, name); err == nil {
				problems = append(problems, fmt.Sprintf("copy %s: an episode of that name exists", name))
			} else if !errors.Is(err, errdefs.ErrNotFound) {
				problems = append(problems, fmt.Sprintf("copy %s: %v", name, err))
			} else if _, err := c.o.Env.Gateway.Episode(name); err == nil {
				// Left by an interrupted branch: the undo below removes only
				// what this branch registers.
				problems = append(problems, fmt.Sprintf("copy %s: the gateway already has an episode of that name (and a ledger) that no episode row names", name))
			}
		}
		seen[name] = true
	}
	row, err := c.o.Store.GetEpisode(ctx, episodeID)
	var spec episode.Spec
	if err == nil {
		spec, err = c.specOf(row)
	}
	if err != nil {
		problems = append(problems, fmt.Sprintf("episode %s: %v", episodeID, err))
	}
	if !r.Finished && r.Provider == c.o.Env.Provider.Name() {
		problems = append(problems, c.forkProblems(ctx, *r)...)
	}
	res.Phases["validate"] = time.Since(start).Seconds()
	if len(problems) > 0 {
		return res, refused{fmt.Sprintf("checkpoint %s: episode %s cannot be branched; nothing was changed:\n  %s", id, episodeID, strings.Join(problems, "\n  "))}
	}

	t := time.Now()
	forks, err := c.o.Env.Provider.Fork(ctx, r.SnapshotID, len(copies), episode.ForkSpec(spec))
	res.Phases["fork"] = time.Since(t).Seconds()
	if err != nil {
		return res, fmt.Errorf("checkpoint %s: branch episode %s: fork %s: %w", id, episodeID, r.SnapshotID, err)
	}
	t = time.Now()
	var (
		mu      sync.Mutex
		made    = map[string]*episode.Episode{}
		figs    = map[string]EpisodeFigures{}
		sandbox = map[string]string{}
	)
	for i, name := range copies {
		sandbox[name] = forks[i].ID
	}
	err = c.each(copies, "branch", func(name string) error {
		e, f, err := c.continueFork(ctx, spec, sandbox[name], *r, name)
		if err != nil {
			return err
		}
		mu.Lock()
		made[name], figs[name] = e, f
		mu.Unlock()
		return nil
	})
	res.Phases["resume"] = time.Since(t).Seconds()
	undo := func() {
		for _, e := range made {
			_ = e.Close(context.WithoutCancel(ctx))
		}
		for _, name := range copies {
			if err := c.deleteSandbox(context.WithoutCancel(ctx), sandbox[name]); err != nil {
				c.log.Warn("delete a fork of a failed branch", "sandbox", sandbox[name], "err", err)
			}
			if _, err := c.o.Env.Gateway.Episode(name); err == nil {
				if err := c.o.Env.Gateway.Remove(name); err != nil {
					c.log.Warn("remove a copy of a failed branch from the gateway", "episode", name, "err", err)
				}
			}
		}
	}
	if err != nil {
		undo()
		return res, fmt.Errorf("checkpoint %s: branch of episode %s failed, every sandbox and copy it made undone: %w", id, episodeID, err)
	}
	rows := make([]store.Episode, 0, len(copies))
	for _, name := range copies {
		e := made[name]
		rows = append(rows, store.Episode{
			ID: name, Origin: spec.ID, Task: row.Task, Harness: row.Harness, Provider: c.o.Env.Provider.Name(),
			Sandbox: e.SandboxID(), Attempt: e.Attempt(), PauseSeq: r.PauseSeq, State: store.EpisodeRunning,
			DeadlineS: row.DeadlineS, Limits: row.Limits, Image: row.Image, Environment: e.Environment().String(), Resume: figs[name].Resume,
		})
		res.Episodes = append(res.Episodes, figs[name])
	}
	if err := c.o.Store.PutEpisodes(ctx, rows); err != nil {
		undo()
		return res, fmt.Errorf("checkpoint %s: branch of episode %s failed, every sandbox and copy it made undone: record the copies: %w", id, episodeID, err)
	}
	c.mu.Lock()
	for name, e := range made {
		c.live[name] = e
	}
	c.mu.Unlock()
	res.Seconds = time.Since(start).Seconds()
	return res, nil
}

// Retire deletes an episode's sandbox (once) and marks it retired. Its
// snapshots stay while a checkpoint names them; deleting the checkpoint
// (DeleteCheckpoint) frees them.
func (c *Coordinator) Retire(ctx context.Context, id string) error {
	c.op.Lock()
	defer c.op.Unlock()
	row, err := c.o.Store.GetEpisode(ctx, id)
	if err != nil {
		return err
	}
	if row.State == store.EpisodeRetired {
		return nil
	}
	// Revoked first: from now on the gateway refuses the episode's token,
	// whatever its sandbox still does while it is being closed.
	if gw := c.o.Env.Gateway; gw != nil {
		if err := gw.Revoke(id); err != nil && !errors.Is(err, relay.ErrUnknownEpisode) {
			return fmt.Errorf("retire %s: revoke its token: %w", id, err)
		}
	}
	c.mu.Lock()
	e, live := c.live[id]
	delete(c.live, id)
	c.mu.Unlock()
	if live {
		if err := e.Close(ctx); err != nil {
			c.mu.Lock()
			c.live[id] = e
			c.mu.Unlock()
			return err
		}
	} else if row.Sandbox != "" {
		if err := c.o.Env.Provider.Delete(ctx, row.Sandbox); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
			return err
		}
	}
	row.State = store.EpisodeRetired
	return c.o.Store.PutEpisode(ctx, row)
}

// DeleteCheckpoint removes a checkpoint and deletes the snapshots no other
// checkpoint names.
func (c *Coordinator) DeleteCheckpoint(ctx context.Context, id string) ([]store.SnapshotRef, error) {
	c.op.Lock()
	defer c.op.Unlock()
	freed, err := c.o.Store.Delete(ctx, id)
	if err != nil {
		return nil, err
	}
	// The checkpoint is gone from the store: nothing would name these
	// snapshots again, so every one is deleted, retrying transient failures.
	var errs []error
	for _, ref := range freed {
		if ref.Provider != c.o.Env.Provider.Name() {
			continue
		}
		if err := retry(func() error { return c.o.Env.Provider.DeleteSnapshot(context.WithoutCancel(ctx), ref.SnapshotID) }); err != nil {
			errs = append(errs, fmt.Errorf("checkpoint %s: delete snapshot %s: %w", id, ref.SnapshotID, err))
		}
	}
	return freed, errors.Join(errs...)
}

// Wait waits for an episode's harness to end.
func (c *Coordinator) Wait(ctx context.Context, id string) (*supervisor.Receipt, error) {
	e, ok := c.Live(id)
	if !ok {
		return nil, errdefs.Errorf(errdefs.ErrConflict, "episode %s is not live", id)
	}
	return e.Wait(ctx)
}

// Close forgets the live episodes without stopping them (a server going
// down leaves its sandboxes running for the next one).
func (c *Coordinator) Close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.live = map[string]*episode.Episode{}
}

// Shutdown retires every live episode's sandbox (nothing left running).
func (c *Coordinator) Shutdown(ctx context.Context) error {
	var errs []error
	for _, id := range c.LiveIDs() {
		if err := c.Retire(ctx, id); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
