package coordinator_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"stasis/errdefs"
	"stasis/internal/control/coordinator"
	"stasis/internal/control/model"
	"stasis/internal/control/relay"
	"stasis/internal/control/system"
	"stasis/internal/control/task"
	"stasis/internal/guestclock"
	"stasis/internal/insandbox/supervisor"
	"stasis/internal/pgtest"
	"stasis/internal/proc"
	"stasis/internal/providers/local"
	"stasis/internal/stasistest"
	"stasis/internal/storage/ledger"
	"stasis/internal/storage/store"
	"stasis/sandbox"
)

func TestMain(m *testing.M) { stasistest.Main(m) }

// world is the system a coordinator test runs on (stasistest.NewWorld):
// the scripted model, the gateway on each sandbox's own socket (holding
// chosen calls: Hold, HoldAttempt), the local provider, the record store
// and the coordinator, on a state directory that outlives a crash of the
// host side (Crash, Reopen). Its Env, Store, Gateway, Tasks and
// Coordinator are those of the system open now.
type world struct {
	*stasistest.World
	t *testing.T
	// local is the raw local provider of the system open now (each Open
	// makes a new one); Env.Provider is it, or what the test wrapped it in.
	local *local.Provider
}

// newWorld opens a world, each option adjusting its configuration. Its
// coordinator checks no episode's liveness unless an option says so
// (TestLostWhenNoticed): the tests here notice lost episodes at a wait or
// a recovery.
func newWorld(t *testing.T, opts ...func(*system.Config)) *world {
	return newWrappedWorld(t, nil, opts...)
}

// newWrappedWorld is newWorld with its provider wrapped, at every Open,
// by wrap (nil: none).
func newWrappedWorld(t *testing.T, wrap func(*local.Provider) sandbox.Provider, opts ...func(*system.Config)) *world {
	t.Helper()
	w := &world{t: t}
	base := func(c *system.Config) {
		c.LivenessInterval = -1
		c.WrapProvider = func(p sandbox.Provider) sandbox.Provider {
			w.local = p.(*local.Provider)
			if wrap == nil {
				return p
			}
			return wrap(w.local)
		}
	}
	w.World = stasistest.NewWorld(t, append([]func(*system.Config){base}, opts...)...)
	return w
}

// waitHeld waits until the call h holds has arrived at the gateway.
// crashEverything is a crash of every machine: the episodes' sandboxes
// gone, the coordinator's memory dropped, the calls held let go (their
// connections are gone), and the gateway and the store closed and opened
// again from disk. It returns the coordinator of the system opened again.
func (w *world) crashEverything(ctx context.Context, c *coordinator.Coordinator, episodes []string, holds []*relay.Hold) *coordinator.Coordinator {
	w.t.Helper()
	for _, id := range episodes {
		row, _ := w.Store.GetEpisode(ctx, id)
		if err := w.Env.Provider.Delete(ctx, row.Sandbox); err != nil {
			w.t.Fatal(err)
		}
	}
	c.Close()
	for _, h := range holds {
		h.Release()
	}
	w.Crash()
	w.Reopen()
	return w.Coordinator
}

