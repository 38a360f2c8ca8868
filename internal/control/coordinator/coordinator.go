// Package coordinator owns checkpoints of many episodes at once: starting
// episodes, Prepare (pause, snapshot and record every live episode with
// bounded concurrency, commit in one atomic step, continue), Restore
// (validate every record before touching a provider, fork every snapshot,
// then resume each episode in place or relaunch it), Branch and Retire.
// Its durable state is the record store: episodes, checkpoints, records,
// verdicts, and the journal of the operation under way, so a coordinator
// made on the same store after a crash or a restart finds the live
// episodes again and finishes or undoes what the last one left half done.
//
// Decisions are made by pure planners (plan.go: facts in, actions and
// typed problems out) and performed by executors that journal what each
// step is about to create before creating it. The rule for an operation a
// crash interrupts (New applies it before the coordinator serves):
//
//   - A prepare is finished as far as it got. Its checkpoint, if still
//     pending, is marked failed and every snapshot it made (journaled, or
//     found by the sandbox and the name it was taken under) is deleted; if
//     it had committed, only the snapshots no record names are deleted.
//     Every pause it sent is continued.
//   - A restore is undone before its point of no return and rolled
//     forward after it. Before it, the restore only makes forks (each
//     journaled and labelled with the restore) and gets them ready inside
//     themselves; nothing outside the forks changes, so undoing it is
//     deleting them. The point of no return is the journaled decision,
//     written once every fork is ready; after it the gateway is raised to
//     each episode's next attempt (an in-place resume's ledger cut to the
//     recorded position in the same step), each harness is continued or
//     started, and the store's episodes are written as the journal is
//     closed. Each of these steps can be repeated, so recovery repeats
//     them: every episode whose fork still runs is continued, one whose
//     fork died is marked lost. No ledger is left cut for an episode the
//     store does not run, and no fork is left that no episode names.
//
// Rolling forward rather than undoing is what keeps the ledgers whole: a
// ledger cut cannot be taken back (a cut drops the entries after it from
// the logical ledger, and a resumed harness may already have added more),
// so once any episode's gateway has moved, the restore must finish.
//
// An episode whose sandbox dies is marked lost when the coordinator
// notices (a wait or a verify that finds the sandbox gone, or the
// periodic liveness check, Options.LivenessInterval), not only when the
// next server starts.
//
// It sits above package episode (one episode on a provider) rather than in
// package checkpoint, which episode itself builds on.
package coordinator

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"time"

	"stasis/errdefs"
	"stasis/internal/control/checkpoint"
	"stasis/internal/control/episode"
	"stasis/internal/control/image"
	"stasis/internal/control/relay"
	"stasis/internal/control/task"
	"stasis/internal/insandbox/harness"
	"stasis/internal/insandbox/supervisor"
	"stasis/internal/storage/store"
	"stasis/sandbox"
)

// Options configure a Coordinator.
type Options struct {
	Env   *episode.Env
	Store store.Store
	// Node is this server's node, of several sharing Store ("": the only
	// server): it drives, re-attaches and checkpoints only the episodes
	// whose rows name it. NodeLive says whether another node holds a live
	// lease: an episode that a live node drives is retired there, not
	// here (its sandbox is that node's).
	Node     string
	NodeLive func(ctx context.Context, node string) (bool, error)
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
	// Clock is the coordinator's time (default: the system's).
	Clock Clock
	// LivenessInterval, when positive, has the coordinator check that
	// often that each live episode's sandbox is still there, and mark an
	// episode whose sandbox is gone lost (CheckLiveness). Zero: only a
	// wait or a verify that finds the sandbox gone marks it.
	LivenessInterval time.Duration
	// Decisions, when set, answers for the outside decisions restores
	// wait on (RestoreOptions.Ref): a restore this coordinator finds
	// interrupted after it was ready and before it decided is rolled
	// forward if its decision went ahead, undone if not, and left for
	// the next start if it cannot be told yet.
	Decisions Decisions
	// stepHook, when set (tests), is called before each step of a
	// prepare or a restore; an error crashes the operation there.
	stepHook func(op, step, episode string) error
	Logger   *slog.Logger
}

