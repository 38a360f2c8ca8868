package coordinator

import (
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"stasis/internal/control/episode"
	"stasis/internal/control/task"
	"stasis/internal/proc"
	"stasis/internal/storage/store"
)

// The planners are pure: these tests hand them facts and read the plans,
// with no process, sandbox, socket or clock.

func i64(n int64) *int64     { return &n }
func f64(f float64) *float64 { return &f }

// rec is a record of a paused episode on the local provider; inPlace gives
// it what an in-place resume needs.
func rec(ep string, inPlace bool) store.Record {
	r := store.Record{Episode: ep, Provider: "local", SnapshotID: "snap-" + ep, PauseSeq: 3, Attempt: 1, RelayDelivered: i64(4), HarnessSession: "ses-" + ep,
		Identity: &proc.Identity{PID: 7, StartTime: 70}}
	if inPlace {
		r.KeepsProcesses, r.PauseWall, r.PauseUptime, r.RelayPosition = true, f64(100), f64(10), i64(5)
	}
	return r
}

func finishedRec(ep string) store.Record {
	return store.Record{Episode: ep, Provider: "local", Finished: true, Attempt: 2}
}

func facts(recs ...store.Record) restoreFacts {
	f := restoreFacts{
		Checkpoint: "ck", Records: recs, Provider: "local", Now: time.Unix(1_000_000, 0),
		Live: map[string]bool{}, Specs: map[string]episode.Spec{}, SpecErrs: map[string]error{},
		ImageErrs: map[string]error{}, SnapshotErrs: map[string]error{}, Attempts: map[string]int{}, AttemptErrs: map[string]error{},
	}
	for _, r := range recs {
		f.Specs[r.Episode] = episode.Spec{ID: r.Episode, Task: &task.Task{ID: "t", BudgetS: 60}}
		f.Attempts[r.Episode] = 1
	}
	return f
}

func TestPlanRestore(t *testing.T) {
	for _, tc := range []struct {
		name   string
		recs   []store.Record
		change func(*restoreFacts)
		// problems: kind:episode, in order; or the plan: episode@attempt
		// to fork, and the finished ones.
		problems []string
		fork     []string
		finished []string
	}{
		{name: "every record restores", recs: []store.Record{rec("a", false), finishedRec("b"), rec("c", true)},
			change: func(f *restoreFacts) { f.Attempts["c"] = 4 },
			fork:   []string{"a@2", "c@5"}, finished: []string{"b@2"}},
		{name: "a live episode is refused", recs: []store.Record{rec("a", false), rec("b", false)},
			change:   func(f *restoreFacts) { f.Live["b"] = true },
			problems: []string{"live:b"}},
		{name: "another provider's record", recs: []store.Record{rec("a", false)},
			change:   func(f *restoreFacts) { f.Provider = "microvm" },
			problems: []string{"provider:a"}},
		{name: "no row: nothing else is asked of it", recs: []store.Record{rec("a", false), finishedRec("b")},
			change: func(f *restoreFacts) {
				f.SpecErrs["a"] = errors.New(`episode a: episode "a": not found`)
				delete(f.Specs, "b")
			},
			problems: []string{"episode:a", "episode:b"}},
		{name: "snapshot and image gone", recs: []store.Record{rec("a", false)},
			change: func(f *restoreFacts) {
				f.ImageErrs["a"] = errors.New("episode a: its image sha256:1 is no longer on this host")
				f.SnapshotErrs["a"] = errors.New("no such snapshot")
			},
			problems: []string{"image:a", "snapshot:a"}},
		{name: "the gateway does not know it", recs: []store.Record{rec("a", false)},
			change:   func(f *restoreFacts) { delete(f.Attempts, "a"); f.AttemptErrs["a"] = errors.New("unknown episode") },
			problems: []string{"gateway:a"}},
		{name: "a finished record needs no snapshot and no gateway", recs: []store.Record{finishedRec("b")},
			change:   func(f *restoreFacts) { delete(f.Attempts, "b"); f.SnapshotErrs["b"] = errors.New("gone") },
			finished: []string{"b@2"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := facts(tc.recs...)
			if tc.change != nil {
				tc.change(&f)
			}
			plan, problems := planRestore(f)
			kinds := map[ProblemKind]string{ProblemProvider: "provider", ProblemLive: "live", ProblemEpisode: "episode", ProblemImage: "image", ProblemSnapshot: "snapshot", ProblemGateway: "gateway"}
			var got []string
			for _, p := range problems {
				got = append(got, kinds[p.Kind]+":"+p.Episode)
				if !strings.Contains(p.Error(), p.Episode) {
					t.Errorf("problem %q does not name episode %s", p.Error(), p.Episode)
				}
			}
			if !reflect.DeepEqual(got, tc.problems) {
				t.Fatalf("problems %v, want %v", got, tc.problems)
			}
			if len(problems) > 0 {
				return
			}
			var fork, fin []string
			for _, s := range plan.Fork {
				fork = append(fork, fmt.Sprintf("%s@%d", s.Record.Episode, s.Attempt))
				if want := f.Now.Add(2*time.Minute + 10*time.Minute); !s.Spec.Expiry.Equal(want) {
					t.Errorf("%s: forks expire at %v, want %v (from the restore's clock)", s.Record.Episode, s.Spec.Expiry, want)
				}
			}
			for _, x := range plan.Finished {
				fin = append(fin, fmt.Sprintf("%s@%d", x.Episode, x.Attempt))
			}
			if !reflect.DeepEqual(fork, tc.fork) || !reflect.DeepEqual(fin, tc.finished) {
				t.Fatalf("fork %v finished %v, want %v %v", fork, fin, tc.fork, tc.finished)
			}
		})
	}
}

