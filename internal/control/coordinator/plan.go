package coordinator

// The coordinator's decisions, made by pure functions: facts in (records,
// store rows, what the provider and the gateway said), a plan of actions
// and typed problems out. The executors (prepare.go, restore.go,
// recover.go) gather the facts, call these, and perform what they return;
// the tests step these without processes, sockets or clocks.

import (
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	"stasis/internal/control/checkpoint"
	"stasis/internal/control/episode"
	"stasis/internal/storage/store"
)

// ProblemKind says what a Problem is about.
type ProblemKind int

// The kinds of problems the planners find.
const (
	// ProblemProvider: the record was made on another provider.
	ProblemProvider ProblemKind = iota + 1
	// ProblemLive: the episode is live (retire it first).
	ProblemLive
	// ProblemEpisode: the store has no usable row for the episode, or
	// its task or harness is unknown here.
	ProblemEpisode
	// ProblemImage: the image the record ran on is not here.
	ProblemImage
	// ProblemSnapshot: the record's snapshot cannot be forked.
	ProblemSnapshot
	// ProblemGateway: the gateway does not know the episode.
	ProblemGateway
	// ProblemJournal: a journal entry cannot be read or acted on.
	ProblemJournal
	// ProblemLeft: recovery could not find or undo something an
	// interrupted operation may have made.
	ProblemLeft
)

// Problem is one reason a restore is refused, or one thing a recovery
// could not do, found before anything is touched. Its message names the
// episode and what to do.
type Problem struct {
	Kind    ProblemKind
	Episode string
	Detail  string
}

func (p Problem) Error() string { return p.Detail }

// problemsError is a refusal's error: the problems, one a line, matching
// ErrRefused.
func problemsError(head string, ps []Problem) error {
	lines := make([]string, len(ps))
	for i, p := range ps {
		lines[i] = p.Detail
	}
	return refused{head + ":\n  " + strings.Join(lines, "\n  ")}
}

// restoreFacts is what a restore is planned from, gathered before any
// provider or gateway state is changed.
type restoreFacts struct {
	Checkpoint string
	Records    []store.Record
	// Provider is the provider this coordinator runs.
	Provider string
	// Live is the set of live episodes.
	Live map[string]bool
	// Specs: the episode's spec (from its store row), or why there is
	// none (no row, an unknown task or harness).
	Specs    map[string]episode.Spec
	SpecErrs map[string]error
	// What keeps each unfinished record from being forked: its image
	// not here, its snapshot gone (messages naming the episode).
	ImageErrs    map[string]error
	SnapshotErrs map[string]error
	// Attempts is the gateway's attempt of each episode, or why it has
	// none.
	Attempts    map[string]int
	AttemptErrs map[string]error
	// Now is when the restore runs: its forks expire from it.
	Now time.Time
}

// restoreStep is one episode of a planned restore.
type restoreStep struct {
	Record store.Record
	// Spec is the episode's spec, its forks' expiry set.
	Spec episode.Spec
	// Attempt is the gateway attempt the restore makes (one above the
	// gateway's now).
	Attempt int
}

// restorePlan is what a restore does: fork and continue each unfinished
// record, mark each finished one ended.
type restorePlan struct {
	Checkpoint string
	Fork       []restoreStep // the unfinished records, in record order
	Finished   []finished
}

// planRestore checks every record of a restore before any provider is
// touched: each must have been made on this provider, name an episode
// that is not live and that the store and the gateway know, and (unless
// it had finished) a snapshot and an image that are here. Problems refuse
// the restore; otherwise the plan says what to fork and continue as which
// attempt.
func planRestore(f restoreFacts) (restorePlan, []Problem) {
	p := restorePlan{Checkpoint: f.Checkpoint}
	var problems []Problem
	for _, r := range f.Records {
		ep := r.Episode
		if r.Provider != f.Provider {
			problems = append(problems, Problem{ProblemProvider, ep, fmt.Sprintf("episode %s: recorded on provider %s, this coordinator runs %s", ep, r.Provider, f.Provider)})
		}
		if f.Live[ep] {
			problems = append(problems, Problem{ProblemLive, ep, fmt.Sprintf("episode %s is live: retire it before restoring it", ep)})
		}
		spec, ok := f.Specs[ep]
		if err := f.SpecErrs[ep]; err != nil || !ok {
			if err == nil {
				err = fmt.Errorf("episode %s: no spec", ep)
			}
			problems = append(problems, Problem{ProblemEpisode, ep, err.Error()})
			continue
		}
		if r.Finished {
			p.Finished = append(p.Finished, finished{Episode: ep, Attempt: r.Attempt, Tip: r.LedgerTip})
			continue
		}
		if err := f.ImageErrs[ep]; err != nil {
			problems = append(problems, Problem{ProblemImage, ep, err.Error()})
		}
		if err := f.SnapshotErrs[ep]; err != nil {
			problems = append(problems, Problem{ProblemSnapshot, ep, fmt.Sprintf("episode %s: snapshot %s: %v", ep, r.SnapshotID, err)})
		}
		attempt, ok := f.Attempts[ep]
		if err := f.AttemptErrs[ep]; err != nil || !ok {
			if err == nil {
				err = errors.New("not registered")
			}
			problems = append(problems, Problem{ProblemGateway, ep, fmt.Sprintf("episode %s: the gateway cannot continue it: %v", ep, err)})
			continue
		}
		spec.Expiry = spec.ExpiryFrom(f.Now)
		p.Fork = append(p.Fork, restoreStep{Record: r, Spec: spec, Attempt: attempt + 1})
	}
	return p, problems
}

