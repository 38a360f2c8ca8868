package episode_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"stasis/internal/control/episode"
	"stasis/internal/control/relay"
	"stasis/internal/control/system"
	"stasis/internal/control/task"
	"stasis/internal/insandbox/harness"
	"stasis/internal/insandbox/harness/opencode"
	"stasis/internal/stasistest"
	"stasis/internal/storage/ledger"
	"stasis/sandbox"
)

func TestMain(m *testing.M) { stasistest.Main(m) }

// rig is the system a test runs its episodes on (stasistest.NewWorld: the
// scripted model, the gateway on each sandbox's own socket, the provider,
// the record store), driven through its episode environment: the system's
// coordinator sits idle.
type rig struct {
	w     *stasistest.World
	env   *episode.Env
	gw    *relay.Gateway
	tasks []*task.Task
	// seen, when set, is told of every call that reaches the gateway
	// (episode, call number, attempt) before it is served.
	seen atomic.Pointer[func(episode, call, attempt string)]
}

// newRig is the rig on the local provider, or as opts configure the
// system.
func newRig(t testing.TB, opts ...func(*system.Config)) *rig {
	t.Helper()
	r := &rig{}
	// Calls reach the gateway through the world's holds, and are seen
	// first.
	opts = append(opts, func(c *system.Config) {
		c.LivenessInterval = -1
		held := c.GatewayMiddleware
		c.GatewayMiddleware = func(gh http.Handler) http.Handler {
			if held != nil {
				gh = held(gh)
			}
			return http.HandlerFunc(func(w http.ResponseWriter, q *http.Request) {
				if f := r.seen.Load(); f != nil {
					ep, n, _ := strings.Cut(q.Header.Get(relay.HeaderCallID), "/")
					(*f)(ep, n, q.Header.Get(relay.HeaderAttempt))
				}
				gh.ServeHTTP(w, q)
			})
		}
	})
	r.w = stasistest.NewWorld(t, opts...)
	r.env, r.gw, r.tasks = r.w.Env, r.w.Gateway, r.w.Tasks
	return r
}

// gate holds call n of attempt 0 of episode ep at the gateway until it is
// released.
func (r *rig) gate(ep string, n int) *relay.Hold { return r.w.Hold(ep, n) }

// startToGate starts spec's episode and waits until g's call has arrived
// at the gateway. crash then closes the episode (its sandbox deleted, as a
// crash would take it) and opens the gate; without it the episode is
// closed when the test ends.
func (r *rig) startToGate(t testing.TB, ctx context.Context, spec episode.Spec, g *relay.Hold) (*episode.Episode, func()) {
	t.Helper()
	e, err := episode.Start(ctx, r.env, spec)
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	t.Cleanup(func() {
		if !closed {
			_ = e.Close(context.Background())
		}
	})
	if err := g.Wait(ctx, 1); err != nil {
		r.dump(t, e)
		t.Fatalf("model call %d of %s never came", g.Call, spec.ID)
	}
	return e, func() {
		t.Helper()
		if err := e.Close(ctx); err != nil {
			t.Fatal(err)
		}
		closed = true
		g.Release()
	}
}

// relaunch relaunches spec's episode from snap; the episode is closed and
// the snapshot deleted when the test ends.
func (r *rig) relaunch(t *testing.T, ctx context.Context, spec episode.Spec, snap episode.Snapshot) *episode.Episode {
	t.Helper()
	e, err := episode.Relaunch(ctx, r.env, spec, snap)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := e.Close(context.Background()); err != nil {
			t.Error(err)
		}
		if err := r.env.Provider.DeleteSnapshot(context.Background(), snap.ID); err != nil {
			t.Error(err)
		}
	})
	return e
}

