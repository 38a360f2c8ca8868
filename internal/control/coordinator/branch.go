package coordinator

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"

	"stasis/errdefs"
	"stasis/internal/control/checkpoint"
	"stasis/internal/control/episode"
	"stasis/internal/control/relay"
	"stasis/internal/storage/store"
)

// The steps of a branch, as the step hook sees them (stepFork,
// stepForked and stepClose too).
const (
	stepRegister = "register" // before a copy is registered at the gateway and continued
)

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
//
// The forks (labelled with the branch) and the copies' registrations are
// journaled before they are made, and the copies' rows are written as
// the journal is closed: a branch the server dies in is undone by the
// next coordinator (New), its copies being episodes nothing names yet.
func (c *Coordinator) Branch(ctx context.Context, id, episodeID string, copies []string) (Result, error) {
	c.op.Lock()
	defer c.op.Unlock()
	start := c.clock.Now()
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
	row, spec, problems := c.checkBranch(ctx, *r, copies)
	res.Phases["validate"] = c.since(start)
	if len(problems) > 0 {
		return res, refused{fmt.Sprintf("checkpoint %s: episode %s cannot be branched; nothing was changed:\n  %s", id, episodeID, strings.Join(problems, "\n  "))}
	}
	x := c.newOp(jBranch)
	if err := x.note(ctx, jBranch, episodeID, jdoc{Checkpoint: id}); err != nil {
		return res, fmt.Errorf("checkpoint %s: branch episode %s: nothing changed: %w", id, episodeID, err)
	}
	t := c.clock.Now()
	sandboxes, err := c.forkCopies(ctx, x, *r, spec, copies)
	res.Phases["fork"] = c.since(t)
	if x.dead() {
		return res, c.crashed(x)
	}
	if err != nil {
		c.undoBranch(ctx, x, sandboxes, nil)
		return res, fmt.Errorf("checkpoint %s: branch episode %s: %w", id, episodeID, err)
	}
	t = c.clock.Now()
	made, figs, err := c.continueCopies(ctx, x, *r, spec, copies, sandboxes)
	res.Phases["resume"] = c.since(t)
	if x.dead() {
		return res, c.crashed(x)
	}
	if err != nil {
		c.undoBranch(ctx, x, sandboxes, made)
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
	if err := x.step(stepClose, ""); err != nil {
		return res, c.crashed(x)
	}
	if err := x.close(ctx, rows); err != nil {
		c.undoBranch(ctx, x, sandboxes, made)
		return res, fmt.Errorf("checkpoint %s: branch of episode %s failed, every sandbox and copy it made undone: record the copies: %w", id, episodeID, err)
	}
	c.mu.Lock()
	for name, e := range made {
		c.live[name] = e
	}
	c.mu.Unlock()
	res.Seconds = c.since(start)
	return res, nil
}

// checkBranch checks, before anything is touched, that record r's episode
// can be branched as copies: copies asked for, each a new valid name no
// episode, in the store or at the gateway, has; r unfinished, made on
// this provider, and its snapshot and image here. It returns the
// episode's row and spec, and the problems.
func (c *Coordinator) checkBranch(ctx context.Context, r store.Record, copies []string) (store.Episode, episode.Spec, []string) {
	episodeID := r.Episode
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
				// Left by an interrupted branch of an older stasis: the
				// undo removes only what this branch registers.
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
		problems = append(problems, c.forkProblems(ctx, r)...)
	}
	return row, spec, problems
}

// forkCopies forks record r's snapshot once per copy, the forks labelled
// with the branch and journaled. sandboxes: copy → its fork.
func (c *Coordinator) forkCopies(ctx context.Context, x *op, r store.Record, spec episode.Spec, copies []string) (map[string]string, error) {
	if err := x.note(ctx, jFork, r.Episode, jdoc{Snapshot: r.SnapshotID}); err != nil {
		return nil, err
	}
	if err := x.step(stepFork, r.Episode); err != nil {
		return nil, err
	}
	spec.Expiry = spec.ExpiryFrom(c.clock.Now())
	fs := episode.ForkSpec(spec)
	fs.Labels[labelOp] = x.id
	forks, err := c.o.Env.Provider.Fork(ctx, r.SnapshotID, len(copies), fs)
	if err != nil {
		return nil, fmt.Errorf("fork %s: %w", r.SnapshotID, err)
	}
	sandboxes := map[string]string{}
	for i, name := range copies {
		sandboxes[name] = forks[i].ID
	}
	if err := x.step(stepForked, r.Episode); err != nil {
		return sandboxes, err
	}
	for _, name := range copies {
		if err := x.note(ctx, jForked, name, jdoc{Sandbox: sandboxes[name]}); err != nil {
			return sandboxes, err
		}
	}
	return sandboxes, nil
}

