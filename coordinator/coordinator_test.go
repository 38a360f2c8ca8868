package coordinator_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"stasis/coordinator"
	"stasis/episode"
	"stasis/harness"
	"stasis/internal/guestclock"
	"stasis/ledger"
	"stasis/model"
	"stasis/proc"
	"stasis/relay"
	"stasis/sandbox"
	"stasis/sandbox/local"
	"stasis/stasistest"
	"stasis/store"
	"stasis/supervisor"
	"stasis/task"
)

func TestMain(m *testing.M) { stasistest.Main(m) }

// world is what a coordinator runs on: a scripted model, a gateway on
// each sandbox's own socket (gating chosen calls), the local
// provider and a record store, all in directories that outlive a "crash"
// of the coordinator.
type world struct {
	t        *testing.T
	env      *episode.Env
	st       store.Store
	dbPath   string
	gw       *relay.Gateway
	gwState  string
	modelURL string
	local    *local.Provider
	mu       sync.Mutex
	sockets  *relay.SandboxSockets // nil while the services are down
	tasks    []*task.Task
	hold     sync.Map // "EPISODE/N" → chan struct{} (closed to release)
	arrived  sync.Map // "EPISODE/N" → chan struct{}
}

func newWorld(t *testing.T) *world { return newWorldWith(t, false) }

// newWorldWith is newWorld; bindBinary binds the stasis binary into every
// sandbox read-only, as the server does (harness.BoundBinaryPath), rather
// than copying it into each: sessions start and snapshots are taken
// faster.
func newWorldWith(t *testing.T, bindBinary bool) *world {
	t.Helper()
	t.Cleanup(func() { stasistest.NoChildrenLeft(t) })
	ts, err := task.Builtin()
	if err != nil {
		t.Fatal(err)
	}
	scripts, err := task.Scripts(ts)
	if err != nil {
		t.Fatal(err)
	}
	msrv := httptest.NewServer(model.New(model.Options{Scripts: scripts}))
	t.Cleanup(msrv.Close)
	gwDir, err := os.MkdirTemp("", "stasis-gw-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(gwDir) })
	w := &world{t: t, tasks: ts, gwState: filepath.Join(t.TempDir(), "gateway"), dbPath: filepath.Join(t.TempDir(), "store.db")}
	lo := local.Options{Home: t.TempDir(), Exe: stasistest.Exe(), ExeEnv: stasistest.Env, GatewayDir: gwDir, Gateway: w}
	if bindBinary {
		lo.ReadOnlyBinds = map[string]string{stasistest.Exe(): harness.BoundBinaryPath}
	}
	p, err := local.New(lo)
	if err != nil {
		t.Fatal(err)
	}
	w.local = p
	// A test that passed must have retired every episode; one that failed
	// part-way may not have, and its sandboxes must not outlive it (the
	// next test would find their processes). Either way none is left.
	t.Cleanup(func() {
		ctx := context.Background()
		left, err := p.List(ctx, nil)
		if err != nil {
			t.Errorf("list the sandboxes left: %v", err)
			return
		}
		if len(left) > 0 && !t.Failed() {
			t.Errorf("%d sandboxes left behind (first %s): every test retires its episodes", len(left), left[0].ID)
		}
		for _, sb := range left {
			if err := p.Delete(ctx, sb.ID); err != nil {
				t.Errorf("delete sandbox %s: %v", sb.ID, err)
			}
		}
	})
	w.env = &episode.Env{
		Provider: p, GatewayURL: "unix://" + local.GatewayDirInSandbox + "/" + local.GatewaySocketName, Model: model.DefaultName,
		Binary: stasistest.Exe(), BinaryEnv: stasistest.EnvMap,
	}
	if bindBinary {
		w.env.BinaryInSandbox = harness.BoundBinaryPath
	}
	w.modelURL = msrv.URL
	w.open(msrv.URL)
	t.Cleanup(w.closeServices)
	return w
}

// open starts the gateway and opens the store (again, after a crash).
func (w *world) open(modelURL string) {
	t := w.t
	gw, err := relay.OpenGateway(relay.GatewayConfig{Upstream: modelURL, State: w.gwState})
	if err != nil {
		t.Fatal(err)
	}
	hold := func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(rw http.ResponseWriter, q *http.Request) {
			call := q.Header.Get(relay.HeaderCallID)
			if ch, ok := w.hold.Load(call + "@" + q.Header.Get(relay.HeaderAttempt)); ok {
				if a, ok := w.arrived.Load(call); ok {
					select {
					case <-a.(chan struct{}):
					default:
						close(a.(chan struct{}))
					}
				}
				select {
				case <-ch.(chan struct{}):
				case <-q.Context().Done():
					return
				}
			}
			h.ServeHTTP(rw, q)
		})
	}
	w.mu.Lock()
	w.sockets = relay.NewSandboxSockets(gw, hold)
	w.mu.Unlock()
	// The sandboxes that outlived a crash get their sockets again, as a
	// restarted server gives them.
	if err := w.local.ServeGateways(context.Background()); err != nil {
		t.Fatal(err)
	}
	w.gw = gw
	st, err := store.OpenSQLite(w.dbPath)
	if err != nil {
		t.Fatal(err)
	}
	w.st = st
	w.env.Gateway = gw
	w.env.Verifier = &task.Verifier{Store: st, Provider: w.env.Provider}
}

