package supervisor

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"stasis/internal/proc"
)

// fakeClock is a clock the test moves by hand.
type fakeClock struct{ t time.Time }

func (c *fakeClock) Now() time.Time      { return c.t }
func (c *fakeClock) Wall() float64       { return float64(c.t.UnixNano()) / 1e9 }
func (c *fakeClock) Uptime() float64     { return float64(c.t.Sub(time.Unix(1_000_000, 0))) / 1e9 }
func (c *fakeClock) add(d time.Duration) { c.t = c.t.Add(d) }

// fakeProc records what the machine asks of the process layer.
type fakeProc struct {
	calls       []string
	stopOK      bool
	launchErr   error
	nextPID     int
	killLeft    []int
	launchedGen int
}

func (f *fakeProc) Launch(gen int, argv []string) (int, error) {
	f.calls = append(f.calls, "launch "+strings.Join(argv, " "))
	if f.launchErr != nil {
		return 0, f.launchErr
	}
	f.launchedGen = gen
	f.nextPID++
	return 100 + f.nextPID, nil
}
func (f *fakeProc) StopTree(time.Duration) (bool, string, error) {
	f.calls = append(f.calls, "stop")
	if f.stopOK {
		return true, "", nil
	}
	return false, "pid 7 (x) in state D", nil
}
func (f *fakeProc) FreezeTree(time.Duration) (bool, string, error) {
	f.calls = append(f.calls, "freeze")
	if f.stopOK {
		return true, "", nil
	}
	return false, "processes 7", nil
}
func (f *fakeProc) ThawTree() error  { f.calls = append(f.calls, "thaw"); return nil }
func (f *fakeProc) ContTree() error  { f.calls = append(f.calls, "cont"); return nil }
func (f *fakeProc) Terminate() error { f.calls = append(f.calls, "term"); return nil }
func (f *fakeProc) KillTree() ([]int, error) {
	f.calls = append(f.calls, "kill")
	return f.killLeft, nil
}
func (f *fakeProc) take() string { s := strings.Join(f.calls, ","); f.calls = nil; return s }
func (f *fakeProc) expect(t *testing.T, want string) {
	t.Helper()
	if got := f.take(); got != want {
		t.Fatalf("process calls %q, want %q", got, want)
	}
}

type fakeGate struct {
	held      bool
	delivered int64
	log       []string
}

func (g *fakeGate) Hold() (Held, error) {
	g.held = true
	g.log = append(g.log, "hold")
	return Held{Delivered: g.delivered, Position: g.delivered + 1}, nil
}
func (g *fakeGate) Release() error { g.held = false; g.log = append(g.log, "release"); return nil }
func (g *fakeGate) Flush(context.Context) error {
	g.log = append(g.log, "flush")
	return nil
}

func newTestMachine(t *testing.T, cfg Config) (*Machine, *fakeProc, *fakeClock) {
	t.Helper()
	if cfg.Argv == nil {
		cfg.Argv = []string{"harness"}
	}
	p := &fakeProc{stopOK: true}
	c := &fakeClock{t: time.Unix(1_000_100, 0)}
	m := NewMachine(cfg, proc.Identity{PID: 9, StartTime: 99}, p, nil, c)
	if err := m.Start(); err != nil {
		t.Fatal(err)
	}
	p.expect(t, "launch harness")
	return m, p, c
}

func refused(t *testing.T, err error, want string) {
	t.Helper()
	var re *RefusedError
	if !errors.As(err, &re) {
		t.Fatalf("want a refusal containing %q, got %v", want, err)
	}
	if !strings.Contains(re.Msg, want) {
		t.Fatalf("refusal %q does not say %q", re.Msg, want)
	}
}