// The refusal keeps the messages a user has seen, and matches ErrRefused.
func TestRefusalMessage(t *testing.T) {
	f := facts(rec("ep-b", false), rec("ep-c", false))
	f.Live["ep-b"], f.Live["ep-c"] = true, true
	_, problems := planRestore(f)
	err := problemsError("checkpoint ck cannot be restored; nothing was changed", problems)
	if !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "ep-b is live") || !strings.Contains(err.Error(), "ep-c is live: retire it before restoring it") {
		t.Fatalf("refusal: %v", err)
	}
}

func TestDecide(t *testing.T) {
	f := facts(rec("a", false), rec("b", true), rec("c", true))
	f.Records[1].RelayPosition = nil // an older record: cut at the delivered count
	plan, problems := planRestore(f)
	if len(problems) > 0 {
		t.Fatal(problems)
	}
	forks := map[string]string{"a": "sb-a", "b": "sb-b", "c": "sb-c"}
	// c's fork was not the recorded launch: relaunched.
	ready := map[string]readiness{"b": {InPlace: true}, "c": {Why: "not the recorded launch"}}
	got := decide(plan, forks, ready)
	var desc []string
	for _, d := range got {
		desc = append(desc, fmt.Sprintf("%s %s %s attempt %d cut %d seq %d session %s state %v", d.Episode, d.Sandbox, d.Mode, d.Attempt, d.Cut, d.Seq, d.Session, d.State != nil))
		if d.Launch != (proc.Identity{PID: 7, StartTime: 70}) || d.PauseSeq != 3 {
			t.Errorf("%s: launch %+v pause seq %d", d.Episode, d.Launch, d.PauseSeq)
		}
	}
	want := []string{
		"a sb-a relaunch attempt 2 cut 0 seq 0 session ses-a state false",
		"b sb-b in_place attempt 2 cut 4 seq 3 session ses-b state true",
		"c sb-c relaunch attempt 2 cut 0 seq 0 session ses-c state false",
	}
	if strings.Join(desc, "\n") != strings.Join(want, "\n") {
		t.Fatalf("decisions\n%s\nwant\n%s", strings.Join(desc, "\n"), strings.Join(want, "\n"))
	}
	// The decision survives the journal.
	b, _ := json.Marshal(jdoc{Plan: got})
	var back jdoc
	if err := json.Unmarshal(b, &back); err != nil || !reflect.DeepEqual(back.Plan, got) {
		t.Fatalf("through JSON: %+v %v", back.Plan, err)
	}
	// A record whose relay had not learned its place (relaunched, no
	// answer since) is resumed in place without a cut: the gateway
	// matches its next call, as a relaunch's.
	f.Records[1].RelayUnmatched = true
	plan, _ = planRestore(f)
	if d := decide(plan, forks, ready)[1]; d.State == nil || !d.State.RelayUnmatched || !d.State.LedgerAt().Unmatched {
		t.Fatalf("an unmatched record's decision: %+v", d)
	}
	if r := got[1].relaunched(3); r.Mode != resumeRelaunch || r.Attempt != 3 || r.Cut != 0 || r.Seq != 0 || r.State != nil || r.Sandbox != "sb-b" {
		t.Fatalf("relaunched: %+v", r)
	}
}