func adapter(t testing.TB, name string) harness.Adapter {
	t.Helper()
	if name == "opencode" {
		if _, err := opencode.Binary(); err != nil {
			t.Fatalf("OpenCode is not installed: %v (make deps-opencode; make test does it first)", err)
		}
	}
	a, err := harness.New(name)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// finish waits for the episode's harness to end, verifies it, and checks
// its ledger.
func (r *rig) finish(t *testing.T, ctx context.Context, e *episode.Episode) task.Verdict {
	t.Helper()
	rc, err := e.Wait(ctx)
	if err != nil {
		r.dump(t, e)
		t.Fatalf("%s: %v", e.ID(), err)
	}
	if rc.ReturnCode == nil || *rc.ReturnCode != 0 || !rc.CleanupConfirmed {
		r.dump(t, e)
		t.Fatalf("%s: the harness ended badly: %+v", e.ID(), rc)
	}
	v, recorded, err := e.Verify(ctx)
	if err != nil || recorded {
		t.Fatalf("%s: verify: %v (recorded before: %v)", e.ID(), err, recorded)
	}
	rep, err := ledger.VerifyIn(r.gw.Ledgers(), e.ID())
	if err != nil || !rep.OK || rep.Broken || rep.Live < 3 {
		t.Fatalf("%s: ledger: %+v %v", e.ID(), rep, err)
	}
	return v
}

func (r *rig) dump(t testing.TB, e *episode.Episode) {
	t.Helper()
	ctx := context.Background()
	for _, f := range []string{"/tmp/stasis/" + e.ID() + "/supervisor.log"} {
		b, err := r.env.Provider.ReadFile(ctx, e.SandboxID(), f)
		t.Logf("%s (%v):\n%s", f, err, b)
	}
}

// onePerLanguage is the first built-in task of each language.
func onePerLanguage(ts []*task.Task) []*task.Task {
	seen := map[string]bool{}
	var out []*task.Task
	for _, tk := range ts {
		if !seen[tk.Language] {
			seen[tk.Language] = true
			out = append(out, tk)
		}
	}
	return out
}

// Every built-in task runs to reward 1 with the mini harness, and one task
// of each language with OpenCode, on the local provider with the scripted
// model. (Mini shows that every task's script solves it; OpenCode that its
// tools work in every toolchain. OpenCode on all twelve took about eleven
// minutes of the suite, most of it compiling Go's standard library for
// tests again in each fresh sandbox.)
func TestEveryBuiltinTaskSolves(t *testing.T) {
	for _, h := range []string{"mini", "opencode"} {
		t.Run(h, func(t *testing.T) {
			r := newRig(t)
			a := adapter(t, h)
			par := 3
			if h == "opencode" {
				par = 2
			}
			sem := make(chan struct{}, par)
			var wg sync.WaitGroup
			tasks := r.tasks
			if h == "opencode" {
				tasks = onePerLanguage(r.tasks)
			}
			for _, tk := range tasks {
				wg.Add(1)
				go func() {
					defer wg.Done()
					sem <- struct{}{}
					defer func() { <-sem }()
					t.Run(tk.ID, func(t *testing.T) {
						// Generous: a Go task's seed compiles the standard
						// library's test dependencies, minutes under a loaded
						// two-core CI.
						ctx, cancel := context.WithTimeout(context.Background(), 12*time.Minute)
						defer cancel()
						start := time.Now()
						e, err := episode.Start(ctx, r.env, episode.Spec{ID: h + "-" + tk.ID, Task: tk, Harness: a})
						if err != nil {
							t.Fatal(err)
						}
						defer func() {
							if err := e.Close(context.Background()); err != nil {
								t.Error(err)
							}
						}()
						// A Go task's start made its build cache seed (once
						// for the package's tests), in its fresh sandbox.
						if tk.Language == "go" && r.env.Verifier.ReadySeed(ctx, tk) == "" {
							t.Error("no Go build cache seed after a Go task's start")
						}
						v := r.finish(t, ctx, e)
						if v.Reward != 1 {
							t.Fatalf("reward %d: %v %v\n%s", v.Reward, v.FailToPass, v.PassToPass, v.Output)
						}
						t.Logf("reward 1 in %s", time.Since(start).Round(time.Millisecond))
					})
				}()
			}
			wg.Wait()
		})
	}
}

// An episode stopped mid-way (a stop pause while its third model call is
// at the model), snapshotted, and lost (its sandbox deleted, as a crash
// would), is relaunched from a fork of the snapshot: the harness continues
// its saved session, the gateway matches the relaunched history against the
// ledger and marks the boundary, and the task is solved.
var relaunchBudget = 5 * time.Minute

func TestRelaunchFromSnapshotContinues(t *testing.T) {
	if d, err := time.ParseDuration(os.Getenv("STASIS_TEST_RELAUNCH_BUDGET")); err == nil {
		relaunchBudget = d
	}
	for _, h := range []string{"mini", "opencode"} {
		t.Run(h, func(t *testing.T) {
			r := newRig(t)
			a := adapter(t, h)
			tk, err := task.Lookup(r.tasks, "py-ini-value-with-equals")
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), relaunchBudget)
			defer cancel()
			id := h + "-relaunch"
			g := r.gate(id, 3)
			defer g.Release()
			spec := episode.Spec{ID: id, Task: tk, Harness: a}
			e, crash := r.startToGate(t, ctx, spec, g)
			snap, err := e.PauseAndSnapshot(ctx, 1, false)
			if err != nil {
				t.Fatal(err)
			}
			if !snap.State.PauseConfirmed || snap.State.RelayDelivered == nil || *snap.State.RelayDelivered != 2 {
				t.Fatalf("pause state: %+v", snap.State)
			}
			if h == "opencode" && snap.State.HarnessSession == "" {
				t.Fatal("no OpenCode session id recorded at the pause")
			}
			// The crash: the sandbox is gone with everything in it.
			crash()

			e2 := r.relaunch(t, ctx, spec, snap)
			if e2.Attempt() != 1 {
				t.Fatalf("attempt %d after a relaunch", e2.Attempt())
			}
			v := r.finish(t, ctx, e2)
			if v.Reward != 1 {
				if hist, err := ledger.ReadIn(r.gw.Ledgers(), id); err == nil {
					for i, en := range hist.Entries {
						var req struct {
							Messages []struct {
								Role    string          `json:"role"`
								Content json.RawMessage `json:"content"`
							} `json:"messages"`
						}
						_ = json.Unmarshal(en.Request, &req)
						var roles []string
						for _, m := range req.Messages {
							c := string(m.Content)
							if len(c) > 60 {
								c = c[:60]
							}
							roles = append(roles, m.Role+":"+c)
						}
						t.Logf("entry %d attempt %d boundary %v: %s\n  response %.300s", i, en.Attempt, en.Boundary, strings.Join(roles, " | "), en.Response)
					}
				}
				t.Fatalf("reward %d after the relaunch: %v %v\n%s", v.Reward, v.FailToPass, v.PassToPass, v.Output)
			}
			hist, err := ledger.ReadIn(r.gw.Ledgers(), id)
			if err != nil {
				t.Fatal(err)
			}
			es := hist.Entries
			boundary := -1
			for i, en := range es {
				if en.Boundary {
					boundary = i
				}
			}
			// Entries 0 and 1 were delivered before the pause; the third call
			// never reached the ledger; the relaunched harness's first call
			// is entry 2, marked as the boundary.
			if boundary != 2 || es[2].Attempt != 1 || es[1].Attempt != 0 || hist.Broken {
				t.Fatalf("ledger after the relaunch: boundary at %d, %d entries, broken %v", boundary, len(es), hist.Broken)
			}
			rep, _ := ledger.VerifyIn(r.gw.Ledgers(), id)
			t.Logf("%s: relaunched from %s; ledger %d live entries, %d cuts", h, snap.ID, rep.Live, rep.Cuts)
		})
	}
}