func TestSequenceRules(t *testing.T) {
	m, p, _ := newTestMachine(t, Config{Mode: ModeStop})

	_, _, err := m.Continue(1)
	refused(t, err, "no pause is in force")

	a, fresh, err := m.Pause(3)
	if err != nil || !fresh || a.Seq != 3 || a.Op != OpPause || !a.Confirmed || a.Mode != ModeStop || a.Identity.PID != 9 {
		t.Fatalf("pause 3: %+v %v %v", a, fresh, err)
	}
	if a.Relaunched != nil {
		t.Fatal("a pause acknowledgement must not carry relaunched")
	}
	p.expect(t, "stop")

	again, fresh, err := m.Pause(3)
	if err != nil || fresh || again != a {
		t.Fatalf("repeated pause must return the same acknowledgement: %+v %v", again, err)
	}
	_, _, err = m.Pause(4)
	refused(t, err, "pause 3 is in force")
	_, _, err = m.Continue(2)
	refused(t, err, "the pause in force is 3")
	p.expect(t, "")

	c, fresh, err := m.Continue(3)
	if err != nil || !fresh || c.Op != OpContinue || c.Relaunched == nil || *c.Relaunched {
		t.Fatalf("continue 3: %+v %v", c, err)
	}
	p.expect(t, "cont")
	c2, fresh, err := m.Continue(3)
	if err != nil || fresh || c2 != c {
		t.Fatal("repeated continue must return its acknowledgement")
	}
	for _, n := range []int64{1, 2, 3} {
		_, _, err = m.Pause(n)
		refused(t, err, "above the last one (3)")
	}
	if _, _, err := m.Pause(4); err != nil {
		t.Fatal(err)
	}
	if s := m.Status(); s.State != "paused" || s.Seq != 4 || *s.Confirmed != true {
		t.Fatalf("status %+v", s)
	}
	p.expect(t, "stop")
}

func TestHoldPauseSendsNothing(t *testing.T) {
	m, p, _ := newTestMachine(t, Config{Mode: ModeHold})
	g := &fakeGate{delivered: 5}
	m.gate = g
	a, _, err := m.Pause(1)
	if err != nil || !a.Confirmed || a.Mode != ModeHold {
		t.Fatal(a, err)
	}
	if a.RelayDelivered == nil || *a.RelayDelivered != 5 || a.RelayPosition == nil || *a.RelayPosition != 6 || !g.held {
		t.Fatalf("relay_delivered %v, relay_position %v, held %v", a.RelayDelivered, a.RelayPosition, g.held)
	}
	if _, _, err := m.Continue(1); err != nil {
		t.Fatal(err)
	}
	p.expect(t, "") // no signal either way
	if g.held {
		t.Fatal("continue must release the relay")
	}
}

func TestDeadlineCreditsPausedTime(t *testing.T) {
	for _, mode := range []Mode{ModeStop, ModeHold} {
		t.Run(string(mode), func(t *testing.T) {
			m, p, c := newTestMachine(t, Config{Mode: mode, Deadline: 2 * time.Second, Grace: time.Second})
			c.add(1500 * time.Millisecond)
			a, _, err := m.Pause(1)
			if err != nil {
				t.Fatal(err)
			}
			if a.DeadlineLeft == nil || *a.DeadlineLeft != 0.5 {
				t.Fatalf("pause ack deadline_left_s %v, want 0.5", a.DeadlineLeft)
			}
			if !m.NextWake().IsZero() {
				t.Fatal("no deadline timer while paused")
			}
			c.add(3 * time.Second)
			m.Tick()
			if left := *m.Status().DeadlineLeft; left != 0.5 {
				t.Fatalf("deadline left %v while paused, want 0.5", left)
			}
			if _, _, err := m.Continue(1); err != nil {
				t.Fatal(err)
			}
			p.take()
			if got := m.NextWake().Sub(c.t); got != 500*time.Millisecond {
				t.Fatalf("wake in %v, want 500ms", got)
			}
			c.add(499 * time.Millisecond)
			m.Tick()
			if m.Status().State != "running" {
				t.Fatal("timed out early")
			}
			c.add(time.Millisecond)
			m.Tick()
			p.expect(t, "term")
			if m.Status().State != "stopping" {
				t.Fatal("not stopping at the deadline")
			}
			_, _, err = m.Pause(2)
			refused(t, err, "ending")
			c.add(time.Second)
			m.Tick()
			p.expect(t, "kill")
			if err := m.HarnessExited(1, -9); err != nil {
				t.Fatal(err)
			}
			rc := m.Receipt()
			if !rc.TimedOut || *rc.ReturnCode != -9 || rc.PausedTotal != 3 || !rc.CleanupConfirmed {
				t.Fatalf("receipt %+v", rc)
			}
		})
	}
}