// continueCopies registers each copy at the gateway (journaled first) and
// continues it in its fork.
func (c *Coordinator) continueCopies(ctx context.Context, x *op, r store.Record, spec episode.Spec, copies []string, sandboxes map[string]string) (map[string]*episode.Episode, map[string]EpisodeFigures, error) {
	var (
		mu   sync.Mutex
		made = map[string]*episode.Episode{}
		figs = map[string]EpisodeFigures{}
	)
	err := c.each(copies, "branch", func(name string) error {
		if err := x.step(stepRegister, name); err != nil {
			return err
		}
		if err := x.note(ctx, jRegister, name, jdoc{}); err != nil {
			return err
		}
		e, f, err := c.continueFork(ctx, spec, sandboxes[name], r, name)
		if err != nil {
			return err
		}
		mu.Lock()
		made[name], figs[name] = e, f
		mu.Unlock()
		return nil
	})
	return made, figs, err
}

// undoBranch undoes a branch that failed: its copies closed, every fork
// deleted (those it knows of and those with its label), every copy's
// gateway registration removed; then its journal is closed (left for the
// next coordinator if something could not be undone).
func (c *Coordinator) undoBranch(ctx context.Context, x *op, sandboxes map[string]string, made map[string]*episode.Episode) {
	ctx = context.WithoutCancel(ctx)
	for _, e := range made {
		_ = e.Close(ctx)
	}
	var names []string
	for name := range sandboxes {
		names = append(names, name)
	}
	if err := c.undoCopies(ctx, x.id, sandboxes, names); err != nil {
		c.log.Warn("undo a failed branch", "op", x.id, "err", err)
		return
	}
	if err := x.close(ctx, nil); err != nil {
		c.log.Warn("close the journal of a failed branch", "op", x.id, "err", err)
	}
}

// undoCopies deletes a branch's forks (sandboxes, and any with its label)
// and removes the gateway registrations of copies no store row names.
func (c *Coordinator) undoCopies(ctx context.Context, opID string, sandboxes map[string]string, names []string) error {
	var errs []error
	seen := map[string]bool{}
	sbs := []string{}
	for _, sb := range sandboxes {
		seen[sb] = true
		sbs = append(sbs, sb)
	}
	infos, err := c.o.Env.Provider.List(ctx, map[string]string{labelOp: opID})
	if err != nil {
		errs = append(errs, err)
	}
	for _, info := range infos {
		if !seen[info.ID] {
			seen[info.ID] = true
			sbs = append(sbs, info.ID)
		}
	}
	for _, sb := range sbs {
		if err := c.deleteSandbox(ctx, sb); err != nil {
			errs = append(errs, fmt.Errorf("delete fork %s: %w", sb, err))
		}
	}
	for _, name := range names {
		if _, err := c.o.Store.GetEpisode(ctx, name); !errors.Is(err, errdefs.ErrNotFound) {
			continue // an episode's: not the branch's to remove
		}
		if _, err := c.o.Env.Gateway.Episode(name); err == nil {
			if err := c.o.Env.Gateway.Remove(name); err != nil {
				errs = append(errs, fmt.Errorf("remove copy %s from the gateway: %w", name, err))
			}
		}
	}
	return errors.Join(errs...)
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
	st := stateOf(r)
	if r.RestoresInPlace() {
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
		e, err = episode.RelaunchIn(ctx, c.o.Env, spec, sb, r.HarnessSession, r.LedgerTip)
	} else {
		e, err = episode.RelaunchCopy(ctx, c.o.Env, spec, sb, r.HarnessSession, st.LedgerAt(), name)
	}
	return e, f, err
}