func TestRestoredRows(t *testing.T) {
	rows := map[string]store.Episode{
		"a": {ID: "a", State: store.EpisodeLost, Attempt: 1, PauseSeq: 5},
		"b": {ID: "b", State: store.EpisodeRetired, Sandbox: "old", Attempt: 1, PauseSeq: 1},
		"c": {ID: "c", State: store.EpisodeLost, Attempt: 1},
		"d": {ID: "d", State: store.EpisodeLost, Attempt: 3},
	}
	plan := []decision{
		{Episode: "a", Sandbox: "sb-a", Mode: resumeRelaunch, Attempt: 2, PauseSeq: 3},
		{Episode: "b", Sandbox: "sb-b", Mode: resumeInPlace, Attempt: 2, PauseSeq: 3},
		{Episode: "c", Sandbox: "sb-c", Mode: resumeRelaunch, Attempt: 2},
	}
	out := map[string]outcome{
		"a": {Continued: true, Attempt: 2, Mode: resumeRelaunch},
		"b": {Continued: true, Attempt: 3, Mode: resumeRelaunch}, // relaunched instead
		"c": {Attempt: 1},                                        // its fork died before the gateway moved
	}
	got := restoredRows(rows, plan, []finished{{Episode: "d", Attempt: 2}}, out)
	var desc []string
	for _, r := range got {
		desc = append(desc, fmt.Sprintf("%s %s sb=%q attempt %d pause %d resume %q", r.ID, r.State, r.Sandbox, r.Attempt, r.PauseSeq, r.Resume))
	}
	want := []string{
		`a running sb="sb-a" attempt 2 pause 5 resume "relaunch"`,
		`b running sb="sb-b" attempt 3 pause 3 resume "relaunch"`,
		`c lost sb="" attempt 1 pause 0 resume ""`,
		`d ended sb="" attempt 2 pause 0 resume ""`,
	}
	if strings.Join(desc, "\n") != strings.Join(want, "\n") {
		t.Fatalf("rows\n%s\nwant\n%s", strings.Join(desc, "\n"), strings.Join(want, "\n"))
	}
}