// An OpenCode episode paused before its saved session held the task is
// relaunched on the task afresh, not on the resume message alone: a
// continue with nothing to continue would start a conversation that lacks
// the task, and the episode would end unresolved. Two such pauses, made
// while the first model call waits at the gateway:
//   - no session saved at all (OpenCode's data directory removed);
//   - the session saved but not yet its first message (the rows removed):
//     OpenCode writes them in separate transactions, and a pause between
//     them was seen in `make demo` (about one run in three).
func TestRelaunchWithoutSavedSessionStartsAfresh(t *testing.T) {
	const sessionWithoutMessage = `import sqlite3, sys
c = sqlite3.connect(sys.argv[1])
c.execute("delete from part")
c.execute("delete from message")
c.commit()
n = c.execute("select count(*) from session").fetchone()[0]
if n != 1:
    sys.exit("sessions: %d" % n)
`
	r := newRig(t)
	a := adapter(t, "opencode")
	tk, err := task.Lookup(r.tasks, "py-ini-value-with-equals")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		argv func(dataDir string) []string
	}{
		{"no-session", func(d string) []string { return []string{"rm", "-rf", "--", d} }},
		{"session-without-message", func(d string) []string {
			return []string{"python3", "-c", sessionWithoutMessage, d + "/opencode/opencode.db"}
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), relaunchBudget)
			defer cancel()
			id := "opencode-" + c.name
			g := r.gate(id, 1)
			defer g.Release()
			spec := episode.Spec{ID: id, Task: tk, Harness: a}
			e, crash := r.startToGate(t, ctx, spec, g)
			dataDir := "/tmp/stasis/" + id + "/harness/data"
			var out bytes.Buffer
			res, err := r.env.Provider.Exec(ctx, e.SandboxID(), sandbox.ExecRequest{Argv: c.argv(dataDir), Stdout: &out, Stderr: &out})
			if err != nil || res.ExitCode != 0 {
				t.Fatalf("%v: %v %+v\n%s", c.argv(dataDir), err, res, out.String())
			}
			snap, err := e.PauseAndSnapshot(ctx, 1, false)
			if err != nil {
				t.Fatal(err)
			}
			if snap.State.HarnessSession != "" {
				t.Fatalf("a session %q was recorded before any model call was answered", snap.State.HarnessSession)
			}
			crash()

			e2 := r.relaunch(t, ctx, spec, snap)
			v := r.finish(t, ctx, e2)
			if v.Reward != 1 {
				t.Fatalf("reward %d after the relaunch: %v %v\n%s", v.Reward, v.FailToPass, v.PassToPass, v.Output)
			}
		})
	}
}