// Decisions are the outside decisions restores wait on
// (RestoreOptions.Ref; a cluster's restores over several nodes).
type Decisions interface {
	// Went says whether decision ref went ahead (true) or was called off
	// (false); an error if it cannot be told yet.
	Went(ctx context.Context, ref string) (bool, error)
	// Finished is told that this server's part of decision ref was
	// finished by a recovery (failure: why some of it could not be).
	Finished(ctx context.Context, ref, failure string)
}

// SetStepHook has every prepare and restore of coordinators made with o
// call hook before each step; an error from it crashes the operation
// there: it returns at once, undoing and closing nothing, as a server
// killed there would. For crash tests, here and in the packages that
// assemble coordinators.
func SetStepHook(o *Options, hook func(op, step, episode string) error) { o.stepHook = hook }

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
	// Finish, when set, makes the prepare this node's share of a
	// checkpoint begun over several nodes (store.Postgres.BeginShared):
	// the checkpoint exists already, pending, and instead of committing
	// or failing it the prepare finishes its share with the records it
	// put, or with why it failed (store.Postgres.FinishShare, which
	// commits the checkpoint when this was the last share). It returns the
	// checkpoint's state after; this node's snapshots are deleted unless
	// the checkpoint is committed or still pending.
	Finish func(ctx context.Context, records int, failure error) (store.State, error)
}

// Progress reports one step of a long operation.
type Progress struct {
	Phase   string // start, prepare, commit, continue, validate, fork, ready, advance, resume
	Episode string
	Done    int
	Total   int
}

// Coordinator drives the episodes of one record store.
type Coordinator struct {
	o   Options
	log *slog.Logger

	clock Clock

	mu   sync.Mutex
	live map[string]*episode.Episode
	// op serialises prepares, restores, retires, restarts, recoveries
	// and the marking of lost episodes.
	op sync.Mutex
	// starts keeps starts and prepares apart: each start holds it for
	// reading, each prepare for writing (before op), so a prepare waits
	// for the starts under way and holds back those asked while it runs.
	starts sync.RWMutex

	// The liveness check's goroutine: stop ends it, watching is done
	// when it has.
	stop     chan struct{}
	watching sync.WaitGroup
	stopOnce sync.Once
}

// New makes a coordinator over the store, finishes or undoes what the
// last coordinator on it left half done (recover.go: the journal's
// operations, and checkpoints left pending), and finds its episodes
// again: each running or ended one whose sandbox still runs is attached;
// one whose sandbox is gone or dead (a crash took it) is marked lost, for
// a restore to bring back (an ended one whose verdict is captured stays
// ended), and what is left of its sandbox is deleted. One coordinator at a
// time may run on a store.
func New(ctx context.Context, o Options) (*Coordinator, error) {
	if o.Env == nil || o.Store == nil {
		return nil, errors.New("coordinator: an episode environment and a store are needed")
	}
	if o.Concurrency <= 0 {
		o.Concurrency = 64
	}
	if o.Clock == nil {
		o.Clock = realClock{}
	}
	c := &Coordinator{o: o, log: o.Logger, clock: o.Clock, live: map[string]*episode.Episode{}, stop: make(chan struct{})}
	if c.log == nil {
		c.log = slog.New(slog.DiscardHandler)
	}
	prepares, err := c.recoverRestores(ctx)
	if err != nil {
		return nil, err
	}
	if err := c.attachAll(ctx); err != nil {
		return nil, err
	}
	if err := c.recoverPrepares(ctx, prepares); err != nil {
		return nil, err
	}
	if o.LivenessInterval > 0 {
		c.watching.Add(1)
		go c.watch(o.LivenessInterval)
	}
	return c, nil
}