func waitHeld(t *testing.T, ctx context.Context, h *relay.Hold, what string) {
	t.Helper()
	if err := h.Wait(ctx, 1); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

// Three episodes: one ends before the checkpoint, two are held mid-way.
// The checkpoint records the ended one as finished with its verdict and the
// two others paused and snapshotted; then everything "crashes" (the
// sandboxes are deleted and the host side goes down), the system opened
// again on the same state finds the episodes lost, and the restore relaunches
// the two from their snapshots; they finish with reward 1 and their ledgers
// verify. A second restore of the same checkpoint while they are live is
// refused and changes nothing. It runs on the embedded store (SQLite and
// ledger files) and on a real PostgreSQL server (records, episodes and
// ledgers in one database).
func TestCheckpointCrashRestore(t *testing.T) {
	t.Run("sqlite", func(t *testing.T) { testCheckpointCrashRestore(t) })
	t.Run("postgres", func(t *testing.T) {
		dsn := pgtest.DSN(t)
		testCheckpointCrashRestore(t, func(c *system.Config) { c.Store = dsn })
	})
}

func testCheckpointCrashRestore(t *testing.T, opts ...func(*system.Config)) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	w := newWorld(t, opts...)
	c := w.Coordinator
	type ep struct{ id, task string }
	eps := []ep{{"ep-a", "py-ini-value-with-equals"}, {"ep-b", "sh-renext-spaces"}, {"ep-c", "js-slugify-single-replace"}}
	var holds []*relay.Hold
	for _, e := range eps[1:] {
		holds = append(holds, w.Hold(e.id, 3))
	}
	for _, e := range eps {
		if _, err := c.Start(ctx, e.id, e.task, "mini"); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.Wait(ctx, "ep-a"); err != nil {
		t.Fatal(err)
	}
	for i, h := range holds {
		waitHeld(t, ctx, h, "call 3 of "+eps[i+1].id)
	}
	res, err := c.Prepare(ctx, "ckpt-1")
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Episodes) != 3 || !res.Episodes[0].Finished || res.Episodes[1].Snapshot == "" || res.Episodes[2].Snapshot == "" {
		t.Fatalf("prepare: %+v", res)
	}
	ck, recs, err := w.Store.Get(ctx, "ckpt-1")
	if err != nil || ck.State != store.StateCommitted || len(recs) != 3 {
		t.Fatalf("checkpoint: %+v %d records %v", ck, len(recs), err)
	}
	if !recs[0].Finished || len(recs[0].Result) == 0 || recs[1].RelayDelivered == nil || *recs[1].RelayDelivered != 2 {
		t.Fatalf("records: %+v / %+v", recs[0], recs[1])
	}

	var ids []string
	for _, e := range eps {
		ids = append(ids, e.id)
	}
	c = w.crashEverything(ctx, c, ids, holds)
	if ids := c.LiveIDs(); len(ids) != 0 {
		t.Fatalf("live after the crash: %v", ids)
	}
	lost, _ := w.Store.ListEpisodes(ctx, store.EpisodeLost)
	if len(lost) != 2 {
		t.Fatalf("lost episodes: %+v", lost)
	}

	res, err = c.Restore(ctx, "ckpt-1")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range res.Episodes {
		want := "relaunch"
		if f.Episode == "ep-a" {
			want = "none"
		}
		if f.Resume != want {
			t.Fatalf("%s resumed %q, want %q", f.Episode, f.Resume, want)
		}
	}
	// A second restore while they are live: refused, naming each.
	if _, err := c.Restore(ctx, "ckpt-1"); err == nil || !strings.Contains(err.Error(), "ep-b is live") || !strings.Contains(err.Error(), "ep-c is live") {
		t.Fatalf("restore over live episodes: %v", err)
	}
	for _, e := range eps {
		if e.id != "ep-a" {
			if _, err := c.Wait(ctx, e.id); err != nil {
				t.Fatal(err)
			}
		}
		v, _, err := c.Verify(ctx, e.id)
		if err != nil || v.Reward != 1 {
			t.Fatalf("%s: reward %d %v\n%s", e.id, v.Reward, err, v.Output)
		}
		rep, err := ledger.VerifyIn(w.Gateway.Ledgers(), e.id)
		if err != nil || !rep.OK || rep.Broken {
			t.Fatalf("%s: ledger %+v %v", e.id, rep, err)
		}
	}
	for _, e := range eps {
		if err := c.Retire(ctx, e.id); err != nil {
			t.Fatal(err)
		}
		if err := c.Retire(ctx, e.id); err != nil {
			t.Fatalf("a second retire: %v", err)
		}
	}
	freed, err := c.DeleteCheckpoint(ctx, "ckpt-1")
	if err != nil || len(freed) != 2 {
		t.Fatalf("delete checkpoint: %v %v", freed, err)
	}
	if infos, _ := w.Env.Provider.List(ctx, nil); len(infos) != 0 {
		t.Fatalf("sandboxes left: %+v", infos)
	}
}