func TestDecidePrepare(t *testing.T) {
	ok := func(ep, snap string) prepareResult { return prepareResult{Episode: ep, Recorded: true, Snapshot: snap} }
	straggler := func(ep, snap string) prepareResult {
		return prepareResult{Episode: ep, Snapshot: snap, Err: fmt.Errorf("episode %s: pause refused", ep)}
	}
	for _, tc := range []struct {
		name     string
		policy   string
		results  []prepareResult
		commit   bool
		records  int
		excluded string
		deleted  string
		straggle bool // the error matches ErrStraggler
	}{
		{name: "all recorded", policy: StragglersExclude, results: []prepareResult{ok("a", "s1"), ok("b", ""), ok("c", "s3")}, commit: true, records: 3},
		{name: "a straggler excluded", policy: StragglersExclude, results: []prepareResult{ok("a", "s1"), straggler("b", "s2")}, commit: true, records: 1, excluded: "b", deleted: "s2"},
		{name: "a straggler fails it", policy: StragglersFail, results: []prepareResult{ok("a", "s1"), straggler("b", "s2")}, records: 1, deleted: "s1,s2", straggle: true},
		{name: "every one straggled", policy: StragglersExclude, results: []prepareResult{straggler("a", "s1"), straggler("b", "")}, excluded: "a,b", deleted: "s1", straggle: true},
		{name: "the store refused a record", policy: StragglersExclude, results: []prepareResult{ok("a", "s1"), {Episode: "b", Snapshot: "s2", Err: fmt.Errorf("episode b: %w: disk full", errRecord)}}, records: 1, deleted: "s1,s2"},
		{name: "cancelled", policy: StragglersExclude, results: []prepareResult{ok("a", "s1"), {Episode: "b", Err: errors.New("context canceled"), Cancelled: true}}, records: 1, deleted: "s1"},
		{name: "no episodes", policy: StragglersExclude, commit: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var ids []string
			results := map[string]prepareResult{}
			for _, r := range tc.results {
				ids = append(ids, r.Episode)
				results[r.Episode] = r
			}
			o := decidePrepare(tc.policy, ids, results)
			var excl []string
			for _, id := range ids {
				if o.Excluded[id] != "" {
					excl = append(excl, id)
				}
			}
			if o.Commit != tc.commit || o.Records != tc.records || strings.Join(excl, ",") != tc.excluded || strings.Join(o.DeleteSnapshots, ",") != tc.deleted {
				t.Fatalf("outcome %+v", o)
			}
			if o.Commit != (o.Err == nil) || errors.Is(o.Err, ErrStraggler) != tc.straggle {
				t.Fatalf("error %v (straggler %v)", o.Err, tc.straggle)
			}
		})
	}
}

func TestLostRow(t *testing.T) {
	for _, tc := range []struct {
		state         store.EpisodeState
		gone, verdict bool
		want          string
	}{
		{store.EpisodeRunning, true, false, `lost ""`},
		{store.EpisodeRunning, false, true, `lost "sb"`},
		{store.EpisodeEnded, true, true, `ended ""`},
		{store.EpisodeEnded, true, false, `lost ""`},
	} {
		r := lostRow(store.Episode{ID: "a", State: tc.state, Sandbox: "sb"}, tc.gone, tc.verdict)
		if got := fmt.Sprintf("%s %q", r.State, r.Sandbox); got != tc.want {
			t.Errorf("%s, gone %v, verdict %v: %s, want %s", tc.state, tc.gone, tc.verdict, got, tc.want)
		}
	}
}

// entry makes a journal entry with doc d.
func entry(op, kind, ep string, d jdoc) store.JournalEntry {
	b, _ := json.Marshal(d)
	return store.JournalEntry{Op: op, Kind: kind, Episode: ep, Doc: b}
}

