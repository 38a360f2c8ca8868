package coordinator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"
	"time"

	"stasis/errdefs"
	"stasis/internal/control/checkpoint"
	"stasis/internal/control/episode"
	"stasis/internal/control/image"
	"stasis/internal/control/relay"
	"stasis/internal/control/task"
	"stasis/internal/proc"
	"stasis/internal/storage/store"
)

// The steps of a restore, as the step hook sees them (stepClose too).
const (
	stepFork    = "fork"    // the fork journaled, before it is made
	stepForked  = "forked"  // the fork made, before its id is journaled
	stepReady   = "ready"   // before an episode's fork is made ready
	stepDecide  = "decide"  // every fork ready, before the decision is journaled
	stepAdvance = "advance" // decided, before an episode's gateway attempt is raised
	stepGo      = "go"      // before an episode's harness is continued or started
)

// Restore brings back every episode of committed checkpoint id. Every
// record is checked first, before any provider is touched (planRestore);
// then every snapshot is forked, and each fork made ready to resume in
// place (its snapshot kept the processes and the fork's supervisor shows
// the recorded identity) or to relaunch from its saved session, touching
// nothing outside the fork. If any of that fails, every fork is deleted
// and nothing else has changed. Then the restore decides (its point of no
// return, journaled): the gateway is raised to each episode's next
// attempt (an in-place resume's ledger cut to its recorded position, a
// relaunch's next call matched against it), each harness is continued or
// started, and the store's episodes are written with the journal's close.
// An episode that cannot be continued after the decision (its fork died)
// is marked lost, its fork deleted, and the error names it; the others
// are restored.
//
// A restore the server dies in is undone by the next coordinator (New)
// when it had not decided, and rolled forward when it had.
func (c *Coordinator) Restore(ctx context.Context, id string) (Result, error) {
	return c.RestoreWith(ctx, id, RestoreOptions{})
}

// RestoreOptions adjust a restore.
type RestoreOptions struct {
	// Episodes, when not nil, are the only episodes of the checkpoint
	// this restore brings back (a scoped restore: one episode that
	// crashed, while the others go on; or this node's share of a restore
	// over several nodes); the others are left as they are. A name the
	// checkpoint lacks is refused. A retired episode is brought back (as
	// its next attempt) only when named: without names it is left out.
	Episodes []string
	// Barrier, when set, is told how this restore's forks went, once:
	// nil when every fork is ready, or why it failed. It returns nil to
	// go on (every node of a restore over several is ready), or why not:
	// then every fork this restore made is deleted and nothing changes.
	Barrier func(ctx context.Context, ready error) error
	// Ref, with a Barrier, names the outside decision the Barrier waits
	// on (a restore over several nodes: its id), so that a server that
	// dies after the decision went and before this restore decided has
	// its next coordinator roll the restore forward rather than undo it
	// (Options.Decisions): the ready plan is journaled before the Barrier
	// is told.
	Ref string
}