// An episode started with a deadline is ended by its supervisor when the
// deadline passes (here while its first model call is held), and the store
// keeps the deadline.
func TestStartWithDeadline(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	w := newWorld(t)
	c := w.Coordinator
	w.Hold("ep-d", 1)
	if _, err := c.StartWithDeadline(ctx, "ep-x", "sh-renext-spaces", "mini", -time.Second); err == nil {
		t.Fatal("a negative deadline was taken")
	}
	row, err := c.StartWithDeadline(ctx, "ep-d", "sh-renext-spaces", "mini", 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if row.DeadlineS != 2 {
		t.Fatalf("deadline in the store: %v", row.DeadlineS)
	}
	rc, err := c.Wait(ctx, "ep-d")
	if err != nil || !rc.TimedOut {
		t.Fatalf("receipt %+v %v: want timed out", rc, err)
	}
	if err := c.Retire(ctx, "ep-d"); err != nil {
		t.Fatal(err)
	}
}

// claimsProcesses is the local provider saying its snapshots keep
// processes when they do not: a fork of such a "process-keeping" snapshot
// has no supervisor running, as a microVM fork whose guest rebooted would
// not run the recorded launch.
type claimsProcesses struct{ *local.Provider }

func (c claimsProcesses) Capabilities() sandbox.Capabilities {
	caps := c.Provider.Capabilities()
	caps.KeepsProcesses = true
	return caps
}

// A record that says its snapshot kept processes, restored into a fork
// whose supervisor is not the recorded launch, is relaunched instead of
// resumed in place, and the restore says why; the episode still reaches
// reward 1 with a ledger that verifies.
func TestNotTheRecordedLaunchRelaunches(t *testing.T) {
	w := newWrappedWorld(t, func(p *local.Provider) sandbox.Provider { return claimsProcesses{p} })
	w.restoreRelaunches("ep-x", "not the recorded launch", nil)
}

// restoreRelaunches checkpoints episode ep (held at its third model call;
// its record must say it restores in place), deletes its sandbox, and
// restores the checkpoint after a crash and a reopen (prepare, given the
// record, runs first): the episode must be relaunched, for a reason that
// says why, and still reach reward 1 with a ledger that verifies.
func (w *world) restoreRelaunches(ep, why string, prepare func(store.Record)) {
	t := w.t
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	ck := "ckpt-" + ep
	c := w.Coordinator
	h := w.Hold(ep, 3)
	if _, err := c.Start(ctx, ep, "sh-renext-spaces", "mini"); err != nil {
		t.Fatal(err)
	}
	waitHeld(t, ctx, h, "call 3 of "+ep)
	if _, err := c.Prepare(ctx, ck); err != nil {
		t.Fatal(err)
	}
	_, recs, err := w.Store.Get(ctx, ck)
	if err != nil || len(recs) != 1 || !recs[0].RestoresInPlace() || recs[0].PauseMode != "hold" {
		t.Fatalf("record: %+v %v", recs, err)
	}
	if prepare != nil {
		prepare(recs[0])
	}
	row, _ := w.Store.GetEpisode(ctx, ep)
	if err := w.local.Delete(ctx, row.Sandbox); err != nil {
		t.Fatal(err)
	}
	h.Release()
	w.Crash()
	w.Reopen()
	c = w.Coordinator
	res, err := c.Restore(ctx, ck)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Episodes) != 1 || res.Episodes[0].Resume != "relaunch" || !strings.Contains(res.Episodes[0].ResumeWhy, why) {
		t.Fatalf("restore: %+v", res.Episodes)
	}
	if _, err := c.Wait(ctx, ep); err != nil {
		t.Fatal(err)
	}
	v, _, err := c.Verify(ctx, ep)
	if err != nil || v.Reward != 1 {
		t.Fatalf("reward %d %v\n%s", v.Reward, err, v.Output)
	}
	if rep, err := ledger.VerifyIn(w.Gateway.Ledgers(), ep); err != nil || !rep.OK || rep.Broken {
		t.Fatalf("ledger %+v %v", rep, err)
	}
	if err := c.Retire(ctx, ep); err != nil {
		t.Fatal(err)
	}
	if _, err := c.DeleteCheckpoint(ctx, ck); err != nil {
		t.Fatal(err)
	}
}

// harnessEndsInFork claims that snapshots keep processes (as
// claimsProcesses) and, in each fork, leaves what a harness that ended
// during the hold leaves: the supervisor gone, a receipt naming the
// recorded launch and an exit code of 1.
type harnessEndsInFork struct {
	claimsProcesses
	episode  string
	identity *proc.Identity
}