// attachAll attaches every running or ended episode whose sandbox runs,
// and marks the others lost.
func (c *Coordinator) attachAll(ctx context.Context) error {
	var rows []store.Episode
	// An ended episode keeps its sandbox (for verify) until it is retired.
	for _, state := range []store.EpisodeState{store.EpisodeRunning, store.EpisodeEnded} {
		rs, err := c.o.Store.ListEpisodes(ctx, state)
		if err != nil {
			return err
		}
		rows = append(rows, rs...)
	}
	for _, r := range rows {
		if r.Node != c.o.Node {
			continue // another node's
		}
		spec, err := c.specOf(r)
		if err != nil {
			return err
		}
		e, err := episode.Attach(ctx, c.o.Env, spec, r.Sandbox, r.Attempt)
		if err == nil {
			c.live[r.ID] = e
			continue
		}
		if !sandboxGone(err) {
			return err
		}
		c.log.Warn("episode lost: its sandbox is gone", "episode", r.ID, "sandbox", r.Sandbox, "err", err)
		if err := c.markLost(ctx, r, err); err != nil {
			return err
		}
	}
	return nil
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

// since is the seconds from t to now, by the coordinator's clock.
func (c *Coordinator) since(t time.Time) float64 { return c.clock.Now().Sub(t).Seconds() }

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
//
// An id the store has as retired or lost is started again, from its
// task's work tree, as its next attempt (episode.Restart): a trainer
// restarts a straggler it retired, or an episode a crash lost, under its
// own id. Its task and harness must be the ones it had; its ledger starts
// empty (the earlier attempts' entries stay, dropped) and calls of its
// earlier attempts are refused. An id that runs or has ended is refused
// (retire it first).
//
// A start and a checkpoint of this coordinator do not overlap: a
// checkpoint waits for the starts under way (their episodes are in it),
// and a start asked while a checkpoint runs waits for it to end (its
// episode is not in it).
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
	c.starts.RLock()
	defer c.starts.RUnlock()
	var again *store.Episode
	if row, err := c.o.Store.GetEpisode(ctx, id); err == nil {
		if err := checkRestart(row, taskID, harnessName); err != nil {
			return store.Episode{}, err
		}
		// A restart is serialised with the operations that change an
		// existing episode (restores, retires).
		c.op.Lock()
		defer c.op.Unlock()
		if row, err = c.o.Store.GetEpisode(ctx, id); err != nil {
			return store.Episode{}, err
		}
		if err := checkRestart(row, taskID, harnessName); err != nil {
			return store.Episode{}, err
		}
		again = &row
	}
	spec.Expiry = spec.ExpiryFrom(c.clock.Now())
	// Journaled, its sandbox labelled, its row written as the journal is
	// closed: a start the server dies in is undone by the next one.
	x := c.newOp(jStart)
	spec.Labels = map[string]string{labelOp: x.id}
	if err := x.note(ctx, jStart, id, jdoc{}); err != nil {
		return store.Episode{}, fmt.Errorf("episode %s: %w", id, err)
	}
	if err := x.step(stepStart, id); err != nil {
		return store.Episode{}, c.crashed(x)
	}
	start := episode.Start
	if again != nil {
		start = episode.Restart
	}
	e, err := start(ctx, c.o.Env, spec)
	if x.dead() {
		return store.Episode{}, c.crashed(x)
	}
	if err == nil {
		if err = x.step(stepStarted, id); err != nil {
			return store.Episode{}, c.crashed(x)
		}
		row := store.Episode{ID: id, Task: taskID, Harness: harnessName, Provider: c.o.Env.Provider.Name(), Sandbox: e.SandboxID(), State: store.EpisodeRunning, DeadlineS: deadline.Seconds(), Limits: o.Limits, Image: spec.Image, Environment: e.Environment().String()}
		if again != nil {
			// Its pauses go on numbering from the last (a snapshot's
			// name carries the number), and it keeps its creation.
			row.Attempt, row.PauseSeq, row.Created = e.Attempt(), again.PauseSeq, again.Created
		}
		if err = x.close(ctx, []store.Episode{row}); err != nil {
			_ = e.Close(context.WithoutCancel(ctx))
		}
	}
	if err != nil {
		// Nothing of it is left: its sandbox, if any, and its gateway
		// registration (so that the id can be started again); a restart
		// leaves the episode's row and registration as they were (at its
		// new attempt, if the gateway got there).
		if uerr := c.undoCopies(context.WithoutCancel(ctx), x.id, nil, []string{id}); uerr != nil {
			c.log.Warn("undo a failed start", "episode", id, "err", uerr)
		} else if cerr := x.close(ctx, nil); cerr != nil {
			c.log.Warn("close the journal of a failed start", "episode", id, "err", cerr)
		}
		return store.Episode{}, err
	}
	c.mu.Lock()
	c.live[id] = e
	c.mu.Unlock()
	return c.o.Store.GetEpisode(ctx, id)
}

