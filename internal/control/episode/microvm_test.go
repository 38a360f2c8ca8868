package episode_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"stasis/internal/control/episode"
	"stasis/internal/control/system"
	"stasis/internal/control/task"
	"stasis/internal/insandbox/harness"
	"stasis/internal/insandbox/supervisor"
	"stasis/internal/providers/microvm"
	"stasis/internal/stasistest"
	"stasis/internal/storage/ledger"
	"stasis/sandbox"
)

// newMicroVMRig is the rig on the microVM provider (by the registry, as
// the server opens it), or as opts further configure the system: the
// guest image holds a static stasis at the bound binary's path, and QEMU
// forwards the guest's GatewayAddr to a gateway socket of the guest's own.
// OpenCode, when installed, is on a read-only disk of every guest, as the
// server gives it.
func newMicroVMRig(t testing.TB, opts ...func(*system.Config)) (*rig, *microvm.Provider) {
	t.Helper()
	if os.Getenv(microvm.KernelEnv) == "" {
		t.Fatalf("%s is not set: run the tests with make (make deps-microvm unpacks the kernel)", microvm.KernelEnv)
	}
	guest := stasistest.StaticBinary(t)
	r := newRig(t, append([]func(*system.Config){func(c *system.Config) {
		c.Provider, c.GuestBinary = microvm.Name, guest
	}}, opts...)...)
	mp, ok := r.env.Provider.(*microvm.Provider)
	if !ok {
		t.Fatalf("the microvm provider is a %T", r.env.Provider)
	}
	return r, mp
}

// newOpenCodeMicroVMRig is the microVM rig for OpenCode: guests boot the
// test image (Debian: Node, glibc), OpenCode's npm prefix is bound in
// read-only as the server binds it.
func newOpenCodeMicroVMRig(t testing.TB) (*rig, *microvm.Provider) {
	t.Helper()
	if _, ok := harness.OpenCodeBind(); !ok {
		t.Fatal("OpenCode is not installed (make deps-opencode; make test does it first)")
	}
	im := stasistest.TestImage(t)
	return newMicroVMRig(t, func(c *system.Config) { c.Image = im })
}

// A mini episode in a microVM is hold-paused while its third model call
// is held at the gateway, snapshotted with its processes, and restored
// twice from that one snapshot (a fork of 2): one copy in place under its
// own name, one as a copy with a ledger of its own. Both finish with
// reward 1 without a relaunch, each ledger verifies with the held call
// re-issued once under the new attempt; the guest's wall clock does not
// jump across the restore under the continuous policy (the original), and
// is the host's under the host policy (the copy).
func TestMicroVMHoldForkOfTwoResumesInPlace(t *testing.T) {
	r, mp := newMicroVMRig(t)
	tk, err := task.Lookup(r.tasks, "sh-renext-spaces")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	id := "vm-hold"
	spec := episode.Spec{ID: id, Task: tk, Harness: adapter(t, "mini")}
	snap := r.heldSnapshot(t, ctx, mp, spec, 3)
	st := snap.State
	// Let time pass outside the saved guest, so that the two clock
	// policies give clocks seconds apart (a deliberate gap, not a wait for
	// anything).
	if d := time.Until(time.Unix(0, int64(st.PauseWall*1e9)).Add(5 * time.Second)); d > 0 {
		time.Sleep(d)
	}
	// The copy under the host clock policy.
	hostEnv := *r.env
	hostEnv.ClockPolicy = episode.ClockHost
	copyID := id + "-copy"
	eps := r.resumeTwo(t, ctx, mp, spec, snap, copyID, &hostEnv)
	for i, e2 := range eps {
		cf := e2.Clock()
		in, err := mp.GuestInfo(ctx, e2.SandboxID())
		if err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			// Continuous: the wall clock moved as much as uptime did, to
			// within 50 ms, and never went back past the pause.
			jump := (in.Wall - st.PauseWall) - (in.Uptime - st.PauseUptime)
			if jump > 0.05 || jump < -0.05 || in.Wall < st.PauseWall || cf.After < st.PauseWall || cf.Policy != episode.ClockContinuous {
				t.Fatalf("%s: the guest's wall clock jumped %.3fs across the restore (clock fix %+v)", e2.ID(), jump, cf)
			}
			// ... so it lags the host's by the time the guest was saved.
			if lag := float64(time.Now().UnixNano())/1e9 - in.Wall; lag < 3 {
				t.Fatalf("%s: the continuous guest clock lags the host's by %.3fs only, after 5s outside the guest", e2.ID(), lag)
			}
			continue
		}
		// Host: the guest's wall clock is the host's.
		if d := in.Wall - float64(time.Now().UnixNano())/1e9; d > 2 || d < -2 || cf.Policy != episode.ClockHost {
			t.Fatalf("%s: the guest's wall clock is %.3fs off the host's under the host policy (clock fix %+v)", e2.ID(), d, cf)
		}
	}
	for _, e2 := range eps {
		r.finishResumed(t, ctx, e2, 2)
	}
	// The two ledgers are separate files.
	a, _ := ledger.Path(ledger.Dir(r.gw.Ledgers()), id)
	b, _ := ledger.Path(ledger.Dir(r.gw.Ledgers()), copyID)
	if filepath.Clean(a) == filepath.Clean(b) {
		t.Fatal("one ledger for both copies")
	}
}