// SetClock leaves the clock alone: a local sandbox cannot set it, and the
// fork's wall clock is the host's already.
func (h harnessEndsInFork) SetClock(context.Context, string, guestclock.Target) (guestclock.Fix, error) {
	return guestclock.Fix{}, nil
}

func (h harnessEndsInFork) Fork(ctx context.Context, snap string, n int, spec sandbox.ForkSpec) ([]sandbox.Info, error) {
	forks, err := h.claimsProcesses.Fork(ctx, snap, n, spec)
	if err != nil {
		return nil, err
	}
	one := 1
	rc, _ := json.Marshal(supervisor.Receipt{Identity: *h.identity, CleanupConfirmed: true, ReturnCode: &one, Error: "the harness exited 1"})
	for _, f := range forks {
		dir := "/tmp/stasis/" + h.episode
		res, err := h.Exec(ctx, f.ID, sandbox.ExecRequest{
			Argv: []string{"sh", "-c", `rm -f "$1/` + supervisor.SocketFile + `" && printf '%s' "$2" > "$1/` + supervisor.ReceiptFile + `"`, "sh", dir, string(rc)},
			User: sandbox.UserControl,
		})
		if err != nil || res.ExitCode != 0 {
			return nil, fmt.Errorf("write the receipt in fork %s: exit %d, %v", f.ID, res.ExitCode, err)
		}
	}
	return forks, nil
}

// A record restored in place into a fork whose supervisor is the recorded
// launch but whose harness ended before the continue (the continue is
// refused: the supervisor has exited) is relaunched from its saved session
// in that fork, and the restore says why; the other episodes are not
// failed with it, and it still reaches reward 1 with a ledger that
// verifies.
func TestHarnessEndedInForkRelaunches(t *testing.T) {
	// The recorded identity, learnt from the record, is shared by the
	// wrappers of every Open.
	var identity proc.Identity
	w := newWrappedWorld(t, func(p *local.Provider) sandbox.Provider {
		return harnessEndsInFork{claimsProcesses: claimsProcesses{p}, episode: "ep-y", identity: &identity}
	})
	w.restoreRelaunches("ep-y", "harness ended in the fork before the continue", func(r store.Record) { identity = *r.Identity })
}