func (w *world) closeServices() {
	w.mu.Lock()
	sockets := w.sockets
	w.sockets = nil
	w.mu.Unlock()
	if sockets != nil {
		sockets.Close()
		_ = w.gw.Close()
		_ = w.st.Close()
	}
}

// ServeSandbox and StopSandbox make the world the local provider's
// gateway server: each sandbox's socket is served by the gateway of the
// moment, and refused while the services are down.
func (w *world) ServeSandbox(id string, ln net.Listener) {
	w.mu.Lock()
	s := w.sockets
	w.mu.Unlock()
	if s == nil {
		_ = ln.Close()
		return
	}
	s.ServeSandbox(id, ln)
}

func (w *world) StopSandbox(id string) {
	w.mu.Lock()
	s := w.sockets
	w.mu.Unlock()
	if s != nil {
		s.StopSandbox(id)
	}
}

// holdCall makes call N of an episode (attempt 0) wait at the gateway.
func (w *world) holdCall(ep string, n int) (arrived, release chan struct{}) {
	call := ep + "/" + strconv.Itoa(n)
	arrived, release = make(chan struct{}), make(chan struct{})
	w.arrived.Store(call, arrived)
	w.hold.Store(call+"@0", release)
	return arrived, release
}

func (w *world) coordinator(ctx context.Context) *coordinator.Coordinator {
	c, err := coordinator.New(ctx, coordinator.Options{Env: w.env, Store: w.st, Tasks: w.tasks, Concurrency: 4})
	if err != nil {
		w.t.Fatal(err)
	}
	return c
}

func waitClosed(t *testing.T, ctx context.Context, ch chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-ctx.Done():
		t.Fatalf("%s: %v", what, ctx.Err())
	}
}