func TestUnconfirmedPauseKillsAndRelaunches(t *testing.T) {
	m, p, _ := newTestMachine(t, Config{Mode: ModeStop, ResumeArgv: []string{"resume"}})
	p.stopOK = false
	a, _, err := m.Pause(1)
	if err != nil || a.Confirmed || !strings.Contains(a.Note, "state D") {
		t.Fatalf("%+v %v", a, err)
	}
	p.expect(t, "stop,kill")
	// The killed launch's exit is stale.
	if err := m.HarnessExited(1, -9); !errors.Is(err, ErrStaleLaunch) {
		t.Fatalf("exit of killed launch: %v", err)
	}
	c, _, err := m.Continue(1)
	if err != nil || !*c.Relaunched || !c.Confirmed {
		t.Fatalf("%+v %v", c, err)
	}
	p.expect(t, "launch resume")
	if s := m.Status(); s.Relaunches != 1 || s.State != "running" || s.HarnessPID != 102 {
		t.Fatalf("%+v", s)
	}
	if err := m.HarnessExited(1, 0); !errors.Is(err, ErrStaleLaunch) {
		t.Fatal("exit of the first launch must be stale after a relaunch")
	}
	if err := m.HarnessExited(2, 3); err != nil {
		t.Fatal(err)
	}
	if rc := m.Receipt(); rc.Relaunches != 1 || *rc.ReturnCode != 3 || rc.TimedOut {
		t.Fatalf("%+v", rc)
	}
}

func TestRelaunchFailureEndsTheMachine(t *testing.T) {
	m, p, _ := newTestMachine(t, Config{Mode: ModeStop})
	p.stopOK = false
	if _, _, err := m.Pause(1); err != nil {
		t.Fatal(err)
	}
	p.launchErr = errors.New("no such file")
	c, fresh, err := m.Continue(1)
	if err != nil || !fresh || c.Confirmed || *c.Relaunched {
		t.Fatalf("%+v %v", c, err)
	}
	if !m.Exited() || !strings.Contains(m.Receipt().Error, "no such file") {
		t.Fatalf("receipt %+v", m.Receipt())
	}
}

func TestHarnessExitDuringHold(t *testing.T) {
	m, p, _ := newTestMachine(t, Config{Mode: ModeHold})
	g := &fakeGate{}
	m.gate = g
	if _, _, err := m.Pause(1); err != nil {
		t.Fatal(err)
	}
	if err := m.HarnessExited(1, 0); err != nil {
		t.Fatal(err)
	}
	p.expect(t, "kill")
	if !m.Exited() || g.held {
		t.Fatal("exit during a hold must end the machine and release the relay")
	}
	_, _, err := m.Continue(1)
	refused(t, err, "ending")
}

func TestStopWhileStoppedDeliversTerm(t *testing.T) {
	m, p, _ := newTestMachine(t, Config{Mode: ModeStop, Grace: time.Second})
	if _, _, err := m.Pause(1); err != nil {
		t.Fatal(err)
	}
	p.take()
	m.Stop()
	p.expect(t, "term,cont")
	m.Stop() // idempotent
	p.expect(t, "")
	if err := m.HarnessExited(1, -15); err != nil {
		t.Fatal(err)
	}
	if rc := m.Receipt(); rc.TimedOut || !rc.Stopped {
		t.Fatalf("%+v", rc)
	}
}

func TestStopAfterUnconfirmedEndsAtOnce(t *testing.T) {
	m, p, _ := newTestMachine(t, Config{Mode: ModeStop})
	p.stopOK = false
	p.killLeft = []int{77}
	if _, _, err := m.Pause(1); err != nil {
		t.Fatal(err)
	}
	m.Stop()
	rc := m.Receipt()
	if !m.Exited() || rc.ReturnCode != nil || rc.CleanupConfirmed || rc.Leftover[0] != 77 {
		t.Fatalf("%+v", rc)
	}
}