// countingSessions is an adapter that counts the calls of Session.
type countingSessions struct {
	harness.Adapter
	n atomic.Int32
}

func (c *countingSessions) Session(ctx context.Context, p sandbox.Files, id string, l harness.Launch) (string, error) {
	c.n.Add(1)
	return c.Adapter.Session(ctx, p, id, l)
}

// A checkpoint asks for the harness's saved session only once the harness
// has had a model call answered: before that there is nothing to resume,
// and the query can race the harness's start-up (two OpenCode processes
// migrating one new database at once: one of them fails, the harness as
// likely as the query). Paused while its first call is held, the episode
// is not asked; paused at its third, it is.
func TestSessionAskedOnlyAfterAModelCall(t *testing.T) {
	r := newRig(t)
	tk, err := task.Lookup(r.tasks, "sh-renext-spaces")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	a := &countingSessions{Adapter: adapter(t, "mini")}
	id := "ask-session"
	g1 := r.gate(id, 1)
	defer g1.Release()
	e, _ := r.startToGate(t, ctx, episode.Spec{ID: id, Task: tk, Harness: a}, g1)
	snap, err := e.PauseAndSnapshot(ctx, 1, true)
	if err != nil {
		t.Fatal(err)
	}
	_ = r.env.Provider.DeleteSnapshot(ctx, snap.ID)
	if d := snap.State.RelayDelivered; d == nil || *d != 0 || a.n.Load() != 0 {
		t.Fatalf("paused before any answer (delivered %v): Session asked %d times", d, a.n.Load())
	}
	g3 := r.gate(id, 3)
	defer g3.Release()
	g1.Release()
	if err := g3.Wait(ctx, 1); err != nil {
		t.Fatal("call 3 never came")
	}
	snap, err = e.PauseAndSnapshot(ctx, 2, true)
	if err != nil {
		t.Fatal(err)
	}
	_ = r.env.Provider.DeleteSnapshot(ctx, snap.ID)
	if d := snap.State.RelayDelivered; d == nil || *d != 2 || a.n.Load() != 1 {
		t.Fatalf("paused after two answers (delivered %v): Session asked %d times, want 1", d, a.n.Load())
	}
	g3.Release()
	if v := r.finish(t, ctx, e); v.Reward != 1 {
		t.Fatalf("reward %d", v.Reward)
	}
}

// An episode whose harness ends before the episode has made any model
// call is verified as an error, not as the model's failure, and no test
// runs: the model never acted (here the harness is killed while its first
// call waits at the gateway, as a harness that cannot start or resume, or
// a model server that never answers, would end it). Killed once a call
// has been answered, the model has acted, and the tests judge its work as
// ever (unresolved).
func TestNoModelCallIsAnErrorNotAFailure(t *testing.T) {
	r := newRig(t)
	tk, err := task.Lookup(r.tasks, "sh-renext-spaces")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		call   int
		status string
	}{{1, task.StatusError}, {2, task.StatusUnresolved}} {
		t.Run(fmt.Sprintf("killed-at-call-%d", c.call), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
			defer cancel()
			id := fmt.Sprintf("killed-at-%d", c.call)
			g := r.gate(id, c.call)
			defer g.Release()
			e, _ := r.startToGate(t, ctx, episode.Spec{ID: id, Task: tk, Harness: adapter(t, "mini")}, g)
			var out bytes.Buffer
			res, err := r.env.Provider.Exec(ctx, e.SandboxID(), sandbox.ExecRequest{Argv: []string{"pkill", "-KILL", "-f", "stasis mini"}, Stdout: &out, Stderr: &out})
			if err != nil || res.ExitCode != 0 {
				t.Fatalf("pkill the harness: %v %+v %s", err, res, out.String())
			}
			rc, err := e.Wait(ctx)
			if err != nil || rc.ReturnCode == nil || *rc.ReturnCode != -9 {
				t.Fatalf("the harness's end: %+v %v", rc, err)
			}
			v, rec, err := e.Verify(ctx)
			if err != nil || rec || v.Status != c.status || v.Reward != 0 {
				t.Fatalf("verify: %+v recorded=%v %v", v, rec, err)
			}
			if c.status == task.StatusError {
				if !strings.Contains(v.Reason, "killed by signal 9") || !strings.Contains(v.Reason, "before the episode made any model call") || v.Output != "" {
					t.Fatalf("the error verdict: reason %q, output %q", v.Reason, v.Output)
				}
			} else if v.Output == "" || len(v.FailToPass) == 0 {
				t.Fatalf("the tests did not judge the work of a model that acted: %+v", v)
			}
			if again, rec, err := e.Verify(ctx); err != nil || !rec || again.Status != c.status || again.Reason != v.Reason {
				t.Fatalf("a second verify: %+v recorded=%v %v", again, rec, err)
			}
		})
	}
}