// Three episodes: one ends before the checkpoint, two are held mid-way.
// The checkpoint records the ended one as finished with its verdict and the
// two others paused and snapshotted; then everything "crashes" (the
// sandboxes are deleted and the coordinator forgotten), a new coordinator
// on the same store finds the episodes lost, and the restore relaunches
// the two from their snapshots; they finish with reward 1 and their ledgers
// verify. A second restore of the same checkpoint while they are live is
// refused and changes nothing.
func TestCheckpointCrashRestore(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	w := newWorld(t)
	c := w.coordinator(ctx)
	type ep struct{ id, task string }
	eps := []ep{{"ep-a", "py-ini-value-with-equals"}, {"ep-b", "sh-renext-spaces"}, {"ep-c", "js-slugify-single-replace"}}
	var arrivals []chan struct{}
	var releases []chan struct{}
	for _, e := range eps[1:] {
		a, r := w.holdCall(e.id, 3)
		arrivals, releases = append(arrivals, a), append(releases, r)
	}
	defer func() {
		for _, r := range releases {
			select {
			case <-r:
			default:
				close(r)
			}
		}
	}()
	for _, e := range eps {
		if _, err := c.Start(ctx, e.id, e.task, "mini"); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.Wait(ctx, "ep-a"); err != nil {
		t.Fatal(err)
	}
	for i, a := range arrivals {
		waitClosed(t, ctx, a, "call 3 of "+eps[i+1].id)
	}
	res, err := c.Prepare(ctx, "ckpt-1")
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Episodes) != 3 || !res.Episodes[0].Finished || res.Episodes[1].Snapshot == "" || res.Episodes[2].Snapshot == "" {
		t.Fatalf("prepare: %+v", res)
	}
	ck, recs, err := w.st.Get(ctx, "ckpt-1")
	if err != nil || ck.State != store.StateCommitted || len(recs) != 3 {
		t.Fatalf("checkpoint: %+v %d records %v", ck, len(recs), err)
	}
	if !recs[0].Finished || len(recs[0].Result) == 0 || recs[1].RelayDelivered == nil || *recs[1].RelayDelivered != 2 {
		t.Fatalf("records: %+v / %+v", recs[0], recs[1])
	}

	// The crash: every sandbox gone, the coordinator's memory dropped, the
	// gateway and the store closed and opened again from disk.
	for _, e := range eps {
		row, _ := w.st.GetEpisode(ctx, e.id)
		if err := w.env.Provider.Delete(ctx, row.Sandbox); err != nil {
			t.Fatal(err)
		}
	}
	c.Close()
	for _, r := range releases {
		close(r)
	}
	releases = nil
	w.closeServices()
	w.open(w.modelURL)
	c = w.coordinator(ctx)
	if ids := c.LiveIDs(); len(ids) != 0 {
		t.Fatalf("live after the crash: %v", ids)
	}
	lost, _ := w.st.ListEpisodes(ctx, store.EpisodeLost)
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
		rep, err := ledger.Verify(w.gw.LedgerDir(), e.id)
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
	if infos, _ := w.env.Provider.List(ctx, nil); len(infos) != 0 {
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
	c := w.coordinator(ctx)
	_, release := w.holdCall("ep-d", 1)
	defer close(release)
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
	w := newWorld(t)
	w.env.Provider = claimsProcesses{w.local}
	w.env.Verifier.Provider = w.env.Provider
	w.restoreRelaunches("ep-x", "not the recorded launch", nil)
}

// restoreRelaunches checkpoints episode ep (held at its third model call;
// its record must say it restores in place), deletes its sandbox, and
// restores the checkpoint with a new coordinator (prepare, given the
// record, runs first): the episode must be relaunched, for a reason that
// says why, and still reach reward 1 with a ledger that verifies.
func (w *world) restoreRelaunches(ep, why string, prepare func(store.Record)) {
	t := w.t
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	ck := "ckpt-" + ep
	c := w.coordinator(ctx)
	a, r := w.holdCall(ep, 3)
	released := false
	defer func() {
		if !released {
			close(r)
		}
	}()
	if _, err := c.Start(ctx, ep, "sh-renext-spaces", "mini"); err != nil {
		t.Fatal(err)
	}
	waitClosed(t, ctx, a, "call 3 of "+ep)
	if _, err := c.Prepare(ctx, ck); err != nil {
		t.Fatal(err)
	}
	_, recs, err := w.st.Get(ctx, ck)
	if err != nil || len(recs) != 1 || !recs[0].RestoresInPlace() || recs[0].PauseMode != "hold" {
		t.Fatalf("record: %+v %v", recs, err)
	}
	if prepare != nil {
		prepare(recs[0])
	}
	row, _ := w.st.GetEpisode(ctx, ep)
	if err := w.local.Delete(ctx, row.Sandbox); err != nil {
		t.Fatal(err)
	}
	close(r)
	released = true
	c.Close()
	c = w.coordinator(ctx)
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
	if rep, err := ledger.Verify(w.gw.LedgerDir(), ep); err != nil || !rep.OK || rep.Broken {
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
	identity proc.Identity
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
	rc, _ := json.Marshal(supervisor.Receipt{Identity: h.identity, CleanupConfirmed: true, ReturnCode: &one, Error: "the harness exited 1"})
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
	w := newWorld(t)
	hp := &harnessEndsInFork{claimsProcesses: claimsProcesses{w.local}, episode: "ep-y"}
	w.env.Provider = hp
	w.env.Verifier.Provider = hp
	w.restoreRelaunches("ep-y", "harness ended in the fork before the continue", func(r store.Record) { hp.identity = *r.Identity })
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
	c := w.coordinator(ctx)
	// Call 2's answer carries the fix: the checkpoint is taken before it.
	arrived, release := w.holdCall("ep-d", 2)
	released := false
	defer func() {
		if !released {
			close(release)
		}
	}()
	if _, err := c.Start(ctx, "ep-d", "py-money-negative-cents", "mini"); err != nil {
		t.Fatal(err)
	}
	waitClosed(t, ctx, arrived, "call 2 of ep-d")
	if _, err := c.Prepare(ctx, "ckpt-1"); err != nil {
		t.Fatal(err)
	}
	close(release)
	released = true
	if _, err := c.Wait(ctx, "ep-d"); err != nil {
		t.Fatal(err)
	}
	first, rec, err := c.Verify(ctx, "ep-d")
	if err != nil || rec || first.Reward != 1 || first.Attempt != 0 || first.Status != task.StatusResolved {
		t.Fatalf("the first run: %+v recorded=%v %v", first, rec, err)
	}

	// The crash, and a model that does not solve it (the default script:
	// it reads a file, runs a command and answers).
	row, _ := w.st.GetEpisode(ctx, "ep-d")
	if err := w.env.Provider.Delete(ctx, row.Sandbox); err != nil {
		t.Fatal(err)
	}
	c.Close()
	w.closeServices()
	lazy := httptest.NewServer(model.New(model.Options{}))
	t.Cleanup(lazy.Close)
	w.open(lazy.URL)
	c = w.coordinator(ctx)
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
	if old, ok, err := w.env.Verifier.Recorded(ctx, "ep-d", 0); err != nil || !ok || old.Reward != 1 {
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
	c := w.coordinator(ctx)
	var releases []chan struct{}
	defer func() {
		for _, r := range releases {
			close(r)
		}
	}()
	for _, id := range []string{"ep-good", "ep-bad"} {
		a, r := w.holdCall(id, 3)
		releases = append(releases, r)
		if _, err := c.Start(ctx, id, "sh-renext-spaces", "mini"); err != nil {
			t.Fatal(err)
		}
		waitClosed(t, ctx, a, "call 3 of "+id)
	}
	row, err := w.st.GetEpisode(ctx, "ep-bad")
	if err != nil {
		t.Fatal(err)
	}
	for _, cmd := range []string{"pause", "continue"} {
		var out strings.Builder
		res, err := w.env.Provider.Exec(ctx, row.Sandbox, sandbox.ExecRequest{
			Argv: []string{"/tmp/.stasis/bin/stasis", "ctl", "--dir", "/tmp/stasis/ep-bad", cmd, "1000000"},
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
		meta, recs, err := w.st.Get(ctx, ck)
		if err != nil || meta.State != store.StateCommitted || len(recs) != 1 || recs[0].Episode != "ep-good" {
			t.Fatalf("%s: %+v %+v %v", ck, meta, recs, err)
		}
	}
	_, err = c.PrepareWith(ctx, "ckpt-strict", coordinator.PrepareOptions{Stragglers: coordinator.StragglersFail})
	if err == nil || !strings.Contains(err.Error(), "ep-bad") {
		t.Fatalf("the strict policy: %v, want a failure naming ep-bad", err)
	}
	if meta, _, err := w.st.Get(ctx, "ckpt-strict"); err != nil || meta.State != store.StateFailed {
		t.Fatalf("ckpt-strict: %+v %v", meta, err)
	}
	if _, err := c.PrepareWith(ctx, "ckpt-x", coordinator.PrepareOptions{Stragglers: "maybe"}); err == nil {
		t.Errorf("an unknown policy was accepted")
	}
	for _, r := range releases {
		close(r)
	}
	releases = nil
	for _, id := range []string{"ep-good", "ep-bad"} {
		if _, err := c.Wait(ctx, id); err != nil {
			t.Fatal(err)
		}
		if err := c.Retire(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
}
