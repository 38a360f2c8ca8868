package coordinator

import (
	"encoding/json"
	"fmt"
	"sort"

	"stasis/internal/control/checkpoint"
	"stasis/internal/proc"
	"stasis/internal/storage/store"
)

// The kinds of the journal's entries. Each is written before the step it
// names creates anything; the entry after a creating step (snapshot,
// forked) says what the step made, and is missing when the process died
// before the step's answer came.
const (
	// A prepare: its first entry names the checkpoint.
	jPrepare = "prepare"
	// Episode's pause seq is about to be sent, and its sandbox then
	// snapshotted under name: {sandbox, seq, name}.
	jPause = "pause"
	// The snapshot of the pause was made: {snapshot}.
	jSnapshot = "snapshot"

	// A restore: its first entry names the checkpoint and the label its
	// forks carry, and the outside decision it waits on, if any
	// (RestoreOptions.Ref).
	jRestore = "restore"
	// Episode's snapshot is about to be forked: {snapshot}.
	jFork = "fork"
	// The fork was made: {sandbox}.
	jForked = "forked"
	// The point of no return: every fork is made and ready, and the
	// gateway's attempts are about to be raised (with the in-place
	// ledger cuts), the harnesses continued and the store's episodes
	// written: {plan, finished}.
	jDecide = "decide"
	// Every fork is made and ready, and the restore waits on an outside
	// decision (RestoreOptions.Ref) to go: the plan it then decides
	// ({plan, finished}). A recovery finds out from Options.Decisions
	// whether it went, and rolls this plan forward or undoes it.
	jReady = "ready"
	// Episode's harness is about to be continued or started (Go).
	jGo = "go"
	// Episode, decided to resume in place, is relaunched in its fork
	// instead (its harness ended there before the continue): {attempt}.
	jRelaunch = "relaunch"

	// A branch: its first entry names the checkpoint (and the episode).
	// Its forks are journaled as a restore's (jFork once, then jForked
	// for each copy, the entry's episode the copy's name).
	jBranch = "branch"
	// Copy episode is about to be registered at the gateway (a ledger of
	// its own) and continued.
	jRegister = "register"

	// Episode is about to be started: registered at the gateway and its
	// sandbox (labelled with the start) made; its row is written as the
	// journal is closed.
	jStart = "start"
)

// labelOp is the label each fork of a restore carries: the restore's
// operation id, so that a fork whose Fork call's answer was lost (the
// server died) is found and deleted all the same.
const labelOp = "stasis.op"

// jdoc is a journal entry's document: the fields its kind uses.
type jdoc struct {
	Checkpoint string     `json:"checkpoint,omitempty"`
	Sandbox    string     `json:"sandbox,omitempty"`
	Snapshot   string     `json:"snapshot,omitempty"`
	Name       string     `json:"name,omitempty"`
	Seq        int64      `json:"seq,omitempty"`
	Attempt    int        `json:"attempt,omitempty"`
	Plan       []decision `json:"plan,omitempty"`
	Finished   []finished `json:"finished,omitempty"`
	Ref        string     `json:"ref,omitempty"`
}

// Resume modes of a decided episode (also EpisodeFigures.Resume).
const (
	resumeInPlace  = "in_place"
	resumeRelaunch = "relaunch"
)

// decision is how one episode of a restore continues once the restore
// has passed its point of no return.
type decision struct {
	Episode string `json:"episode"`
	Sandbox string `json:"sandbox"`
	// Mode is in_place or relaunch.
	Mode string `json:"mode"`
	// Attempt is the gateway attempt the episode continues as.
	Attempt int `json:"attempt"`
	// Cut is where an in-place resume cuts the ledger.
	Cut int64 `json:"cut,omitempty"`
	// Seq is the pause an in-place resume continues.
	Seq int64 `json:"seq,omitempty"`
	// Session is the harness's saved session a relaunch resumes.
	Session string `json:"session,omitempty"`
	// Launch is the recorded launch's identity: a relaunch's supervisor
	// is told from it.
	Launch proc.Identity `json:"launch"`
	// PauseSeq is the record's pause number (the store's pause_seq
	// after the restore is at least this).
	PauseSeq int64 `json:"pause_seq,omitempty"`
	// State is what an in-place resume continues from (its record's).
	State *checkpoint.State `json:"state,omitempty"`
	// Tip is the record's ledger tip: the gateway takes the ledger back
	// there (a branch) if it has moved on past it.
	Tip string `json:"tip,omitempty"`
}

// relaunched is d turned from an in-place resume into a relaunch in the
// same fork as attempt.
func (d decision) relaunched(attempt int) decision {
	d.Mode, d.Attempt, d.Seq, d.Cut, d.State = resumeRelaunch, attempt, 0, 0, nil
	return d
}

// finished is an episode of a restored checkpoint that had ended at the
// checkpoint: it gets no fork, only its row, and its ledger is taken back
// to the history its verdict was made on (Tip, the record's ledger tip;
// "" in older records) if it has moved on since.
type finished struct {
	Episode string `json:"episode"`
	Attempt int    `json:"attempt"`
	Tip     string `json:"tip,omitempty"`
}