func TestLaunchFailure(t *testing.T) {
	p := &fakeProc{launchErr: errors.New("exec: not found")}
	m := NewMachine(Config{Argv: []string{"nope"}}, proc.Identity{PID: 1}, p, nil, &fakeClock{t: time.Unix(5, 0)})
	if err := m.Start(); err == nil {
		t.Fatal("launch failure not reported")
	}
	if !m.Exited() || m.Receipt().ReturnCode != nil || !strings.Contains(m.Receipt().Error, "not found") {
		t.Fatalf("%+v", m.Receipt())
	}
}

// TestHoldFreeze: a hold+freeze pause freezes the tree and says frozen;
// the continue thaws it; a stop while frozen thaws so that SIGTERM lands;
// a freeze not confirmed in time kills the tree, thaws the empty group
// (the relaunch must not start frozen) and relaunches at the continue.
func TestHoldFreeze(t *testing.T) {
	m, p, _ := newTestMachine(t, Config{Mode: ModeHoldFreeze})
	a, _, err := m.Pause(1)
	if err != nil || !a.Confirmed || !a.Frozen || a.Mode != ModeHoldFreeze {
		t.Fatalf("pause: %+v %v", a, err)
	}
	p.expect(t, "freeze")
	if s := m.Status(); !s.Frozen || s.State != "paused" {
		t.Fatalf("status while frozen: %+v", s)
	}
	c, _, err := m.Continue(1)
	if err != nil || !c.Confirmed || *c.Relaunched || c.Frozen {
		t.Fatalf("continue: %+v %v", c, err)
	}
	p.expect(t, "thaw")
	if m.Status().Frozen {
		t.Fatal("frozen after the continue")
	}

	if _, _, err := m.Pause(2); err != nil {
		t.Fatal(err)
	}
	p.expect(t, "freeze")
	m.Stop()
	p.expect(t, "term,thaw")

	m, p, _ = newTestMachine(t, Config{Mode: ModeHoldFreeze, ResumeArgv: []string{"resume"}})
	p.stopOK = false
	a, _, err = m.Pause(1)
	if err != nil || a.Confirmed || a.Frozen || !strings.Contains(a.Note, "processes 7") || !strings.Contains(a.Note, "relaunched") {
		t.Fatalf("unconfirmed freeze: %+v %v", a, err)
	}
	p.expect(t, "freeze,kill,thaw")
	c, _, err = m.Continue(1)
	if err != nil || !*c.Relaunched {
		t.Fatalf("continue after an unconfirmed freeze: %+v %v", c, err)
	}
	p.expect(t, "launch resume")
}

// TestCloneGoesOnAlone: a clone of a paused machine (a memory snapshot's
// copy) is in the same state and drives its own process layer; what
// either does afterwards leaves the other as it was.
func TestCloneGoesOnAlone(t *testing.T) {
	m, p, c := newTestMachine(t, Config{Mode: ModeStop, Deadline: time.Hour})
	a, _, err := m.Pause(2)
	if err != nil {
		t.Fatal(err)
	}
	p.expect(t, "stop")
	cp := &fakeProc{stopOK: true}
	cc := &fakeClock{t: c.t}
	k := m.Clone(cp, nil, cc)
	if st := k.Status(); st.State != StatePaused || st.Seq != 2 || st.Identity != a.Identity {
		t.Fatalf("the clone's status %+v", st)
	}
	if again, fresh, err := k.Pause(2); err != nil || fresh || again.Wall != a.Wall {
		t.Fatalf("the clone repeats pause 2: %+v %v %v", again, fresh, err)
	}
	if _, _, err := k.Continue(2); err != nil {
		t.Fatal(err)
	}
	cp.expect(t, "cont")
	p.expect(t, "")
	if st := m.Status(); st.State != StatePaused {
		t.Fatalf("the original after the clone's continue: %+v", st)
	}
	_, _, err = m.Pause(3)
	refused(t, err, "pause 2 is in force")
	if _, _, err := k.Pause(3); err != nil {
		t.Fatalf("the clone's own pause 3: %v", err)
	}
}