// heldSnapshot starts spec's episode, hold-pauses it while its call-th
// model call is held at the gateway, snapshots it with its processes,
// checks what the pause recorded (hold, processes kept, call-1 calls
// delivered), and crashes it: its VM is gone, its held call dies with it.
// The snapshot is deleted when the test ends.
func (r *rig) heldSnapshot(t *testing.T, ctx context.Context, mp *microvm.Provider, spec episode.Spec, call int) episode.Snapshot {
	t.Helper()
	g := r.gate(spec.ID, call)
	t.Cleanup(g.Release)
	e, crash := r.startToGate(t, ctx, spec, g)
	snap, err := e.PauseAndSnapshot(ctx, 1, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = mp.DeleteSnapshot(context.Background(), snap.ID) })
	st := snap.State
	if st.PauseMode != supervisor.ModeHold || !st.KeepsProcesses || st.RelayDelivered == nil || *st.RelayDelivered != int64(call-1) {
		t.Fatalf("pause state: %+v", st)
	}
	crash()
	return snap
}

// resumeTwo forks snap twice: spec's episode resumes in place in the
// first fork, and a copy named copyID, under copyEnv, in the second. Both
// are closed when the test ends.
func (r *rig) resumeTwo(t *testing.T, ctx context.Context, mp *microvm.Provider, spec episode.Spec, snap episode.Snapshot, copyID string, copyEnv *episode.Env) []*episode.Episode {
	t.Helper()
	forks, err := mp.Fork(ctx, snap.ID, 2, episode.ForkSpec(spec))
	if err != nil {
		t.Fatal(err)
	}
	var eps []*episode.Episode
	for i, f := range forks {
		var e2 *episode.Episode
		if i == 0 {
			e2, err = episode.ResumeInPlace(ctx, r.env, spec, f.ID, snap.State)
		} else {
			e2, err = episode.ResumeCopy(ctx, copyEnv, spec, f.ID, snap.State, copyID)
		}
		if err != nil {
			for _, f := range forks[i:] {
				_ = mp.Delete(context.Background(), f.ID)
			}
			t.Fatalf("fork %d: %v", i, err)
		}
		eps = append(eps, e2)
		t.Cleanup(func() { _ = e2.Close(context.Background()) })
	}
	return eps
}