// checkRestart says whether an episode the store has may be started
// again as its next attempt: it must be retired or lost, and be asked
// for with its own task and harness.
func checkRestart(row store.Episode, taskID, harnessName string) error {
	switch row.State {
	case store.EpisodeRetired, store.EpisodeLost:
	default:
		return errdefs.Errorf(errdefs.ErrExists, "episode %s already exists and is %s: retire it first to start it again as its next attempt, or give another id", row.ID, row.State)
	}
	if row.Task != taskID || row.Harness != harnessName {
		return errdefs.Errorf(errdefs.ErrConflict, "episode %s ran task %s with harness %s: start it again with those, or give another id for task %s with harness %s", row.ID, row.Task, row.Harness, taskID, harnessName)
	}
	return nil
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
// A live episode whose sandbox turns out to be gone is marked lost, and
// the error matches ErrLost.
func (c *Coordinator) Verify(ctx context.Context, id string) (task.Verdict, bool, error) {
	if e, ok := c.Live(id); ok {
		v, rec, err := e.Verify(ctx)
		if err == nil {
			c.MarkEnded(ctx, id)
		} else if lerr := c.noticeLost(ctx, id); lerr != nil {
			err = lerr
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
	if row.Node != c.o.Node && row.Node != "" && c.o.NodeLive != nil {
		if live, err := c.o.NodeLive(ctx, row.Node); err != nil || live {
			return errors.Join(err, errdefs.Errorf(errdefs.ErrConflict, "episode %s is driven by node %s, which is live: retire it through that node (its sandbox is there)", id, row.Node))
		}
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
	var snaps []string
	for _, ref := range freed {
		if ref.Provider == c.o.Env.Provider.Name() {
			snaps = append(snaps, ref.SnapshotID)
		}
	}
	var errs []error
	for _, err := range c.removeSnapshots(context.WithoutCancel(ctx), snaps) {
		errs = append(errs, fmt.Errorf("checkpoint %s: %w", id, err))
	}
	return freed, errors.Join(errs...)
}

// removeSnapshots deletes snapshots, retrying transient failures: all at
// once when the provider can (their blobs collected once), else one by
// one. It returns the failures.
func (c *Coordinator) removeSnapshots(ctx context.Context, snaps []string) []error {
	if len(snaps) == 0 {
		return nil
	}
	if d, ok := c.o.Env.Provider.(sandbox.SnapshotsDeleter); ok {
		if err := retry(func() error { return d.DeleteSnapshots(ctx, snaps) }); err != nil {
			return []error{fmt.Errorf("delete snapshots %s: %w", strings.Join(snaps, ", "), err)}
		}
		return nil
	}
	var errs []error
	for _, s := range snaps {
		if err := retry(func() error { return c.o.Env.Provider.DeleteSnapshot(ctx, s) }); err != nil {
			errs = append(errs, fmt.Errorf("delete snapshot %s: %w", s, err))
		}
	}
	return errs
}

// Wait waits for an episode's harness to end. When its sandbox turns out
// to be gone, the episode is marked lost and the error matches ErrLost.
func (c *Coordinator) Wait(ctx context.Context, id string) (*supervisor.Receipt, error) {
	e, ok := c.Live(id)
	if !ok {
		return nil, errdefs.Errorf(errdefs.ErrConflict, "episode %s is not live", id)
	}
	rc, err := e.Wait(ctx)
	if err != nil && ctx.Err() == nil {
		if lerr := c.noticeLost(ctx, id); lerr != nil {
			return nil, lerr
		}
	}
	return rc, err
}

// Close forgets the live episodes without stopping them (a server going
// down leaves its sandboxes running for the next one) and stops the
// liveness check.
func (c *Coordinator) Close() {
	c.stopOnce.Do(func() { close(c.stop) })
	c.watching.Wait()
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