func TestFoldJournal(t *testing.T) {
	plan := []decision{{Episode: "a", Sandbox: "sb-a", Mode: resumeInPlace, Attempt: 2, Seq: 3, Cut: 4}, {Episode: "b", Sandbox: "sb-b", Mode: resumeRelaunch, Attempt: 2}}
	ops, problems := foldJournal([]store.JournalEntry{
		entry("p1", jPrepare, "", jdoc{Checkpoint: "ck-1"}),
		entry("r1", jRestore, "", jdoc{Checkpoint: "ck-0"}),
		entry("p1", jPause, "a", jdoc{Sandbox: "sb-1", Seq: 2, Name: "a-p2"}),
		entry("p1", jPause, "b", jdoc{Sandbox: "sb-2", Seq: 5, Name: "b-p5"}),
		entry("p1", jSnapshot, "a", jdoc{Snapshot: "snap-a"}),
		entry("r1", jFork, "a", jdoc{Snapshot: "snap-0"}),
		entry("r1", jForked, "a", jdoc{Sandbox: "sb-a"}),
		entry("r1", jDecide, "", jdoc{Plan: plan, Finished: []finished{{Episode: "c", Attempt: 1}}}),
		entry("r1", jGo, "a", jdoc{}),
		entry("r1", jGo, "b", jdoc{}),
		entry("r1", jRelaunch, "a", jdoc{Attempt: 3}),
		entry("b1", jBranch, "a", jdoc{Checkpoint: "ck-0"}),
		entry("b1", jFork, "a", jdoc{Snapshot: "snap-0"}),
		entry("b1", jForked, "a-1", jdoc{Sandbox: "sb-c1"}),
		entry("b1", jRegister, "a-1", jdoc{}),
		entry("s1", jStart, "ep-n", jdoc{}),
		{Op: "x1", Kind: jRestore, Doc: json.RawMessage(`{"checkpoint":"ck-9"}`)},
		{Op: "x1", Kind: "teleport", Episode: "z"},
		{Op: "y1", Kind: jFork, Episode: "z", Doc: json.RawMessage(`{}`)},
	})
	if len(problems) != 2 || problems[0].Kind != ProblemJournal || !strings.Contains(problems[0].Detail, `"teleport"`) || !strings.Contains(problems[1].Detail, "no first entry") {
		t.Fatalf("problems: %+v", problems)
	}
	if len(ops) != 4 || ops[0].ID != "p1" || ops[1].ID != "r1" || ops[2].ID != "b1" || ops[3].ID != "s1" {
		t.Fatalf("operations: %+v", ops)
	}
	if s := ops[3]; s.Kind != jStart || !reflect.DeepEqual(s.Registered, []string{"ep-n"}) {
		t.Fatalf("start: %+v", s)
	}
	if b := ops[2]; b.Kind != jBranch || b.Forked["a-1"] != "sb-c1" || !reflect.DeepEqual(b.Registered, []string{"a-1"}) || b.Decided != nil {
		t.Fatalf("branch: %+v", b)
	}
	p := ops[0]
	if p.Kind != jPrepare || p.Checkpoint != "ck-1" || !reflect.DeepEqual(p.Pauses, []pauseIntent{
		{Episode: "a", Sandbox: "sb-1", Name: "a-p2", Seq: 2, Snapshot: "snap-a"},
		{Episode: "b", Sandbox: "sb-2", Name: "b-p5", Seq: 5},
	}) {
		t.Fatalf("prepare: %+v", p)
	}
	r := ops[1]
	if r.Kind != jRestore || r.Checkpoint != "ck-0" || r.Forks["a"] != "snap-0" || r.Forked["a"] != "sb-a" || len(r.Finished) != 1 {
		t.Fatalf("restore: %+v", r)
	}
	// a was relaunched instead of resumed in place: as attempt 3, and its
	// relaunch's Go was not journaled (it is the one that counts).
	if d := r.Decided[0]; d.Mode != resumeRelaunch || d.Attempt != 3 || d.Cut != 0 || r.Gone["a"] || !r.Gone["b"] {
		t.Fatalf("decided: %+v gone %v", r.Decided, r.Gone)
	}
}