// finishResumed runs an episode resumed in place to reward 1 and checks
// its ledger: its first delivered entries are the original's (attempt 0),
// the held call and those after it were made under a later attempt, and
// no entry marks a relaunch boundary.
func (r *rig) finishResumed(t *testing.T, ctx context.Context, e *episode.Episode, delivered int) {
	t.Helper()
	if v := r.finish(t, ctx, e); v.Reward != 1 {
		t.Fatalf("%s: reward %d: %v %v\n%s", e.ID(), v.Reward, v.FailToPass, v.PassToPass, v.Output)
	}
	if e.Attempt() < 1 {
		t.Fatalf("%s: attempt %d after a restore", e.ID(), e.Attempt())
	}
	hist, err := ledger.ReadIn(r.gw.Ledgers(), e.ID())
	if err != nil {
		t.Fatal(err)
	}
	if len(hist.Entries) <= delivered {
		t.Fatalf("%s: %d ledger entries", e.ID(), len(hist.Entries))
	}
	for i, en := range hist.Entries {
		if i < delivered && en.Attempt != 0 {
			t.Fatalf("%s: entry %d attempt %d, want the original's 0", e.ID(), i+1, en.Attempt)
		}
		if i >= delivered && en.Attempt < 1 {
			t.Fatalf("%s: entry %d attempt %d after the restore", e.ID(), i+1, en.Attempt)
		}
		if en.Boundary {
			t.Fatalf("%s: entry %d marks a relaunch boundary, but the episode resumed in place", e.ID(), i+1)
		}
	}
}

// Each pause mode on a provider whose snapshots keep processes: stop (the
// memory snapshot holds a stopped tree, woken by SIGCONT), hold (nothing
// signalled), hold+freeze (the tree frozen by the guest's cgroup v2
// freezer, thawed by the continue after the restore). Each restore resumes
// in place: the relay re-issues the call it had not delivered, and the
// episode finishes with reward 1 without a relaunch. The pause and
// continue acknowledgements carry the mode, the supervisor's identity, and
// the guest's wall clock and uptime.
func TestMicroVMPauseModesResumeInPlace(t *testing.T) {
	r, mp := newMicroVMRig(t)
	tk, err := task.Lookup(r.tasks, "sh-renext-spaces")
	if err != nil {
		t.Fatal(err)
	}
	for _, mode := range []supervisor.Mode{supervisor.ModeStop, supervisor.ModeHold, supervisor.ModeHoldFreeze} {
		t.Run(string(mode), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
			defer cancel()
			id := "vm-" + strings.ReplaceAll(string(mode), "+", "-")
			g := r.gate(id, 3)
			defer g.Release()
			spec := episode.Spec{ID: id, Task: tk, Harness: adapter(t, "mini"), PauseMode: mode}
			e, crash := r.startToGate(t, ctx, spec, g)
			before := time.Now()
			snap, err := e.PauseAndSnapshot(ctx, 1, false)
			if err != nil {
				t.Fatal(err)
			}
			defer mp.DeleteSnapshot(context.Background(), snap.ID)
			st := snap.State
			if st.PauseMode != mode || !st.PauseConfirmed || !st.KeepsProcesses || st.RelayDelivered == nil || *st.RelayDelivered != 2 {
				t.Fatalf("pause state: %+v", st)
			}
			if st.PauseFrozen != (mode == supervisor.ModeHoldFreeze) {
				t.Fatalf("pause state frozen %v in mode %s", st.PauseFrozen, mode)
			}
			checkAck := func(a supervisor.Ack, op string) {
				t.Helper()
				wall := time.Unix(0, int64(a.Wall*1e9))
				if a.Op != op || a.Seq != 1 || a.Mode != mode || a.Identity != st.Identity || a.Identity.PID <= 0 || a.Identity.StartTime == 0 ||
					a.Uptime <= 0 || wall.Before(before.Add(-5*time.Second)) || wall.After(time.Now().Add(5*time.Second)) || !a.Confirmed {
					t.Errorf("%s acknowledgement %+v (identity at the pause %v, host time %s)", op, a, st.Identity, before.Format(time.RFC3339Nano))
				}
			}
			crash()
			forks, err := mp.Fork(ctx, snap.ID, 1, episode.ForkSpec(spec))
			if err != nil {
				t.Fatal(err)
			}
			e2, err := episode.ResumeInPlace(ctx, r.env, spec, forks[0].ID, st)
			if err != nil {
				_ = mp.Delete(context.Background(), forks[0].ID)
				t.Fatal(err)
			}
			defer e2.Close(context.Background())
			// A hold's acknowledgement file is written just after its
			// reply, and before the next request is answered: ask for the
			// status first, then read the files.
			stt, err := e2.Status(ctx)
			if err != nil || stt.Frozen {
				t.Errorf("status after the continue: %+v %v", stt, err)
			}
			var pa, ca supervisor.Ack
			for name, into := range map[string]*supervisor.Ack{"1.pause.json": &pa, "1.continue.json": &ca} {
				b, err := mp.ReadFile(ctx, forks[0].ID, "/tmp/stasis/"+id+"/acks/"+name)
				if err != nil {
					t.Fatal(err)
				}
				if err := json.Unmarshal(b, into); err != nil {
					t.Fatalf("%s: %v", name, err)
				}
			}
			checkAck(pa, supervisor.OpPause)
			checkAck(ca, supervisor.OpContinue)
			if pa.Frozen != (mode == supervisor.ModeHoldFreeze) || ca.Frozen || ca.Relaunched == nil || *ca.Relaunched {
				t.Errorf("frozen %v at the pause, %v at the continue; relaunched %v", pa.Frozen, ca.Frozen, ca.Relaunched)
			}
			if ca.Uptime <= pa.Uptime || ca.Wall < pa.Wall {
				t.Errorf("the continue (wall %.3f, uptime %.3f) is not after the pause (%.3f, %.3f)", ca.Wall, ca.Uptime, pa.Wall, pa.Uptime)
			}
			if v := r.finish(t, ctx, e2); v.Reward != 1 {
				t.Fatalf("reward %d: %v %v\n%s", v.Reward, v.FailToPass, v.PassToPass, v.Output)
			}
			hist, err := ledger.ReadIn(r.gw.Ledgers(), id)
			if err != nil {
				t.Fatal(err)
			}
			for i, en := range hist.Entries {
				if en.Boundary {
					t.Fatalf("entry %d marks a relaunch boundary, but the episode resumed in place", i+1)
				}
			}
		})
	}
}