// RestoreWith is Restore with options.
func (c *Coordinator) RestoreWith(ctx context.Context, id string, ro RestoreOptions) (Result, error) {
	c.op.Lock()
	defer c.op.Unlock()
	start := c.clock.Now()
	res := Result{Checkpoint: id, Phases: map[string]float64{}}
	barrier := func(err error) error {
		if ro.Barrier == nil {
			return err
		}
		if berr := ro.Barrier(ctx, err); err == nil {
			return berr
		}
		return err
	}
	recs, err := c.committed(ctx, id, "restores")
	if err != nil {
		return res, barrier(err)
	}
	var left []EpisodeFigures
	if recs, left, err = c.scope(ctx, id, recs, ro.Episodes); err != nil {
		return res, barrier(err)
	}
	plan, problems := planRestore(c.restoreFacts(ctx, id, recs))
	res.Phases["validate"] = c.since(start)
	c.progress(Progress{Phase: "validate", Done: 1, Total: 1})
	if len(problems) > 0 {
		return res, barrier(problemsError(fmt.Sprintf("checkpoint %s cannot be restored; nothing was changed", id), problems))
	}
	x := c.newOp(jRestore)
	ref := ""
	if ro.Barrier != nil {
		ref = ro.Ref
	}
	if err := x.note(ctx, jRestore, "", jdoc{Checkpoint: id, Ref: ref}); err != nil {
		return res, barrier(fmt.Errorf("checkpoint %s: restore failed, nothing changed: %w", id, err))
	}
	t := c.clock.Now()
	forks, err := c.forkAll(ctx, x, plan)
	res.Phases["fork"] = c.since(t)
	if x.dead() {
		return res, c.crashed(x)
	}
	if err != nil {
		c.undoRestore(ctx, x, forks)
		return res, barrier(fmt.Errorf("checkpoint %s: restore failed, every fork deleted, nothing changed: %w", id, err))
	}
	t = c.clock.Now()
	eps, figs, ready, err := c.readyAll(ctx, x, plan, forks)
	if x.dead() {
		return res, c.crashed(x)
	}
	decided := decide(plan, forks, ready)
	if err == nil && ref != "" {
		// What this restore decides if the outside decision goes, so that
		// a next coordinator can finish it if this one dies waiting.
		err = x.note(ctx, jReady, "", jdoc{Plan: decided, Finished: plan.Finished})
		if x.dead() {
			return res, c.crashed(x)
		}
	}
	// Every node's forks ready, or none goes on.
	err = barrier(err)
	if err == nil {
		err = x.step(stepDecide, "")
	}
	if err == nil {
		err = x.note(ctx, jDecide, "", jdoc{Plan: decided, Finished: plan.Finished})
	}
	if x.dead() {
		return res, c.crashed(x)
	}
	if err != nil {
		c.undoRestore(ctx, x, forks)
		return res, fmt.Errorf("checkpoint %s: restore failed, every sandbox it made deleted: %w", id, err)
	}
	// Past the point of no return: every episode is continued, or lost;
	// each that had ended gets the ledger its verdict was made on.
	unwound := c.rewindFinished(plan.Finished)
	out, lost := c.finishDecided(ctx, x, decided, eps, figs)
	res.Phases["resume"] = c.since(t)
	if x.dead() {
		return res, c.crashed(x)
	}
	rows := restoredRows(c.rowsOf(ctx, decided, plan.Finished), decided, plan.Finished, out)
	if err := x.step(stepClose, ""); err != nil {
		return res, c.crashed(x)
	}
	if err := retry(func() error { return x.close(ctx, rows) }); err != nil {
		// The journal still says what to finish: the next coordinator
		// writes the rows. Until then nothing drives the forks.
		return res, fmt.Errorf("checkpoint %s: restored, but the record store did not take the episodes (restart the server to finish the restore): %w", id, err)
	}
	c.install(eps, out)
	res.Episodes = append(restoredFigures(recs, figs), left...)
	res.Seconds = c.since(start)
	var errs []error
	if len(lost) > 0 {
		errs = append(errs, fmt.Errorf("%d episodes could not be continued and are marked lost, their forks deleted (restore the checkpoint again to bring them back): %w", len(lost), errors.Join(lost...)))
	}
	errs = append(errs, unwound...)
	if len(errs) > 0 {
		return res, fmt.Errorf("checkpoint %s: restored, but: %w", id, errors.Join(errs...))
	}
	return res, nil
}