// readiness is how the ready step of one episode went: whether its fork
// resumes in place, and why not.
type readiness struct {
	InPlace bool
	Why     string
}

// decide writes the decision record of a restore whose every fork is
// ready: each episode's sandbox, mode and attempt.
func decide(p restorePlan, forks map[string]string, ready map[string]readiness) []decision {
	out := make([]decision, 0, len(p.Fork))
	for _, s := range p.Fork {
		r := s.Record
		d := decision{Episode: r.Episode, Sandbox: forks[r.Episode], Mode: resumeRelaunch, Attempt: s.Attempt, Session: r.HarnessSession, PauseSeq: r.PauseSeq, Tip: r.LedgerTip}
		if r.Identity != nil {
			d.Launch = *r.Identity
		}
		if ready[r.Episode].InPlace {
			st := stateOf(r)
			d.Mode, d.Seq, d.Cut, d.State = resumeInPlace, r.PauseSeq, st.LedgerCut(), &st
		}
		out = append(out, d)
	}
	return out
}

// stateOf is the checkpoint state a record keeps.
func stateOf(r store.Record) checkpoint.State {
	st := checkpoint.State{Episode: r.Episode, PauseSeq: r.PauseSeq, RelayDelivered: r.RelayDelivered, RelayPosition: r.RelayPosition, RelayUnmatched: r.RelayUnmatched, LedgerHead: r.LedgerHead, LedgerTip: r.LedgerTip, HarnessSession: r.HarnessSession, Attempt: r.Attempt}
	if r.RestoresInPlace() {
		st.Identity, st.PauseWall, st.PauseUptime = *r.Identity, *r.PauseWall, *r.PauseUptime
	}
	return st
}

// outcome is what became of one decided episode.
type outcome struct {
	// Continued: its harness runs (or ran) in its fork as Attempt.
	Continued bool
	// Attempt is the gateway's attempt of the episode now: the decided
	// one once the gateway was raised, its earlier one otherwise.
	Attempt int
	Mode    string
}

// restoredRows are the store's episodes after a restore: each continued
// one running in its fork as its new attempt, each that could not be
// continued lost (its fork deleted), each finished one ended with the
// attempt that ended. rows are the episodes' rows before.
func restoredRows(rows map[string]store.Episode, plan []decision, fin []finished, out map[string]outcome) []store.Episode {
	var es []store.Episode
	for _, d := range plan {
		row := rows[d.Episode]
		o := out[d.Episode]
		row.PauseSeq = max(row.PauseSeq, d.PauseSeq)
		if o.Attempt > row.Attempt {
			row.Attempt = o.Attempt
		}
		if o.Continued {
			row.State, row.Sandbox, row.Resume = store.EpisodeRunning, d.Sandbox, o.Mode
		} else {
			row.State, row.Sandbox = store.EpisodeLost, ""
		}
		es = append(es, row)
	}
	for _, f := range fin {
		row := rows[f.Episode]
		row.State, row.Sandbox, row.Attempt = store.EpisodeEnded, "", f.Attempt
		es = append(es, row)
	}
	sort.Slice(es, func(i, j int) bool { return es[i].ID < es[j].ID })
	return es
}

// prepareResult is how one episode of a prepare went.
type prepareResult struct {
	Episode string
	// Recorded: its record is in the checkpoint.
	Recorded bool
	// Snapshot is the snapshot made of it ("" if none).
	Snapshot string
	// Err is why it could not be checkpointed (nil if it was).
	Err error
	// Cancelled: Err came from the caller's context, not the episode.
	Cancelled bool
}