// OpenCode in a microVM guest on the test image is hold-paused while its
// third model call is held at the gateway, snapshotted with its processes,
// and branched into two from that one snapshot: the episode itself resumes
// in place in one fork, a copy under its own name in the other. Both are
// the recorded launch (no relaunch), both finish with reward 1, and each
// ledger verifies on its own: the first two entries are the original's,
// the held call is made afresh under the new attempt, and no entry marks a
// relaunch boundary.
func TestMicroVMOpenCodeForkOfTwoResumesInPlace(t *testing.T) {
	r, mp := newOpenCodeMicroVMRig(t)
	tk, err := task.Lookup(r.tasks, "py-ini-value-with-equals")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	spec := episode.Spec{ID: "oc-vm", Task: tk, Harness: adapter(t, "opencode")}
	snap := r.heldSnapshot(t, ctx, mp, spec, 3)
	for _, e2 := range r.resumeTwo(t, ctx, mp, spec, snap, spec.ID+"-b1", r.env) {
		r.finishResumed(t, ctx, e2, 2)
	}
}

// BenchmarkMicroVMOpenCodeResume measures what resuming OpenCode in place
// saves against relaunching it. One OpenCode episode on the test image is
// hold-paused while its third model call is held and snapshotted with its
// processes (the snapshot's seconds and stored bytes are reported). Then,
// per iteration, two copies are restored from that snapshot, alternately:
//
//   - in_place: fork, then ResumeCopy (the relay re-issues the held call);
//   - relaunch: fork, every process of the harness and the supervisor
//     killed with SIGKILL (what a file-only snapshot leaves: the files),
//     then RelaunchCopy (a new supervisor, OpenCode started on its saved
//     session, its history matched against the ledger).
//
// Each figure is from the start of the fork to the copy's next model call
// at the gateway (*_s), and from the end of the fork (*_after_fork_s);
// the kill is not counted. relaunch/in_place is the ratio of the totals.
//
//	go test ./episode -run '^$' -bench MicroVMOpenCodeResume -benchtime 3x -timeout 60m
func BenchmarkMicroVMOpenCodeResume(b *testing.B) {
	r, mp := newOpenCodeMicroVMRig(b)
	tk, err := task.Lookup(r.tasks, "py-ini-value-with-equals")
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Minute)
	defer cancel()
	id := "oc-bench"
	g := r.gate(id, 3)
	defer g.Release()
	spec := episode.Spec{ID: id, Task: tk, Harness: adapter(b, "opencode")}
	e, crash := r.startToGate(b, ctx, spec, g)
	snap, err := e.PauseAndSnapshot(ctx, 1, false)
	if err != nil {
		b.Fatal(err)
	}
	defer mp.DeleteSnapshot(context.Background(), snap.ID)
	info, err := mp.GetSnapshot(ctx, snap.ID)
	if err != nil {
		b.Fatal(err)
	}
	st := snap.State
	crash()

	// next is told of each copy's first call after its restore.
	var mu sync.Mutex
	next := map[string]chan struct{}{}
	seen := func(ep, _, attempt string) {
		mu.Lock()
		defer mu.Unlock()
		if c, ok := next[ep]; ok && attempt != "0" {
			close(c)
			delete(next, ep)
		}
	}
	r.seen.Store(&seen)
	restore := func(name string, inPlace bool) (total, afterFork time.Duration) {
		b.Helper()
		c := make(chan struct{})
		mu.Lock()
		next[name] = c
		mu.Unlock()
		t0 := time.Now()
		forks, err := mp.Fork(ctx, snap.ID, 1, episode.ForkSpec(spec))
		if err != nil {
			b.Fatal(err)
		}
		forkDur := time.Since(t0)
		var e2 *episode.Episode
		t1 := time.Now()
		if inPlace {
			e2, err = episode.ResumeCopy(ctx, r.env, spec, forks[0].ID, st, name)
		} else {
			// Leave the files only: the harness's processes (the agent's
			// user), then the supervisor and its relay.
			kill := func(u sandbox.User, argv ...string) {
				var out strings.Builder
				res, err := mp.Exec(ctx, forks[0].ID, sandbox.ExecRequest{Argv: argv, User: u, Stdout: &out, Stderr: &out, Timeout: time.Minute})
				if err != nil || res.ExitCode != 0 {
					_ = mp.Delete(context.Background(), forks[0].ID)
					b.Fatalf("%v: exit %d, %v: %s", argv, res.ExitCode, err, out.String())
				}
			}
			kill(sandbox.UserAgent, "sh", "-c", "kill -9 -1; true")
			kill(sandbox.UserControl, "sh", "-c", "kill -9 "+strconv.Itoa(st.Identity.PID))
			t1 = time.Now() // the kill is not counted
			e2, err = episode.RelaunchCopy(ctx, r.env, spec, forks[0].ID, st.HarnessSession, st.LedgerAt(), name)
		}
		if err != nil {
			_ = mp.Delete(context.Background(), forks[0].ID)
			b.Fatalf("%s: %v", name, err)
		}
		defer e2.Close(context.Background())
		select {
		case <-c:
		case <-ctx.Done():
			r.dump(b, e2)
			b.Fatalf("%s: no model call after the restore", name)
		}
		afterFork = time.Since(t1)
		return forkDur + afterFork, afterFork
	}
	var in, rl, inAfter, rlAfter time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		d, a := restore(fmt.Sprintf("%s-p%d", id, i), true)
		in, inAfter = in+d, inAfter+a
		d, a = restore(fmt.Sprintf("%s-r%d", id, i), false)
		rl, rlAfter = rl+d, rlAfter+a
	}
	b.StopTimer()
	n := float64(b.N)
	b.ReportMetric(in.Seconds()/n, "in_place_s")
	b.ReportMetric(inAfter.Seconds()/n, "in_place_after_fork_s")
	b.ReportMetric(rl.Seconds()/n, "relaunch_s")
	b.ReportMetric(rlAfter.Seconds()/n, "relaunch_after_fork_s")
	b.ReportMetric(rl.Seconds()/in.Seconds(), "relaunch/in_place")
	b.ReportMetric((snap.Pause + snap.Took).Seconds(), "snapshot_s")
	b.ReportMetric(float64(info.Bytes)/(1<<20), "snapshot_MiB")
	b.ReportMetric(float64(info.NewBytes)/(1<<20), "snapshot_stored_MiB")
}