// restoreFacts gathers what planRestore needs: the store's rows and the
// specs made from them, the gateway's attempts, the snapshots and images.
func (c *Coordinator) restoreFacts(ctx context.Context, id string, recs []store.Record) restoreFacts {
	f := restoreFacts{
		Checkpoint: id, Records: recs, Provider: c.o.Env.Provider.Name(), Now: c.clock.Now(),
		Live: map[string]bool{}, Specs: map[string]episode.Spec{}, SpecErrs: map[string]error{},
		ImageErrs: map[string]error{}, SnapshotErrs: map[string]error{}, Attempts: map[string]int{}, AttemptErrs: map[string]error{},
	}
	for _, r := range recs {
		ep := r.Episode
		_, f.Live[ep] = c.Live(ep)
		row, err := c.o.Store.GetEpisode(ctx, ep)
		if err != nil {
			f.SpecErrs[ep] = fmt.Errorf("episode %s: %v", ep, err)
			continue
		}
		if f.Specs[ep], err = c.specOf(row); err != nil {
			f.SpecErrs[ep] = err
			continue
		}
		if r.Finished {
			continue
		}
		f.ImageErrs[ep] = c.checkImage(ctx, r)
		if _, err := c.o.Env.Provider.GetSnapshot(ctx, r.SnapshotID); err != nil {
			f.SnapshotErrs[ep] = err
		}
		if st, err := c.o.Env.Gateway.Episode(ep); err != nil {
			f.AttemptErrs[ep] = err
		} else {
			f.Attempts[ep] = st.Attempt
		}
	}
	return f
}

// forkAll forks the snapshot of each episode of the plan, journaling each
// fork before it is made; each fork carries the restore's label. forks:
// episode → fork, of those made.
func (c *Coordinator) forkAll(ctx context.Context, x *op, plan restorePlan) (map[string]string, error) {
	var (
		mu    sync.Mutex
		forks = map[string]string{}
	)
	steps := map[string]restoreStep{}
	var ids []string
	for _, s := range plan.Fork {
		steps[s.Record.Episode] = s
		ids = append(ids, s.Record.Episode)
	}
	err := c.each(ids, "fork", func(eid string) error {
		s := steps[eid]
		if err := x.note(ctx, jFork, eid, jdoc{Snapshot: s.Record.SnapshotID}); err != nil {
			return fmt.Errorf("episode %s: %w", eid, err)
		}
		if err := x.step(stepFork, eid); err != nil {
			return err
		}
		spec := episode.ForkSpec(s.Spec)
		spec.Labels[labelOp] = x.id
		fs, err := c.o.Env.Provider.Fork(ctx, s.Record.SnapshotID, 1, spec)
		if err != nil {
			return fmt.Errorf("episode %s: fork %s: %w", eid, s.Record.SnapshotID, err)
		}
		mu.Lock()
		forks[eid] = fs[0].ID
		mu.Unlock()
		if err := x.step(stepForked, eid); err != nil {
			return err
		}
		return x.note(ctx, jForked, eid, jdoc{Sandbox: fs[0].ID})
	})
	return forks, err
}

// readyAll makes each fork ready to continue (readyOne).
func (c *Coordinator) readyAll(ctx context.Context, x *op, plan restorePlan, forks map[string]string) (map[string]*episode.Episode, map[string]EpisodeFigures, map[string]readiness, error) {
	var (
		mu    sync.Mutex
		eps   = map[string]*episode.Episode{}
		figs  = map[string]EpisodeFigures{}
		ready = map[string]readiness{}
	)
	steps := map[string]restoreStep{}
	var ids []string
	for _, s := range plan.Fork {
		steps[s.Record.Episode] = s
		ids = append(ids, s.Record.Episode)
	}
	err := c.each(ids, "ready", func(eid string) error {
		if err := x.step(stepReady, eid); err != nil {
			return err
		}
		e, f, r, err := c.readyOne(ctx, steps[eid], forks[eid])
		if err != nil {
			return err
		}
		mu.Lock()
		eps[eid], figs[eid], ready[eid] = e, f, r
		mu.Unlock()
		return nil
	})
	return eps, figs, ready, err
}