// pauseIntent is a prepare's journaled pause of one episode.
type pauseIntent struct {
	Episode, Sandbox, Name string
	Seq                    int64
	// Snapshot is the snapshot made, when its id was journaled.
	Snapshot string
}

// opState is one operation as its journal leaves it.
type opState struct {
	ID         string
	Kind       string // jPrepare or jRestore
	Checkpoint string
	// A prepare's pauses, in the order journaled.
	Pauses []pauseIntent
	// A restore's forks: episode → snapshot about to be forked, and
	// episode → fork made.
	Forks  map[string]string
	Forked map[string]string
	// Decided is the plan of a restore past its point of no return (nil
	// before it); Finished its ended episodes.
	Decided  []decision
	Finished []finished
	// Ref is the outside decision a restore waits on (RestoreOptions.Ref),
	// and Readied the plan it journaled as ready for it (nil before):
	// the plan to roll forward if the decision went ahead.
	Ref             string
	Readied         []decision
	ReadiedFinished []finished
	// Gone: episodes whose Go was journaled.
	Gone map[string]bool
	// Registered: a branch's copies whose registration was journaled, or
	// the episode a start registers.
	Registered []string
}

// foldJournal reads the journal's entries into the operations they
// describe, in the order each began. An entry it cannot read is a
// problem, and its operation is left out (not finished, not undone: a
// later stasis may know it).
func foldJournal(entries []store.JournalEntry) ([]*opState, []Problem) {
	ops := map[string]*opState{}
	var order []string
	var problems []Problem
	bad := map[string]bool{}
	for _, e := range entries {
		s, ok := ops[e.Op]
		if !ok {
			s = &opState{ID: e.Op, Forks: map[string]string{}, Forked: map[string]string{}, Gone: map[string]bool{}}
			ops[e.Op] = s
			order = append(order, e.Op)
		}
		var d jdoc
		if len(e.Doc) > 0 {
			if err := json.Unmarshal(e.Doc, &d); err != nil {
				problems = append(problems, Problem{Kind: ProblemJournal, Episode: e.Episode, Detail: fmt.Sprintf("operation %s: journal entry %d (%s) is unreadable: %v", e.Op, e.Seq, e.Kind, err)})
				bad[e.Op] = true
				continue
			}
		}
		switch e.Kind {
		case jPrepare, jRestore, jBranch:
			s.Kind, s.Checkpoint, s.Ref = e.Kind, d.Checkpoint, d.Ref
		case jStart:
			s.Kind = e.Kind
			s.Registered = append(s.Registered, e.Episode)
		case jRegister:
			s.Registered = append(s.Registered, e.Episode)
		case jPause:
			s.Pauses = append(s.Pauses, pauseIntent{Episode: e.Episode, Sandbox: d.Sandbox, Name: d.Name, Seq: d.Seq})
		case jSnapshot:
			for i := range s.Pauses {
				if s.Pauses[i].Episode == e.Episode && s.Pauses[i].Snapshot == "" {
					s.Pauses[i].Snapshot = d.Snapshot
				}
			}
		case jFork:
			s.Forks[e.Episode] = d.Snapshot
		case jForked:
			s.Forked[e.Episode] = d.Sandbox
		case jDecide:
			s.Decided, s.Finished = d.Plan, d.Finished
			if s.Decided == nil {
				s.Decided = []decision{}
			}
		case jReady:
			s.Readied, s.ReadiedFinished = d.Plan, d.Finished
			if s.Readied == nil {
				s.Readied = []decision{}
			}
		case jGo:
			s.Gone[e.Episode] = true
		case jRelaunch:
			for i := range s.Decided {
				if s.Decided[i].Episode == e.Episode {
					s.Decided[i] = s.Decided[i].relaunched(d.Attempt)
				}
			}
			// The relaunch is a Go of its own.
			delete(s.Gone, e.Episode)
		default:
			problems = append(problems, Problem{Kind: ProblemJournal, Episode: e.Episode, Detail: fmt.Sprintf("operation %s: journal entry %d is of a kind this stasis does not know (%q)", e.Op, e.Seq, e.Kind)})
			bad[e.Op] = true
		}
	}
	var out []*opState
	for _, id := range order {
		s := ops[id]
		switch {
		case bad[id]:
		case s.Kind == "":
			problems = append(problems, Problem{Kind: ProblemJournal, Detail: fmt.Sprintf("operation %s: its journal has no first entry naming what it was", id)})
		default:
			out = append(out, s)
		}
	}
	return out, problems
}

// forkedSandboxes is every fork a restore's journal names, sorted.
func (s *opState) forkedSandboxes() []string {
	var sbs []string
	for _, sb := range s.Forked {
		sbs = append(sbs, sb)
	}
	sort.Strings(sbs)
	return sbs
}
