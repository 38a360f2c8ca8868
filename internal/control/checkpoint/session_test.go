package checkpoint_test

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"stasis/errdefs"
	"stasis/internal/control/checkpoint"
	"stasis/internal/insandbox/supervisor"
	"stasis/internal/proc"
	"stasis/internal/providers/local"
	"stasis/internal/stasistest"
	"stasis/internal/testwait"
	"stasis/sandbox"
)

func TestMain(m *testing.M) { stasistest.Main(m) }

var ctx = context.Background()

func newLocal(t *testing.T) *local.Provider {
	t.Helper()
	p, err := local.New(local.Options{Home: t.TempDir(), Exe: stasistest.Exe(), ExeEnv: stasistest.Env})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func opts(p sandbox.Provider, episode string) checkpoint.SessionOptions {
	return checkpoint.SessionOptions{
		Provider: p, Episode: episode, Spec: sandbox.Spec{Expiry: time.Now().Add(time.Hour)},
		Harness:   []string{"/bin/sh", "-c", `while :; do echo x >> /work/progress; sleep 0.02; done`},
		Binary:    stasistest.Exe(),
		BinaryEnv: stasistest.EnvMap,
		Deadline:  time.Hour,
		// A writer can sit in D (disk sleep) for seconds on a loaded
		// machine; these tests are about pausing, not the confirm timeout.
		StopConfirmTimeout: time.Minute,
	}
}

func size(t *testing.T, p sandbox.Provider, id string) int {
	b, err := p.ReadFile(ctx, id, "/work/progress")
	if errors.Is(err, errdefs.ErrNotFound) {
		return 0
	}
	if err != nil {
		t.Fatal(err)
	}
	return len(b)
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testwait.Until(t, what, 15*time.Second, cond)
}

func TestSessionPausesThroughExec(t *testing.T) {
	p := newLocal(t)
	s, err := checkpoint.NewSession(ctx, opts(p, "ep-1"))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Start(ctx); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the harness writes", func() bool { return size(t, p, s.SandboxID()) > 0 })
	if _, err := s.CheckpointState(ctx); !errors.Is(err, checkpoint.ErrNoPause) {
		t.Fatalf("state before a pause: %v", err)
	}
	a, err := s.Pause(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	if !a.Confirmed || a.Mode != supervisor.ModeStop || a.Seq != 1 {
		t.Fatalf("ack %+v", a)
	}
	n := size(t, p, s.SandboxID())
	time.Sleep(150 * time.Millisecond) // observation window: a stopped harness writes nothing
	if m := size(t, p, s.SandboxID()); m != n {
		t.Fatalf("the harness wrote while paused: %d -> %d", n, m)
	}
	st, err := s.CheckpointState(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.PauseSeq != 1 || st.PauseMode != supervisor.ModeStop || !st.PauseConfirmed || st.Identity != a.Identity ||
		st.PauseWall != a.Wall || st.PauseUptime != a.Uptime || st.Provider != "local" || st.KeepsProcesses || st.DeadlineLeftS == nil {
		t.Fatalf("checkpoint state %+v", st)
	}
	up, _ := proc.Uptime()
	if st.PauseUptime <= 0 || st.PauseUptime > up {
		t.Fatalf("pause uptime %v, host uptime %v", st.PauseUptime, up)
	}
	// A stale pause is refused, and says so.
	if _, err := s.Pause(ctx, 1); err != nil {
		t.Fatalf("repeating the pause in force: %v", err)
	}
	if _, err := s.Continue(ctx, 5); !checkpoint.IsRefused(err) || !strings.Contains(err.Error(), "pause in force is 1") {
		t.Fatalf("continue 5: %v", err)
	}
	if _, err := s.Continue(ctx, 1); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the harness writes again", func() bool { return size(t, p, s.SandboxID()) > n })
	if _, err := s.CheckpointState(ctx); !errors.Is(err, checkpoint.ErrNoPause) {
		t.Fatalf("state after continue: %v", err)
	}
	if err := s.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(ctx); err != nil {
		t.Fatalf("second close: %v", err)
	}
	if _, err := p.Get(ctx, s.SandboxID()); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("an owned sandbox survived Close: %v", err)
	}
	stasistest.NoChildrenLeft(t)
}

func TestHoldRefusedOnFileOnlyProvider(t *testing.T) {
	p := newLocal(t)
	o := opts(p, "ep-hold")
	o.PauseMode = supervisor.ModeHold
	_, err := checkpoint.NewSession(ctx, o)
	if !errors.Is(err, checkpoint.ErrHoldNeedsProcesses) || !strings.Contains(err.Error(), "file-only") {
		t.Fatalf("hold on local: %v", err)
	}
	if list, _ := p.List(ctx, nil); len(list) != 0 {
		t.Fatalf("a refused session made a sandbox: %+v", list)
	}
}

func TestBorrowedSandboxSurvivesClose(t *testing.T) {
	p := newLocal(t)
	info, err := p.Create(ctx, sandbox.Spec{Expiry: time.Now().Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = p.Delete(ctx, info.ID) }()
	o := opts(p, "ep-borrow")
	o.Sandbox = info.ID
	s, err := checkpoint.NewSession(ctx, o)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Start(ctx); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the harness writes", func() bool { return size(t, p, info.ID) > 0 })
	if err := s.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Get(ctx, info.ID); err != nil {
		t.Fatalf("a borrowed sandbox was deleted: %v", err)
	}
	if _, err := p.ReadFile(ctx, info.ID, s.Dir()+"/supervisor.json"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("the session directory survived Close: %v", err)
	}
	n := size(t, p, info.ID)
	time.Sleep(150 * time.Millisecond) // observation window: the stopped harness writes nothing
	if m := size(t, p, info.ID); m != n {
		t.Fatal("the harness still runs after Close")
	}
	if err := s.Close(ctx); err != nil {
		t.Fatalf("second close: %v", err)
	}
}

// TestExpiryKillsAPausedSupervisor: at its absolute expiry the host kills
// the sandbox, also while its supervisor holds the harness stopped.
func TestExpiryKillsAPausedSupervisor(t *testing.T) {
	p := newLocal(t)
	o := opts(p, "ep-expiry")
	o.Spec.Expiry = time.Now().Add(time.Minute)
	s, err := checkpoint.NewSession(ctx, o)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = s.Close(ctx) }()
	if err := s.Start(ctx); err != nil {
		t.Fatal(err)
	}
	st, err := s.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pause(ctx, 1); err != nil {
		t.Fatal(err)
	}
	// The host sees the sandbox's processes by the STASIS_SANDBOX variable
	// every exec sets: the supervisor, its shim and the stopped harness.
	if n := sandboxProcs(s.SandboxID()); n < 3 || st.State != "running" {
		t.Fatalf("%d processes of the sandbox seen before its expiry (state %s)", n, st.State)
	}
	// Bring the expiry close, now that the harness is held stopped.
	expiry := time.Now().Add(2 * time.Second)
	if err := p.SetExpiry(ctx, s.SandboxID(), expiry); err != nil {
		t.Fatal(err)
	}
	deadline := expiry.Add(15 * time.Second)
	for {
		_, err := p.Get(ctx, s.SandboxID())
		if errors.Is(err, errdefs.ErrExpired) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("sandbox not expired 15s after its expiry: %v", err)
		}
		time.Sleep(20 * time.Millisecond) // poll interval, bounded by the deadline above
	}
	if time.Now().Before(expiry) {
		t.Fatal("expired early")
	}
	if _, err := s.Status(ctx); err == nil {
		t.Fatal("the supervisor answered after the expiry")
	}
	stasistest.NoChildrenLeft(t)
	deadline = time.Now().Add(10 * time.Second)
	for {
		found := sandboxProcs(s.SandboxID())
		if found == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d processes of the expired sandbox still run", found)
		}
		time.Sleep(20 * time.Millisecond) // poll interval, bounded by the deadline above
	}
}