// readyOne makes fork sb of one record ready to continue as its planned
// attempt: in place when the record allows it and the fork's supervisor
// is the recorded launch, to relaunch from its saved session otherwise.
// The figures say which, and why.
func (c *Coordinator) readyOne(ctx context.Context, s restoreStep, sb string) (*episode.Episode, EpisodeFigures, readiness, error) {
	r := s.Record
	f := EpisodeFigures{Episode: r.Episode, Resume: resumeRelaunch, ResumeWhy: fmt.Sprintf("the %s provider's snapshot kept files only (keeps_processes false): the harness is relaunched from its saved session", r.Provider)}
	if r.RestoresInPlace() {
		e, err := episode.ReadyInPlace(ctx, c.o.Env, s.Spec, sb, stateOf(r), s.Attempt)
		if err == nil {
			cf := e.Clock()
			f.Resume, f.ResumeWhy, f.Clock = resumeInPlace, "", &cf
			return e, f, readiness{InPlace: true}, nil
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
		default:
			return nil, f, readiness{}, err
		}
		c.log.Warn("resume in place impossible, relaunching", "episode", r.Episode, "why", f.ResumeWhy)
	} else if r.KeepsProcesses {
		f.ResumeWhy = "the record lacks the identity or the pause's clocks"
	}
	e, err := episode.ReadyRelaunch(ctx, c.o.Env, s.Spec, sb, r.HarnessSession, s.Attempt)
	return e, f, readiness{Why: f.ResumeWhy}, err
}