// A verdict belongs to one run. An episode ends and is verified (reward
// 1); the server crashes; an earlier checkpoint is restored against a
// model that does not solve the task. The restored run is a new attempt,
// verified afresh on its own work tree (reward 0), never answered with
// the discarded run's verdict, which stays recorded under its attempt.
func TestRestoredRunIsVerifiedAfresh(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	w := newWorld(t)
	c := w.Coordinator
	// Call 2's answer carries the fix: the checkpoint is taken before it.
	h := w.Hold("ep-d", 2)
	if _, err := c.Start(ctx, "ep-d", "py-money-negative-cents", "mini"); err != nil {
		t.Fatal(err)
	}
	waitHeld(t, ctx, h, "call 2 of ep-d")
	if _, err := c.Prepare(ctx, "ckpt-1"); err != nil {
		t.Fatal(err)
	}
	h.Release()
	if _, err := c.Wait(ctx, "ep-d"); err != nil {
		t.Fatal(err)
	}
	first, rec, err := c.Verify(ctx, "ep-d")
	if err != nil || rec || first.Reward != 1 || first.Attempt != 0 || first.Status != task.StatusResolved {
		t.Fatalf("the first run: %+v recorded=%v %v", first, rec, err)
	}

	// The crash, and a model that does not solve it (the default script:
	// it reads a file, runs a command and answers).
	row, _ := w.Store.GetEpisode(ctx, "ep-d")
	if err := w.Env.Provider.Delete(ctx, row.Sandbox); err != nil {
		t.Fatal(err)
	}
	lazy := httptest.NewServer(model.New(model.Options{}))
	t.Cleanup(lazy.Close)
	w.Crash()
	w.ReopenWith(func(c *system.Config) { c.ModelUpstream = lazy.URL })
	c = w.Coordinator
	if _, err := c.Restore(ctx, "ckpt-1"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Wait(ctx, "ep-d"); err != nil {
		t.Fatal(err)
	}
	again, rec, err := c.Verify(ctx, "ep-d")
	if err != nil || rec || again.Attempt != 1 || again.Reward != 0 || again.Status != task.StatusUnresolved {
		t.Fatalf("the restored run: %+v recorded=%v %v\n%s", again, rec, err, again.Output)
	}
	if v, rec, err := c.Verify(ctx, "ep-d"); err != nil || !rec || v.Reward != 0 || !v.Started.Equal(again.Started) {
		t.Fatalf("a second verify of the restored run: %+v recorded=%v %v", v, rec, err)
	}
	if old, ok, err := w.Env.Verifier.Recorded(ctx, "ep-d", 0); err != nil || !ok || old.Reward != 1 {
		t.Fatalf("the first run's verdict: %+v %v %v", old, ok, err)
	}
	if err := c.Retire(ctx, "ep-d"); err != nil {
		t.Fatal(err)
	}
	// After the retire the store answers for the current attempt.
	if v, rec, err := c.Verify(ctx, "ep-d"); err != nil || !rec || v.Attempt != 1 || v.Reward != 0 {
		t.Fatalf("verify after the retire: %+v recorded=%v %v", v, rec, err)
	}
	if _, err := c.DeleteCheckpoint(ctx, "ckpt-1"); err != nil {
		t.Fatal(err)
	}
}

// TestStragglerExcluded: an episode whose supervisor refuses the host's
// pause (its sequence burned by a pause and continue far ahead, as an agent
// could once do) does not hold the checkpoint hostage: by default the
// checkpoint commits without it, naming it and why, the next checkpoint is
// not blocked either, and with the strict policy the checkpoint fails
// naming it.
func TestStragglerExcluded(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	w := newWorld(t)
	c := w.Coordinator
	var holds []*relay.Hold
	for _, id := range []string{"ep-good", "ep-bad"} {
		h := w.Hold(id, 3)
		holds = append(holds, h)
		if _, err := c.Start(ctx, id, "sh-renext-spaces", "mini"); err != nil {
			t.Fatal(err)
		}
		waitHeld(t, ctx, h, "call 3 of "+id)
	}
	row, err := w.Store.GetEpisode(ctx, "ep-bad")
	if err != nil {
		t.Fatal(err)
	}
	for _, cmd := range []string{"pause", "continue"} {
		var out strings.Builder
		res, err := w.Env.Provider.Exec(ctx, row.Sandbox, sandbox.ExecRequest{
			Argv: []string{w.Env.BinaryInSandbox, "ctl", "--dir", "/tmp/stasis/ep-bad", cmd, "1000000"},
			Env:  stasistest.EnvMap, User: sandbox.UserControl, Stdout: &out, Stderr: &out,
		})
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("burn ep-bad's sequence (%s): %v %+v %s", cmd, err, res, out.String())
		}
	}
	for _, ck := range []string{"ckpt-1", "ckpt-2"} {
		res, err := c.Prepare(ctx, ck)
		if err != nil {
			t.Fatalf("%s: %v", ck, err)
		}
		got := map[string]coordinator.EpisodeFigures{}
		for _, f := range res.Episodes {
			got[f.Episode] = f
		}
		if f := got["ep-bad"]; !f.Excluded || f.Reason == "" || f.Snapshot != "" {
			t.Errorf("%s: ep-bad %+v, want excluded with a reason", ck, f)
		}
		if f := got["ep-good"]; f.Excluded || f.Snapshot == "" {
			t.Errorf("%s: ep-good %+v, want recorded", ck, f)
		}
		meta, recs, err := w.Store.Get(ctx, ck)
		if err != nil || meta.State != store.StateCommitted || len(recs) != 1 || recs[0].Episode != "ep-good" {
			t.Fatalf("%s: %+v %+v %v", ck, meta, recs, err)
		}
	}
	_, err = c.PrepareWith(ctx, "ckpt-strict", coordinator.PrepareOptions{Stragglers: coordinator.StragglersFail})
	if err == nil || !strings.Contains(err.Error(), "ep-bad") {
		t.Fatalf("the strict policy: %v, want a failure naming ep-bad", err)
	}
	if meta, _, err := w.Store.Get(ctx, "ckpt-strict"); err != nil || meta.State != store.StateFailed {
		t.Fatalf("ckpt-strict: %+v %v", meta, err)
	}
	if _, err := c.PrepareWith(ctx, "ckpt-x", coordinator.PrepareOptions{Stragglers: "maybe"}); err == nil {
		t.Errorf("an unknown policy was accepted")
	}
	for _, h := range holds {
		h.Release()
	}
	for _, id := range []string{"ep-good", "ep-bad"} {
		if _, err := c.Wait(ctx, id); err != nil {
			t.Fatal(err)
		}
		if err := c.Retire(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
}

// A trainer restores an older checkpoint, the episode makes new calls,
// then everything crashes and the trainer restores the newer checkpoint:
// the ledger, which had moved on past it, branches back to its tip, the
// relaunched harness's history matches it, and the episode finishes with
// reward 1 on an unbroken ledger whose left-behind calls stay readable.
func TestRestoreNewerCheckpointAfterAnOlderOne(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	w := newWorld(t)
	const ep = "ep-b"
	h2 := w.Hold(ep, 2)
	if _, err := w.Coordinator.Start(ctx, ep, "sh-renext-spaces", "mini"); err != nil {
		t.Fatal(err)
	}
	waitHeld(t, ctx, h2, "call 2")
	if _, err := w.Coordinator.Prepare(ctx, "ckpt-1"); err != nil {
		t.Fatal(err)
	}
	h3 := w.Hold(ep, 3)
	h2.Release()
	waitHeld(t, ctx, h3, "call 3")
	if _, err := w.Coordinator.Prepare(ctx, "ckpt-2"); err != nil {
		t.Fatal(err)
	}
	crash := func() {
		t.Helper()
		row, _ := w.Store.GetEpisode(ctx, ep)
		if err := w.Env.Provider.Delete(ctx, row.Sandbox); err != nil {
			t.Fatal(err)
		}
		w.Crash()
		w.Reopen()
	}
	crash()
	h3.Release()
	// Back to ckpt-1; the relaunched harness makes its second call anew
	// (held), a call of a history ckpt-2 does not have.
	again := w.HoldAttempt(ep, 1, 1_000_002)
	if _, err := w.Coordinator.Restore(ctx, "ckpt-1"); err != nil {
		t.Fatal(err)
	}
	waitHeld(t, ctx, again, "attempt 1's second call")
	crash()
	again.Release()
	res, err := w.Coordinator.Restore(ctx, "ckpt-2")
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Episodes) != 1 || res.Episodes[0].Resume != "relaunch" {
		t.Fatalf("restore of ckpt-2: %+v", res.Episodes)
	}
	if _, err := w.Coordinator.Wait(ctx, ep); err != nil {
		t.Fatal(err)
	}
	v, _, err := w.Coordinator.Verify(ctx, ep)
	if err != nil || v.Reward != 1 {
		t.Fatalf("reward %d %v\n%s", v.Reward, err, v.Output)
	}
	rep, err := ledger.VerifyIn(w.Gateway.Ledgers(), ep)
	if err != nil || !rep.OK || rep.Broken {
		t.Fatalf("ledger: %+v %v", rep, err)
	}
	h, err := ledger.ReadIn(w.Gateway.Ledgers(), ep)
	if err != nil {
		t.Fatal(err)
	}
	branched := false
	for _, ev := range h.Events {
		branched = branched || ev.Kind == "branch"
	}
	if !branched {
		t.Fatalf("the ledger never branched: %+v", h.Events)
	}
	if err := w.Coordinator.Retire(ctx, ep); err != nil {
		t.Fatal(err)
	}
}

// A scoped restore: of a checkpoint of two episodes, the one a trainer
// retired comes back alone, as its next attempt, while the other goes on
// running; a restore that names nothing leaves retired episodes out (and
// refuses while the other is live); a name the checkpoint lacks is
// refused.
func TestScopedRestore(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	w := newWorld(t)
	c := w.Coordinator
	var holds []*relay.Hold
	for _, ep := range []string{"ep-a", "ep-b"} {
		h := w.Hold(ep, 2)
		holds = append(holds, h)
		if _, err := c.Start(ctx, ep, "sh-renext-spaces", "mini"); err != nil {
			t.Fatal(err)
		}
		waitHeld(t, ctx, h, "call 2 of "+ep)
	}
	if _, err := c.Prepare(ctx, "ckpt-1"); err != nil {
		t.Fatal(err)
	}
	if err := c.Retire(ctx, "ep-a"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.RestoreWith(ctx, "ckpt-1", coordinator.RestoreOptions{Episodes: []string{"ep-z"}}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("a restore naming an episode the checkpoint lacks: %v", err)
	}
	if _, err := c.Restore(ctx, "ckpt-1"); err == nil || !strings.Contains(err.Error(), "ep-b is live") {
		t.Fatalf("an unscoped restore while ep-b runs: %v", err)
	}
	holds[0].Release()
	res, err := c.RestoreWith(ctx, "ckpt-1", coordinator.RestoreOptions{Episodes: []string{"ep-a"}})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Episodes) != 1 || res.Episodes[0].Episode != "ep-a" || res.Episodes[0].Resume != "relaunch" {
		t.Fatalf("scoped restore: %+v", res.Episodes)
	}
	row, _ := w.Store.GetEpisode(ctx, "ep-a")
	if row.State != store.EpisodeRunning || row.Attempt != 1 {
		t.Fatalf("ep-a after its scoped restore: %+v", row)
	}
	if _, live := c.Live("ep-b"); !live {
		t.Fatal("ep-b stopped running during ep-a's restore")
	}
	holds[1].Release()
	for _, ep := range []string{"ep-a", "ep-b"} {
		if _, err := c.Wait(ctx, ep); err != nil {
			t.Fatal(err)
		}
		if v, _, err := c.Verify(ctx, ep); err != nil || v.Reward != 1 {
			t.Fatalf("%s: reward %d %v", ep, v.Reward, err)
		}
		if err := c.Retire(ctx, ep); err != nil {
			t.Fatal(err)
		}
	}
	// Both retired: a restore naming none leaves both out.
	res, err = c.Restore(ctx, "ckpt-1")
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Episodes) != 2 || !res.Episodes[0].Excluded || !strings.Contains(res.Episodes[0].Reason, "retired") {
		t.Fatalf("restore of retired episodes: %+v", res.Episodes)
	}
	if ids := c.LiveIDs(); len(ids) != 0 {
		t.Fatalf("live after a restore that left everything out: %v", ids)
	}
}