func TestPlanRecovery(t *testing.T) {
	prep := &opState{ID: "p1", Kind: jPrepare, Checkpoint: "ck", Pauses: []pauseIntent{
		{Episode: "a", Sandbox: "sb-a", Name: "a-p2", Seq: 2, Snapshot: "snap-a"},
		{Episode: "b", Sandbox: "sb-b", Name: "b-p5", Seq: 5},
	}}
	undecided := &opState{ID: "r1", Kind: jRestore, Checkpoint: "ck", Forked: map[string]string{"a": "sb-1", "b": "sb-2"}}
	plan := []decision{{Episode: "a", Sandbox: "sb-1", Mode: resumeRelaunch, Attempt: 2}, {Episode: "b", Sandbox: "sb-2", Mode: resumeInPlace, Attempt: 2}}
	decided := &opState{ID: "r1", Kind: jRestore, Checkpoint: "ck", Forked: map[string]string{"a": "sb-1", "b": "sb-2"}, Decided: plan, Gone: map[string]bool{"a": true}}
	branch := &opState{ID: "b1", Kind: jBranch, Checkpoint: "ck", Forked: map[string]string{"a-1": "sb-1"}, Registered: []string{"a-1", "a-2"}}
	for _, tc := range []struct {
		name     string
		s        *opState
		f        recoveryFacts
		want     []string
		problems int
	}{
		{name: "a pending prepare is failed and undone", s: prep,
			f:    recoveryFacts{State: store.StatePending, Recorded: []string{"snap-a"}, CanFind: true, Found: map[string][]string{"sb-b/b-p5": {"snap-b"}}},
			want: []string{"fail ck", "delete-snapshot snap-a", "delete-snapshot snap-b", "continue a 2", "continue b 5", "close"}},
		{name: "a prepare whose checkpoint failed already", s: prep,
			f:    recoveryFacts{State: store.StateFailed, CanFind: true},
			want: []string{"delete-snapshot snap-a", "continue a 2", "continue b 5", "close"}},
		{name: "a committed prepare keeps what its records name", s: prep,
			f:    recoveryFacts{State: store.StateCommitted, Recorded: []string{"snap-a"}, CanFind: true, Found: map[string][]string{"sb-b/b-p5": {"snap-b"}}},
			want: []string{"delete-snapshot snap-b", "continue a 2", "continue b 5", "close"}},
		{name: "a prepare that began no checkpoint", s: prep,
			f:    recoveryFacts{CanFind: true},
			want: []string{"delete-snapshot snap-a", "continue a 2", "continue b 5", "close"}},
		{name: "a provider that cannot find snapshots by name", s: prep,
			f:        recoveryFacts{State: store.StatePending},
			want:     []string{"fail ck", "delete-snapshot snap-a", "continue a 2", "continue b 5", "close"},
			problems: 1},
		{name: "an undecided restore is undone", s: undecided,
			f:    recoveryFacts{Labelled: []string{"sb-2", "sb-3"}},
			want: []string{"delete-sandbox sb-1", "delete-sandbox sb-2", "delete-sandbox sb-3", "close"}},
		{name: "a decided restore is rolled forward", s: decided,
			f:    recoveryFacts{Labelled: []string{"sb-1", "sb-2", "sb-9"}, Alive: map[string]bool{"sb-1": true, "sb-2": true}},
			want: []string{"roll-forward a sb-1 gone", "roll-forward b sb-2", "delete-sandbox sb-9", "close"}},
		{name: "a branch is undone", s: branch,
			f:    recoveryFacts{Labelled: []string{"sb-1", "sb-2"}},
			want: []string{"delete-sandbox sb-1", "delete-sandbox sb-2", "unregister a-1", "unregister a-2", "close"}},
		{name: "a start is undone", s: &opState{ID: "s1", Kind: jStart, Registered: []string{"ep-n"}},
			f:    recoveryFacts{Labelled: []string{"sb-n"}},
			want: []string{"delete-sandbox sb-n", "unregister ep-n", "close"}},
		{name: "a decided restore whose fork died", s: decided,
			f:    recoveryFacts{Labelled: []string{"sb-1"}, Alive: map[string]bool{"sb-1": true}},
			want: []string{"roll-forward a sb-1 gone", "lose b sb-2", "close"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			acts, problems := planRecovery(tc.s, tc.f)
			var got []string
			for _, a := range acts {
				switch a.Kind {
				case actFail:
					got = append(got, "fail "+a.Checkpoint)
				case actDeleteSnapshot:
					got = append(got, "delete-snapshot "+a.Snapshot)
				case actContinue:
					got = append(got, fmt.Sprintf("continue %s %d", a.Episode, a.Seq))
				case actDeleteSandbox:
					got = append(got, "delete-sandbox "+a.Sandbox)
				case actRollForward:
					g := ""
					if a.Gone {
						g = " gone"
					}
					got = append(got, "roll-forward "+a.Episode+" "+a.Sandbox+g)
				case actLose:
					got = append(got, "lose "+a.Episode+" "+a.Sandbox)
				case actUnregister:
					got = append(got, "unregister "+a.Episode)
				case actClose:
					got = append(got, "close")
				}
			}
			if strings.Join(got, "\n") != strings.Join(tc.want, "\n") {
				t.Fatalf("actions\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(tc.want, "\n"))
			}
			if len(problems) != tc.problems {
				t.Fatalf("problems %+v, want %d", problems, tc.problems)
			}
		})
	}
}