// finishDecided takes a decided restore past its point of no return: the
// gateway of every episode raised to its attempt, then every harness
// continued or started. An episode that cannot be continued is lost (its
// fork deleted); lost says why, one error each. eps and figs are the
// ready episodes and their figures, updated where an in-place resume
// turned into a relaunch.
func (c *Coordinator) finishDecided(ctx context.Context, x *op, plan []decision, eps map[string]*episode.Episode, figs map[string]EpisodeFigures) (map[string]outcome, []error) {
	var (
		mu   sync.Mutex
		out  = map[string]outcome{}
		lost []error
	)
	byEp := map[string]decision{}
	var ids []string
	for _, d := range plan {
		byEp[d.Episode] = d
		ids = append(ids, d.Episode)
	}
	fail := func(d decision, err error) {
		if x.dead() {
			return // a crash cleans nothing up
		}
		attempt, _ := c.gatewayAttempt(d.Episode)
		if derr := c.deleteSandbox(ctx, d.Sandbox); derr != nil {
			c.log.Warn("delete the fork of an episode a restore lost", "episode", d.Episode, "sandbox", d.Sandbox, "err", derr)
		}
		mu.Lock()
		defer mu.Unlock()
		out[d.Episode] = outcome{Attempt: attempt}
		lost = append(lost, err)
	}
	advanced := []string{}
	_ = c.each(ids, "advance", func(eid string) error {
		if err := x.step(stepAdvance, eid); err != nil {
			return err
		}
		if err := persist(func() error { return c.advance(byEp[eid]) }); err != nil {
			fail(byEp[eid], err)
			return err
		}
		mu.Lock()
		advanced = append(advanced, eid)
		mu.Unlock()
		return nil
	})
	sort.Strings(advanced)
	_ = c.each(advanced, "resume", func(eid string) error {
		d := byEp[eid]
		if err := x.step(stepGo, eid); err != nil {
			return err
		}
		if err := x.note(ctx, jGo, eid, jdoc{}); err != nil {
			fail(d, fmt.Errorf("episode %s: %w", eid, err))
			return err
		}
		// eps is written under mu as each episode goes (below): read it
		// under mu too. Unguarded, this read raced those writes and, with
		// enough episodes, the runtime ended the server ("concurrent map
		// read and map write": the three-node cycle soak, cycle 25).
		mu.Lock()
		ready := eps[eid]
		mu.Unlock()
		e, d2, err := c.goDecided(ctx, x, d, ready, false)
		if x.dead() {
			return err
		}
		if err != nil {
			fail(d, err)
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		eps[eid] = e
		out[eid] = outcome{Continued: true, Attempt: d2.Attempt, Mode: d2.Mode}
		if d2.Mode != d.Mode {
			f := figs[eid]
			f.Resume, f.Clock = d2.Mode, nil
			f.ResumeWhy = "the harness ended in the fork before the continue, so it is relaunched from its saved session"
			figs[eid] = f
		}
		return nil
	})
	return out, lost
}

// rewindFinished takes the ledger of each episode a restore brings back
// ended (it had finished at the checkpoint) back to the history its
// verdict was made on, the record's tip, if the ledger has moved on since
// (the episode was restored from an earlier checkpoint, or started again,
// after it). It can be repeated (a recovery does); each failure is
// returned, the others done.
func (c *Coordinator) rewindFinished(fin []finished) []error {
	var errs []error
	for _, f := range fin {
		if f.Tip == "" {
			continue // an older record: the ledger stays as it is
		}
		if err := persist(func() error { return c.o.Env.Gateway.Rewind(f.Episode, f.Tip) }); err != nil {
			errs = append(errs, fmt.Errorf("episode %s: restored ended, but its ledger was not taken back to the checkpoint's history: %w", f.Episode, err))
		}
	}
	return errs
}

// persist runs a step past a restore's point of no return until it
// succeeds, with a backoff, giving up (the episode is then lost) only
// after a dozen tries: harder than a cleanup's retry, since giving up
// costs an episode.
func persist(fn func() error) error {
	var err error
	for i := range persistTries {
		if err = fn(); err == nil {
			return nil
		}
		if i < persistTries-1 {
			time.Sleep(min(10*time.Millisecond<<i, time.Second)) // backoff between tries
		}
	}
	return err
}

const persistTries = 12

// gatewayAttempt is the gateway's attempt of an episode now.
func (c *Coordinator) gatewayAttempt(ep string) (int, error) {
	st, err := c.o.Env.Gateway.Episode(ep)
	return st.Attempt, err
}

// advance raises the gateway to a decided episode's attempt, unless it is
// there already (advance is repeated after a crash): in place, the ledger
// is cut to the recorded position in the same step; for a relaunch, the
// next call is matched against the ledger.
func (c *Coordinator) advance(d decision) error {
	now, err := c.gatewayAttempt(d.Episode)
	switch {
	case err != nil:
		return fmt.Errorf("episode %s: gateway: %w", d.Episode, err)
	case now == d.Attempt:
		return nil
	case now > d.Attempt:
		return errdefs.Errorf(errdefs.ErrConflict, "episode %s: the gateway is at attempt %d, past the %d this restore decided: another restore went first", d.Episode, now, d.Attempt)
	case now < d.Attempt-1:
		return fmt.Errorf("episode %s: the gateway is at attempt %d, more than one below the %d this restore decided", d.Episode, now, d.Attempt)
	}
	at := relay.LedgerAt{Position: d.Cut, Tip: d.Tip}
	if d.State != nil {
		at.Head = d.State.LedgerHead // an in-place cut checks the entry it ends at
		at.Unmatched = d.State.RelayUnmatched
	}
	st, err := c.o.Env.Gateway.Restore(d.Episode, d.Mode == resumeInPlace, at)
	if err != nil {
		return fmt.Errorf("episode %s: gateway: %w", d.Episode, err)
	}
	if st.Attempt != d.Attempt {
		return fmt.Errorf("episode %s: the gateway went to attempt %d, not the %d this restore decided", d.Episode, st.Attempt, d.Attempt)
	}
	return nil
}

// goDecided continues a decided episode whose gateway is at its attempt:
// e is its ready episode (nil after a crash: it is made ready again).
// maybeGone: a Go may have been sent already (after a crash), so a
// relaunch's supervisor that answers is not started twice. An in-place
// resume whose harness ended in the fork before the continue is
// relaunched there instead (relaunchInstead). It returns the episode and
// the decision as it ended up.
func (c *Coordinator) goDecided(ctx context.Context, x *op, d decision, e *episode.Episode, maybeGone bool) (*episode.Episode, decision, error) {
	spec, err := c.specOfEpisode(ctx, d.Episode)
	if err != nil {
		return nil, d, err
	}
	exited := func(err error) bool { return d.Mode == resumeInPlace && errors.Is(err, checkpoint.ErrExited) }
	if e == nil {
		_ = persist(func() error {
			e, err = c.readyAgain(ctx, spec, d)
			if exited(err) || errors.Is(err, episode.ErrNotSameLaunch) {
				return nil // not transient: decided below
			}
			return err
		})
		switch {
		case err == nil:
		case exited(err) && maybeGone:
			// Continued before the crash, and its harness has ended since.
			e, err = episode.Attach(ctx, c.o.Env, spec, d.Sandbox, d.Attempt)
			return e, d, err
		case exited(err):
			return c.relaunchInstead(ctx, x, spec, d)
		default:
			return nil, d, err
		}
	}
	if err := c.goRetrying(ctx, e, d, maybeGone); exited(err) {
		return c.relaunchInstead(ctx, x, spec, d)
	} else if err != nil {
		return nil, d, err
	}
	return e, d, nil
}

// goRetrying is e.Go, retried: each try after the first (and the first
// when a Go may have been sent before a crash) asks first whether the
// relaunch's supervisor already runs.
func (c *Coordinator) goRetrying(ctx context.Context, e *episode.Episode, d decision, maybeGone bool) error {
	old := maybeGone
	return persist(func() error {
		var launch *proc.Identity
		if old {
			launch = &d.Launch
		}
		old = true
		return e.Go(ctx, launch)
	})
}

// relaunchInstead relaunches an episode decided to resume in place whose
// harness ended in its fork before the continue: in the same fork, from
// its saved session, as the next attempt (journaled first).
func (c *Coordinator) relaunchInstead(ctx context.Context, x *op, spec episode.Spec, d decision) (*episode.Episode, decision, error) {
	d = d.relaunched(d.Attempt + 1)
	c.log.Warn("the harness ended in the fork before the continue: relaunching it there", "episode", d.Episode, "attempt", d.Attempt)
	if err := x.note(ctx, jRelaunch, d.Episode, jdoc{Attempt: d.Attempt}); err != nil {
		return nil, d, err
	}
	if err := persist(func() error { return c.advance(d) }); err != nil {
		return nil, d, err
	}
	var e *episode.Episode
	err := persist(func() error {
		var err error
		e, err = c.readyAgain(ctx, spec, d)
		return err
	})
	if err != nil {
		return nil, d, err
	}
	if err := x.note(ctx, jGo, d.Episode, jdoc{}); err != nil {
		return nil, d, err
	}
	return e, d, c.goRetrying(ctx, e, d, false)
}

// readyAgain makes a decided episode's fork ready again (the Ready steps
// may be repeated).
func (c *Coordinator) readyAgain(ctx context.Context, spec episode.Spec, d decision) (*episode.Episode, error) {
	if d.Mode == resumeInPlace {
		if d.State == nil {
			return nil, fmt.Errorf("episode %s: the journal's decision to resume it in place has no state to resume", d.Episode)
		}
		return episode.ReadyInPlace(ctx, c.o.Env, spec, d.Sandbox, *d.State, d.Attempt)
	}
	return episode.ReadyRelaunch(ctx, c.o.Env, spec, d.Sandbox, d.Session, d.Attempt)
}

// specOfEpisode is the spec of a stored episode.
func (c *Coordinator) specOfEpisode(ctx context.Context, id string) (episode.Spec, error) {
	row, err := c.o.Store.GetEpisode(ctx, id)
	if err != nil {
		return episode.Spec{}, err
	}
	return c.specOf(row)
}

// undoRestore deletes every fork of a restore that did not decide (those
// it knows of, and any carrying its label) and closes its journal; if a
// delete fails, the journal stays for the next coordinator to finish.
func (c *Coordinator) undoRestore(ctx context.Context, x *op, forks map[string]string) {
	seen := map[string]bool{}
	var sbs []string
	for _, sb := range forks {
		seen[sb] = true
		sbs = append(sbs, sb)
	}
	if infos, err := c.o.Env.Provider.List(context.WithoutCancel(ctx), map[string]string{labelOp: x.id}); err == nil {
		for _, info := range infos {
			if !seen[info.ID] {
				seen[info.ID] = true
				sbs = append(sbs, info.ID)
			}
		}
	}
	sort.Strings(sbs)
	ok := true
	for _, sb := range sbs {
		if err := c.deleteSandbox(ctx, sb); err != nil {
			ok = false
			c.log.Warn("delete a fork of a failed restore", "sandbox", sb, "err", err)
		}
	}
	if ok {
		if err := x.close(ctx, nil); err != nil {
			c.log.Warn("close the journal of a failed restore", "op", x.id, "err", err)
		}
	}
}

// rowsOf is the store's rows of the episodes of a restore.
func (c *Coordinator) rowsOf(ctx context.Context, plan []decision, fin []finished) map[string]store.Episode {
	rows := map[string]store.Episode{}
	for _, d := range plan {
		rows[d.Episode], _ = c.o.Store.GetEpisode(ctx, d.Episode)
	}
	for _, f := range fin {
		rows[f.Episode], _ = c.o.Store.GetEpisode(ctx, f.Episode)
	}
	return rows
}

// install makes the continued episodes of a restore live.
func (c *Coordinator) install(eps map[string]*episode.Episode, out map[string]outcome) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for eid, e := range eps {
		if out[eid].Continued {
			c.live[eid] = e
		}
	}
}

