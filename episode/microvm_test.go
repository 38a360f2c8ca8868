package episode_test

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"stasis/episode"
	"stasis/harness"
	"stasis/ledger"
	"stasis/sandbox"
	"stasis/sandbox/local"
	"stasis/sandbox/microvm"
	"stasis/stasistest"
	"stasis/supervisor"
	"stasis/task"
)

// newMicroVMRig is the rig on the microVM provider: the guest image holds
// a static stasis at the bound binary's path, and QEMU forwards the
// guest's GatewayAddr to a gateway socket of the guest's own.
func newMicroVMRig(t *testing.T) (*rig, *microvm.Provider) {
	t.Helper()
	if os.Getenv(microvm.KernelEnv) == "" {
		t.Fatalf("%s is not set: run the tests with make (make deps-microvm unpacks the kernel)", microvm.KernelEnv)
	}
	var mp *microvm.Provider
	r := newRigOn(t, func(gwDir, _ string, sockets local.GatewayServer) (sandbox.Provider, string, string) {
		var err error
		mp, err = microvm.New(context.Background(), microvm.Options{
			Home: t.TempDir(), Exe: stasistest.Exe(), ExeEnv: stasistest.Env,
			GuestBinary: stasistest.StaticBinary(t), GatewayDir: gwDir, GatewayServer: sockets,
		})
		if err != nil {
			t.Fatal(err)
		}
		return mp, "http://" + microvm.GatewayAddr, harness.BoundBinaryPath
	})
	return r, mp
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
	g := r.gate(id, 3)
	defer g.Open()
	spec := episode.Spec{ID: id, Task: tk, Harness: adapter(t, "mini")}
	e, crash := r.startToGate(t, ctx, spec, g)
	snap, err := e.PauseAndSnapshot(ctx, 1, false)
	if err != nil {
		t.Fatal(err)
	}
	defer mp.DeleteSnapshot(context.Background(), snap.ID)
	st := snap.State
	if st.PauseMode != supervisor.ModeHold || !st.KeepsProcesses || st.RelayDelivered == nil || *st.RelayDelivered != 2 {
		t.Fatalf("pause state: %+v", st)
	}
	// The crash: the source VM is gone; its held call dies with it.
	crash()

	// Let time pass outside the saved guest, so that the two clock
	// policies give clocks seconds apart (a deliberate gap, not a wait for
	// anything).
	if d := time.Until(time.Unix(0, int64(st.PauseWall*1e9)).Add(5 * time.Second)); d > 0 {
		time.Sleep(d)
	}
	forks, err := mp.Fork(ctx, snap.ID, 2, episode.ForkSpec(spec))
	if err != nil {
		t.Fatal(err)
	}
	copyID := id + "-copy"
	var eps []*episode.Episode
	for i, f := range forks {
		var e2 *episode.Episode
		if i == 0 {
			e2, err = episode.ResumeInPlace(ctx, r.env, spec, f.ID, st)
		} else {
			// The copy under the host clock policy.
			hostEnv := *r.env
			hostEnv.ClockPolicy = episode.ClockHost
			e2, err = episode.ResumeCopy(ctx, &hostEnv, spec, f.ID, st, copyID)
		}
		if err != nil {
			for _, f := range forks {
				_ = mp.Delete(context.Background(), f.ID)
			}
			t.Fatalf("fork %d: %v", i, err)
		}
		eps = append(eps, e2)
		defer e2.Close(context.Background())
	}
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
		if v := r.finish(t, ctx, e2); v.Reward != 1 {
			t.Fatalf("%s: reward %d: %v %v\n%s", e2.ID(), v.Reward, v.FailToPass, v.PassToPass, v.Output)
		}
		if e2.Attempt() < 1 {
			t.Fatalf("%s: attempt %d after a restore", e2.ID(), e2.Attempt())
		}
		hist, err := ledger.Read(r.gw.LedgerDir(), e2.ID())
		if err != nil {
			t.Fatal(err)
		}
		if len(hist.Entries) < 3 {
			t.Fatalf("%s: %d ledger entries", e2.ID(), len(hist.Entries))
		}
		// Entries 1 and 2 are the original's; entry 3 is the held call,
		// made once, under the new attempt.
		for i, en := range hist.Entries {
			if want := 0; i < 2 && en.Attempt != want {
				t.Fatalf("%s: entry %d attempt %d, want %d", e2.ID(), i+1, en.Attempt, want)
			}
			if i >= 2 && en.Attempt < 1 {
				t.Fatalf("%s: entry %d attempt %d after the restore", e2.ID(), i+1, en.Attempt)
			}
			if en.Boundary {
				t.Fatalf("%s: entry %d marks a relaunch boundary, but the episode resumed in place", e2.ID(), i+1)
			}
		}
	}
	// The two ledgers are separate files.
	a, _ := ledger.Path(r.gw.LedgerDir(), id)
	b, _ := ledger.Path(r.gw.LedgerDir(), copyID)
	if filepath.Clean(a) == filepath.Clean(b) {
		t.Fatal("one ledger for both copies")
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
			defer g.Open()
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
			if stt, err := e2.Status(ctx); err != nil || stt.Frozen {
				t.Errorf("status after the continue: %+v %v", stt, err)
			}
			if v := r.finish(t, ctx, e2); v.Reward != 1 {
				t.Fatalf("reward %d: %v %v\n%s", v.Reward, v.FailToPass, v.PassToPass, v.Output)
			}
			hist, err := ledger.Read(r.gw.LedgerDir(), id)
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