// prepareOutcome is what a prepare does once every episode is done.
type prepareOutcome struct {
	// Commit: the checkpoint is committed with Records records;
	// otherwise it fails for Err.
	Commit  bool
	Records int
	Err     error
	// Excluded: stragglers the checkpoint is committed without, and why.
	Excluded map[string]string
	// DeleteSnapshots: the snapshots no committed record will name.
	DeleteSnapshots []string
}

// decidePrepare decides a prepare's end from each episode's result: an
// episode that failed of its own is a straggler, excluded (its snapshot
// deleted) under StragglersExclude, or failing the checkpoint under
// StragglersFail; a record the store would not take, or a cancelled
// context, fails it; so does a checkpoint none of whose episodes could
// be recorded. A failed checkpoint's snapshots are all deleted.
func decidePrepare(policy string, ids []string, results map[string]prepareResult) prepareOutcome {
	o := prepareOutcome{Excluded: map[string]string{}}
	var errs []error
	var keep []string
	for _, id := range ids {
		r := results[id]
		switch {
		case r.Err == nil:
			if r.Recorded {
				o.Records++
			}
			if r.Snapshot != "" {
				keep = append(keep, r.Snapshot)
			}
		case r.Cancelled || errors.Is(r.Err, errRecord):
			errs = append(errs, r.Err)
			if r.Snapshot != "" {
				o.DeleteSnapshots = append(o.DeleteSnapshots, r.Snapshot)
			}
		case policy == StragglersExclude:
			o.Excluded[id] = r.Err.Error()
			if r.Snapshot != "" {
				o.DeleteSnapshots = append(o.DeleteSnapshots, r.Snapshot)
			}
		default:
			errs = append(errs, fmt.Errorf("%w: %w", ErrStraggler, r.Err))
			if r.Snapshot != "" {
				o.DeleteSnapshots = append(o.DeleteSnapshots, r.Snapshot)
			}
		}
	}
	o.Err = errors.Join(errs...)
	if o.Err == nil && len(ids) > 0 && o.Records == 0 {
		// Nothing to commit: every episode straggled.
		var why []error
		for _, id := range ids {
			why = append(why, errors.New(o.Excluded[id]))
		}
		o.Err = fmt.Errorf("%w: none could: %w", ErrStraggler, errors.Join(why...))
	}
	o.Commit = o.Err == nil
	if !o.Commit {
		o.DeleteSnapshots = append(o.DeleteSnapshots, keep...)
	}
	sort.Strings(o.DeleteSnapshots)
	return o
}

// errRecord marks a prepare's failure to write a record into the store
// (not the episode's fault: it fails the checkpoint, whatever the policy).
var errRecord = errors.New("record")

// lostRow is the row of an episode whose sandbox is gone (or dead), as
// the coordinator marks it when it notices: lost, for a restore to bring
// back, except an ended episode whose verdict is captured, which lost
// nothing but its sandbox and stays ended. sandboxGone: nothing of the
// sandbox is left to delete (the row then names none).
func lostRow(row store.Episode, sandboxGone, verdict bool) store.Episode {
	if sandboxGone {
		row.Sandbox = ""
	}
	if row.State != store.EpisodeEnded || !verdict {
		row.State = store.EpisodeLost
	}
	return row
}

// Recovery: what a new coordinator does about an operation a dead one
// left unfinished.

// actionKind is what a recovery action does.
type actionKind int

const (
	// actFail marks the prepare's pending checkpoint failed.
	actFail actionKind = iota + 1
	// actDeleteSnapshot deletes a snapshot no committed checkpoint names.
	actDeleteSnapshot
	// actContinue lifts a prepare's pause of a live episode.
	actContinue
	// actDeleteSandbox deletes a fork of a restore that is undone.
	actDeleteSandbox
	// actRollForward finishes a decided restore's episode: the gateway
	// raised to its attempt, its harness continued in its fork.
	actRollForward
	// actLose marks a decided restore's episode lost: its fork is gone.
	actLose
	// actUnregister removes a branch's copy from the gateway.
	actUnregister
	// actClose closes the operation's journal, writing the episodes'
	// rows when it is a restore rolled forward.
	actClose
)

// action is one step of a recovery.
type action struct {
	Kind       actionKind
	Episode    string
	Sandbox    string
	Snapshot   string
	Checkpoint string
	Seq        int64
	Decision   decision
	// Gone: the Go of a roll-forward's episode may have been sent.
	Gone bool
}