// An episode that had finished at a checkpoint comes back from it ended,
// with its verdict and the ledger that verdict was made on, however its
// ledger moved on since: here it was started again as its next attempt,
// which made two calls, and retired. The restore takes the ledger back
// to the checkpoint's history (the record of a finished episode keeps its
// ledger's tip).
func TestRestoreOfAFinishedEpisodeBringsItsLedgerBack(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	w := newWorld(t)
	c := w.Coordinator
	const ep = "ep-f"
	if _, err := c.Start(ctx, ep, "sh-renext-spaces", "mini"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Wait(ctx, ep); err != nil {
		t.Fatal(err)
	}
	v, _, err := c.Verify(ctx, ep)
	if err != nil || v.Reward != 1 {
		t.Fatalf("reward %d %v", v.Reward, err)
	}
	if _, err := c.Prepare(ctx, "ck-done"); err != nil {
		t.Fatal(err)
	}
	_, recs, err := w.Store.Get(ctx, "ck-done")
	if err != nil || len(recs) != 1 || !recs[0].Finished || recs[0].LedgerTip == "" {
		t.Fatalf("the record of the finished episode: %+v %v", recs, err)
	}
	done, err := ledger.ReadIn(w.Gateway.Ledgers(), ep)
	if err != nil {
		t.Fatal(err)
	}
	// Started again: its ledger starts over; two calls, then retired.
	if err := c.Retire(ctx, ep); err != nil {
		t.Fatal(err)
	}
	h := w.HoldAttempt(ep, 1, 1_000_003)
	if _, err := c.Start(ctx, ep, "sh-renext-spaces", "mini"); err != nil {
		t.Fatal(err)
	}
	waitHeld(t, ctx, h, "the next attempt's third call")
	if err := c.Retire(ctx, ep); err != nil {
		t.Fatal(err)
	}
	res, err := c.RestoreWith(ctx, "ck-done", coordinator.RestoreOptions{Episodes: []string{ep}})
	if err != nil || len(res.Episodes) != 1 || !res.Episodes[0].Finished {
		t.Fatalf("restore: %+v %v", res, err)
	}
	back, err := ledger.ReadIn(w.Gateway.Ledgers(), ep)
	if err != nil {
		t.Fatal(err)
	}
	if len(back.Entries) != len(done.Entries) {
		t.Fatalf("the ledger after the restore has %d live entries; the checkpoint's history has %d", len(back.Entries), len(done.Entries))
	}
	for i, e := range back.Entries {
		if e.Hash != done.Entries[i].Hash || e.Attempt != 0 {
			t.Fatalf("entry %d after the restore: %s (attempt %d), not the checkpoint's %s", i+1, e.CallID, e.Attempt, done.Entries[i].CallID)
		}
	}
	row, err := w.Store.GetEpisode(ctx, ep)
	if err != nil || row.State != store.EpisodeEnded {
		t.Fatalf("%s after the restore: %+v %v", ep, row, err)
	}
	if vd, rec, err := c.Verify(ctx, ep); err != nil || !rec || !vd.Started.Equal(v.Started) {
		t.Fatalf("its verdict after the restore: %+v %v %v", vd, rec, err)
	}
	if rep, err := ledger.VerifyIn(w.Gateway.Ledgers(), ep); err != nil || !rep.OK || rep.Broken {
		t.Fatalf("ledger: %+v %v", rep, err)
	}
	if err := c.Retire(ctx, ep); err != nil {
		t.Fatal(err)
	}
}

// The episodes of a restore go at once, each in a goroutine that reads
// and writes the restore's table of episodes. Here ep-a is held at its go
// step until ep-b has gone (its relaunched harness asks its next call),
// so ep-a's read of the table comes after ep-b's write with nothing else
// ordering them: under -race an unguarded access is found every time.
// Unguarded, it once ended a node of the three-node cycle soak with
// "concurrent map read and map write" after 24 cycles of 64 episodes.
func TestRestoreGoesEpisodesConcurrently(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	var gate atomic.Pointer[chan struct{}]
	w := newWorld(t, func(c *system.Config) {
		c.CoordinatorOptions = func(o *coordinator.Options) {
			coordinator.SetStepHook(o, func(op, step, ep string) error {
				if ch := gate.Load(); ch != nil && op == "restore" && step == "go" && ep == "ep-a" {
					select {
					case <-*ch:
					case <-ctx.Done():
						return ctx.Err()
					}
				}
				return nil
			})
		}
	})
	c := w.Coordinator
	eps := []string{"ep-a", "ep-b"}
	var holds []*relay.Hold
	for _, ep := range eps {
		holds = append(holds, w.Hold(ep, 3))
		if _, err := c.Start(ctx, ep, "sh-renext-spaces", "mini"); err != nil {
			t.Fatal(err)
		}
	}
	for i, h := range holds {
		waitHeld(t, ctx, h, "call 3 of "+eps[i])
	}
	if _, err := c.Prepare(ctx, "ckpt-1"); err != nil {
		t.Fatal(err)
	}
	c = w.crashEverything(ctx, c, eps, holds)

	release := make(chan struct{})
	gate.Store(&release)
	bGone := w.HoldAttempt("ep-b", 1, 1_000_001) // its relay counts from 1 000 001
	done := make(chan error, 1)
	go func() { _, err := c.Restore(ctx, "ckpt-1"); done <- err }()
	waitHeld(t, ctx, bGone, "ep-b's first call after the restore")
	close(release)
	w.Unhold(bGone)
	bGone.Release()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	for _, ep := range eps {
		if _, err := c.Wait(ctx, ep); err != nil {
			t.Fatal(err)
		}
		if v, _, err := c.Verify(ctx, ep); err != nil || v.Reward != 1 {
			t.Fatalf("%s: %+v %v", ep, v, err)
		}
		if err := c.Retire(ctx, ep); err != nil {
			t.Fatal(err)
		}
	}
}
