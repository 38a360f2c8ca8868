package sim_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"stasis/errdefs"
	"stasis/internal/control/checkpoint"
	"stasis/internal/guestclock"
	"stasis/internal/insandbox/supervisor"
	"stasis/internal/providers/sim"
	"stasis/sandbox"
	"stasis/sandbox/sandboxtest"
)

func TestConformance(t *testing.T) {
	p := sim.Open(t.TempDir(), false)
	sandboxtest.Run(t, sandboxtest.Harness{
		Provider: p,
		FailFork: p.FailFork,
		Retired:  p.Retired,
		Skip: map[string]string{
			"ProcessesAcrossSnapshot":        "a simulated sandbox runs no program and has no /proc; its supervisors across a snapshot are TestSupervisorAcrossSnapshot's",
			"ExpiryKillsEvenAStoppedProcess": "a simulated sandbox runs no program (setsid, kill); its expiry is SetExpiry's",
		},
	})
}

// TestOpenByRegistry: the provider is registered under its name, and a
// second Provider on the same home finds the first one's sandboxes.
func TestOpenByRegistry(t *testing.T) {
	ctx := context.Background()
	home := t.TempDir()
	p, err := sandbox.Open(ctx, sim.Name, sandbox.Config{Home: home, Binary: "/bin/true"})
	if err != nil {
		t.Fatal(err)
	}
	info, err := p.Create(ctx, sandbox.Spec{Expiry: time.Now().Add(time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Delete(ctx, info.ID)
	again, _ := sandbox.Open(ctx, sim.Name, sandbox.Config{Home: home})
	if got, err := again.Get(ctx, info.ID); err != nil || got.ID != info.ID {
		t.Fatalf("a second provider on the home: %+v %v", got, err)
	}
	other, _ := sandbox.Open(ctx, sim.Name, sandbox.Config{Home: t.TempDir()})
	if _, err := other.Get(ctx, info.ID); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("another home sees the sandbox: %v", err)
	}
	if _, err := p.Create(ctx, sandbox.Spec{Image: "oci:/x", Expiry: time.Now().Add(time.Minute)}); !errors.Is(err, errdefs.ErrUnsupported) {
		t.Fatalf("an image: %v, want ErrUnsupported", err)
	}
	var out bytes.Buffer
	if res, err := p.Exec(ctx, info.ID, sandbox.ExecRequest{Argv: []string{"python3", "-c", "1"}, Stderr: &out}); err != nil || res.ExitCode != 127 {
		t.Fatalf("a program the sandbox lacks: %+v %v", res, err)
	}
	if _, err := p.Exec(ctx, info.ID, sandbox.ExecRequest{Argv: []string{"sleep", "1"}, Background: true}); !errors.Is(err, errdefs.ErrUnsupported) {
		t.Fatalf("a background program: %v, want ErrUnsupported", err)
	}
}

// session starts a supervisor in a new simulated sandbox through the
// host's checkpoint session, as an episode does.
func session(t *testing.T, p sandbox.Provider, mode supervisor.Mode) *checkpoint.Session {
	t.Helper()
	ctx := context.Background()
	s, err := checkpoint.NewSession(ctx, checkpoint.SessionOptions{
		Provider: p, Episode: "ep1", PauseMode: mode, Harness: []string{"agent", "--task", "x"},
		Binary: "/bin/true", BinaryInSandbox: sandbox.BinaryPath, Deadline: time.Hour,
		Spec:  sandbox.Spec{Expiry: time.Now().Add(10 * time.Minute)},
		Relay: &checkpoint.RelayOptions{Listen: "127.0.0.1:7411", Upstream: "unix:///gw.sock", TokenFile: "/tmp/stasis/ep1/token.json"},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close(context.Background()) })
	if err := s.PrepareDirs(ctx, "harness"); err != nil {
		t.Fatal(err)
	}
	if err := s.WriteSecret(ctx, "token.json", []byte(`{"token":"t"}`)); err != nil {
		t.Fatal(err)
	}
	if err := s.Start(ctx); err != nil {
		t.Fatal(err)
	}
	return s
}

// TestSupervisorRefusesAsTheRealOne: the simulated supervisor is the real
// state machine: repeated pauses answer the same acknowledgement, a wrong
// or stale sequence number is refused with the supervisor's state, and
// ctl's exit codes and JSON are the real ones'.
func TestSupervisorRefusesAsTheRealOne(t *testing.T) {
	ctx := context.Background()
	p := sim.Open(t.TempDir(), true)
	s := session(t, p, supervisor.ModeHold)

	a, err := s.Pause(ctx, 3)
	if err != nil || a.Seq != 3 || a.Op != "pause" || a.Mode != supervisor.ModeHold || !a.Confirmed || a.Identity.PID == 0 {
		t.Fatalf("pause 3: %+v %v", a, err)
	}
	if a.RelayDelivered == nil || *a.RelayDelivered != 0 || a.DeadlineLeft == nil {
		t.Fatalf("pause 3 with a relay and a deadline: %+v", a)
	}
	again, err := s.Pause(ctx, 3)
	if err != nil || again.Wall != a.Wall {
		t.Fatalf("a repeated pause must answer the same acknowledgement: %+v %v", again, err)
	}
	for _, tc := range []struct {
		name string
		do   func() error
		want string
	}{
		{"pause while paused", func() error { _, err := s.Pause(ctx, 4); return err }, "pause 3 is in force"},
		{"continue of another pause", func() error { _, err := s.Continue(ctx, 2); return err }, "the pause in force is 3"},
	} {
		err := tc.do()
		if !checkpoint.IsRefused(err) || !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want a refusal saying %q", tc.name, err, tc.want)
		}
	}
	if _, err := s.Continue(ctx, 3); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pause(ctx, 2); !checkpoint.IsRefused(err) || !strings.Contains(err.Error(), "above the last one (3)") {
		t.Errorf("a stale pause: %v", err)
	}
	st, err := s.Status(ctx)
	if err != nil || st.State != supervisor.StateRunning || st.Seq != 3 {
		t.Fatalf("status: %+v %v", st, err)
	}
	// The acknowledgements are kept in the session directory.
	if b, err := p.ReadFile(ctx, s.SandboxID(), "/tmp/stasis/ep1/acks/3.pause.json"); err != nil || !json.Valid(b) {
		t.Errorf("acks/3.pause.json: %q %v", b, err)
	}
	// ctl's own checks: a malformed sequence number, an unknown op.
	for _, args := range [][]string{{"pause", "x"}, {"pause", "-1"}, {"frobnicate"}, {"status", "1"}} {
		var out, errb bytes.Buffer
		argv := append([]string{sandbox.BinaryPath, "ctl", "--dir", "/tmp/stasis/ep1"}, args...)
		res, err := p.Exec(ctx, s.SandboxID(), sandbox.ExecRequest{Argv: argv, Stdout: &out, Stderr: &errb})
		if err != nil || res.ExitCode != 2 {
			t.Errorf("ctl %v: %+v %v %s", args, res, err, errb.String())
		}
	}
	// No supervisor in a directory: unreachable, exit 1.
	var out bytes.Buffer
	res, err := p.Exec(ctx, s.SandboxID(), sandbox.ExecRequest{Argv: []string{sandbox.BinaryPath, "ctl", "--dir", "/tmp/none", "status"}, Stdout: &out})
	if err != nil || res.ExitCode != 1 || !strings.Contains(out.String(), supervisor.CodeUnreachable) {
		t.Errorf("ctl with no supervisor: %+v %v %s", res, err, out.String())
	}
	// A second supervisor on a live one's directory is refused.
	if _, err := p.Exec(ctx, s.SandboxID(), sandbox.ExecRequest{Argv: []string{sandbox.BinaryPath, "supervise", "--dir", "/tmp/stasis/ep1", "--", "x"}, Background: true}); err == nil {
		t.Error("a second supervisor on a live one's directory started")
	}
	// Stop ends the harness; the receipt says so, and a continue is
	// then refused as after the supervisor's exit.
	if err := s.Close(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestSupervisorAcrossSnapshot: a fork of a snapshot taken during a pause
// holds the same launch (identity), still paused; the fork's clock is set
// by clock set, and its continue resumes it while the source goes on
// independently.
func TestSupervisorAcrossSnapshot(t *testing.T) {
	ctx := context.Background()
	p := sim.Open(t.TempDir(), true)
	s := session(t, p, supervisor.ModeStop)
	a, err := s.Pause(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	snap, err := p.Snapshot(ctx, s.SandboxID(), "p1")
	if err != nil || !snap.KeepsProcesses {
		t.Fatalf("snapshot: %+v %v", snap, err)
	}
	defer p.DeleteSnapshot(ctx, snap.ID)
	if _, err := s.Continue(ctx, 1); err != nil {
		t.Fatal(err)
	}
	forks, err := p.Fork(ctx, snap.ID, 1, sandbox.ForkSpec{Expiry: time.Now().Add(time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Delete(ctx, forks[0].ID)
	f, err := checkpoint.NewSession(ctx, checkpoint.SessionOptions{
		Provider: p, Episode: "ep1", Sandbox: forks[0].ID, Adopt: true, Running: true, Harness: []string{"agent"},
		Binary: "/bin/true", BinaryInSandbox: sandbox.BinaryPath,
	})
	if err != nil {
		t.Fatal(err)
	}
	st, err := f.Status(ctx)
	if err != nil || st.Identity != a.Identity || st.State != supervisor.StatePaused || st.Seq != 1 {
		t.Fatalf("the fork's supervisor: %+v %v, want launch %v paused at 1", st, err, a.Identity)
	}
	fix, err := f.SetClock(ctx, guestclock.Target{Continuous: true, PauseWall: a.Wall, PauseUptime: a.Uptime})
	if err != nil || fix.Uptime < a.Uptime || math.Abs((fix.After-a.Wall)-(fix.Uptime-a.Uptime)) > 1e-6 {
		t.Fatalf("clock set: %+v %v (paused at wall %v uptime %v)", fix, err, a.Wall, a.Uptime)
	}
	if _, err := f.Continue(ctx, 1); err != nil {
		t.Fatal(err)
	}
	// The fork's next pause is stamped on its own clock: continuous from
	// the pause's wall time, not the host's.
	b, err := f.Pause(ctx, 2)
	if err != nil || b.Wall-a.Wall > b.Uptime-a.Uptime+1 {
		t.Fatalf("the fork's pause 2: %+v %v", b, err)
	}
	// The source is not the fork: it is running, and has no pause 2.
	if st, err := s.Status(ctx); err != nil || st.State != supervisor.StateRunning || st.Seq != 1 {
		t.Fatalf("the source after the fork's pause: %+v %v", st, err)
	}
	if err := f.Close(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestDeadline: the machine's deadline ends the simulated harness as it
// ends a real one, and the receipt says it timed out.
func TestDeadline(t *testing.T) {
	ctx := context.Background()
	p := sim.Open(t.TempDir(), true)
	info, err := p.Create(ctx, sandbox.Spec{Expiry: time.Now().Add(time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Delete(ctx, info.ID)
	if _, err := p.Exec(ctx, info.ID, sandbox.ExecRequest{Argv: []string{sandbox.BinaryPath, "supervise", "--dir", "/tmp/d", "--deadline", "50ms", "--", "agent"}, Background: true}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		var out bytes.Buffer
		if _, err := p.Exec(ctx, info.ID, sandbox.ExecRequest{Argv: []string{sandbox.BinaryPath, "ctl", "--dir", "/tmp/d", "status"}, Stdout: &out}); err != nil {
			t.Fatal(err)
		}
		var st supervisor.Status
		if err := json.Unmarshal(out.Bytes(), &st); err != nil {
			t.Fatalf("status %q: %v", out.String(), err)
		}
		if st.State == supervisor.StateExited {
			if st.Receipt == nil || !st.Receipt.TimedOut || st.Receipt.ReturnCode == nil || *st.Receipt.ReturnCode != -15 {
				t.Fatalf("receipt %+v", st.Receipt)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("still %s 10 s after a 50 ms deadline", st.State)
		}
		time.Sleep(10 * time.Millisecond) // poll interval, bounded by the deadline above
	}
}