// recoveryFacts is what recovering one interrupted operation is planned
// from, gathered by the executor.
type recoveryFacts struct {
	// State is the operation's checkpoint's state ("" when the store has
	// no such checkpoint).
	State store.State
	// Recorded are the snapshots its records name.
	Recorded []string
	// Found: snapshots found by sandbox and name (key sandbox+"/"+name)
	// for the pauses whose snapshot id was not journaled; CanFind says
	// whether the provider can look them up at all.
	Found   map[string][]string
	CanFind bool
	// Labelled are the sandboxes carrying the restore's label.
	Labelled []string
	// Alive: the sandboxes of a decided restore that still run.
	Alive map[string]bool
}

// planRecovery decides what to do about an operation a dead coordinator
// left unfinished. The rule:
//
//   - A prepare is finished as far as it got: if its checkpoint was
//     committed, the snapshots the journal names that no record of it
//     names are deleted; otherwise the checkpoint is marked failed and
//     every snapshot the journal names, or that its records name, is
//     deleted. Either way every pause it journaled is continued.
//   - A restore that had not decided (before its point of no return:
//     nothing outside its forks had changed) is undone: every fork the
//     journal names, or that carries its label, is deleted; the store's
//     episodes and the ledgers are untouched.
//   - A restore that had decided is rolled forward: each episode whose
//     fork still runs is continued (the gateway raised to the decided
//     attempt, with the in-place cut, if it was not yet; then continued
//     or relaunched); one whose fork is gone is marked lost; any other
//     sandbox with its label is deleted; then the store's episodes are
//     written with the journal's close.
//   - A branch (whose copies' rows are written only with its journal's
//     close) is undone: every fork the journal names or that carries its
//     label is deleted, and every copy it registered is removed from the
//     gateway. So is a start (its sandbox carries its label).
func planRecovery(s *opState, f recoveryFacts) ([]action, []Problem) {
	var acts []action
	var problems []Problem
	switch s.Kind {
	case jPrepare:
		committed := f.State == store.StateCommitted
		keep := map[string]bool{}
		if committed {
			for _, id := range f.Recorded {
				keep[id] = true
			}
		}
		if f.State == store.StatePending {
			acts = append(acts, action{Kind: actFail, Checkpoint: s.Checkpoint})
		}
		deleted := map[string]bool{}
		del := func(ep, id string) {
			if id != "" && !keep[id] && !deleted[id] {
				deleted[id] = true
				acts = append(acts, action{Kind: actDeleteSnapshot, Episode: ep, Snapshot: id})
			}
		}
		for _, p := range s.Pauses {
			del(p.Episode, p.Snapshot)
			for _, id := range f.Found[p.Sandbox+"/"+p.Name] {
				del(p.Episode, id)
			}
			if p.Snapshot == "" && !f.CanFind {
				problems = append(problems, Problem{ProblemLeft, p.Episode, fmt.Sprintf("episode %s: checkpoint %s may have made snapshot %q of sandbox %s before the server stopped, and this provider cannot look snapshots up by name: delete it by hand if it is there", p.Episode, s.Checkpoint, p.Name, p.Sandbox)})
			}
		}
		for _, id := range f.Recorded {
			del("", id)
		}
		for _, p := range s.Pauses {
			acts = append(acts, action{Kind: actContinue, Episode: p.Episode, Sandbox: p.Sandbox, Seq: p.Seq})
		}
	case jBranch, jStart:
		acts = append(acts, deleteForks(s, f)...)
		for _, name := range s.Registered {
			acts = append(acts, action{Kind: actUnregister, Episode: name})
		}
	case jRestore:
		if s.Decided == nil {
			acts = append(acts, deleteForks(s, f)...)
			break
		}
		planned := map[string]bool{}
		for _, d := range s.Decided {
			planned[d.Sandbox] = true
			if f.Alive[d.Sandbox] {
				acts = append(acts, action{Kind: actRollForward, Episode: d.Episode, Sandbox: d.Sandbox, Decision: d, Gone: s.Gone[d.Episode]})
			} else {
				acts = append(acts, action{Kind: actLose, Episode: d.Episode, Sandbox: d.Sandbox, Decision: d})
			}
		}
		for _, sb := range f.Labelled {
			if !planned[sb] {
				acts = append(acts, action{Kind: actDeleteSandbox, Sandbox: sb})
				planned[sb] = true
			}
		}
	}
	acts = append(acts, action{Kind: actClose, Checkpoint: s.Checkpoint})
	return acts, problems
}

// deleteForks deletes every fork an undone operation's journal names or
// that carries its label.
func deleteForks(s *opState, f recoveryFacts) []action {
	var acts []action
	seen := map[string]bool{}
	for _, sb := range append(s.forkedSandboxes(), f.Labelled...) {
		if !seen[sb] {
			seen[sb] = true
			acts = append(acts, action{Kind: actDeleteSandbox, Sandbox: sb})
		}
	}
	return acts
}