// restoredFigures are a restore's figures, in record order.
func restoredFigures(recs []store.Record, figs map[string]EpisodeFigures) []EpisodeFigures {
	var out []EpisodeFigures
	for _, r := range recs {
		if !r.Finished {
			out = append(out, figs[r.Episode])
			continue
		}
		f := EpisodeFigures{Episode: r.Episode, Finished: true, Resume: "none"}
		var v task.Verdict
		if json.Unmarshal(r.Result, &v) == nil {
			f.Reward = &v.Reward
		}
		out = append(out, f)
	}
	return out
}

// scope keeps the records a restore brings back: those of the episodes
// named (every name must be the checkpoint's), or, with no names, all but
// the retired episodes', which it returns as left out.
func (c *Coordinator) scope(ctx context.Context, id string, recs []store.Record, names []string) ([]store.Record, []EpisodeFigures, error) {
	if names != nil {
		for _, n := range names {
			if !slices.ContainsFunc(recs, func(r store.Record) bool { return r.Episode == n }) {
				return nil, nil, errdefs.Errorf(errdefs.ErrNotFound, "episode %s is not in checkpoint %s: name only its episodes (GET /v1/checkpoints/%s lists them)", n, id, id)
			}
		}
		return slices.DeleteFunc(recs, func(r store.Record) bool { return !slices.Contains(names, r.Episode) }), nil, nil
	}
	var left []EpisodeFigures
	keep := recs[:0:0]
	for _, r := range recs {
		if row, err := c.o.Store.GetEpisode(ctx, r.Episode); err == nil && row.State == store.EpisodeRetired {
			left = append(left, EpisodeFigures{Episode: r.Episode, Excluded: true, Resume: "none",
				Reason: "retired since the checkpoint: left out (name it in the restore to bring it back as its next attempt)"})
			continue
		}
		keep = append(keep, r)
	}
	return keep, left, nil
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