func sandboxProcs(id string) int {
	all, _ := proc.All()
	found := 0
	for pid := range all {
		b, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/environ")
		if strings.Contains(string(b), "STASIS_SANDBOX="+id) {
			found++
		}
	}
	return found
}

// slowStart delays every background exec (the supervisor's launch) by a
// second, as a loaded machine or a hosted service's exec API may.
type slowStart struct{ sandbox.Provider }

func (p slowStart) Exec(ctx context.Context, id string, r sandbox.ExecRequest) (sandbox.ExecResult, error) {
	if r.Background {
		r.Argv = append([]string{"/bin/sh", "-c", `sleep 1; exec "$@"`, "sh"}, r.Argv...)
	}
	return p.Provider.Exec(ctx, id, r)
}

// TestStartInForkWithEndedLaunch: a fork holds the receipt of the launch
// whose harness ended in it (a resume in place that must relaunch). The
// new supervisor is slow to start; until it moves the receipt aside, the
// receipt answers every status. Start does not return on that answer: it
// waits for the new launch, so that nobody takes the old launch's end for
// the new one's.
func TestStartInForkWithEndedLaunch(t *testing.T) {
	p := newLocal(t)
	info, err := p.Create(ctx, sandbox.Spec{Expiry: time.Now().Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	o := opts(slowStart{p}, "ep-fork")
	o.Sandbox, o.Adopt = info.ID, true
	old := supervisor.Receipt{Identity: proc.Identity{PID: 4242, StartTime: 7}, Mode: supervisor.ModeStop}
	rc, _ := json.Marshal(old)
	dir := "/tmp/stasis/ep-fork"
	if res, err := p.Exec(ctx, info.ID, sandbox.ExecRequest{
		Argv: []string{"sh", "-c", `mkdir -p "$1" && printf '%s' "$2" > "$1/` + supervisor.ReceiptFile + `"`, "sh", dir, string(rc)},
		User: sandbox.UserControl,
	}); err != nil || res.ExitCode != 0 {
		t.Fatalf("write the old receipt: exit %d, %v", res.ExitCode, err)
	}
	s, err := checkpoint.NewSession(ctx, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close(ctx) })
	if err := s.Start(ctx); err != nil {
		t.Fatal(err)
	}
	st, err := s.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.Identity == old.Identity || st.State == supervisor.StateExited {
		t.Fatalf("right after Start the status is the ended launch's: %+v", st)
	}
	if err := s.Close(ctx); err != nil {
		t.Fatal(err)
	}
	stasistest.NoChildrenLeft(t)
}
