package job_test

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"stasis/internal/control/job"
	"stasis/internal/sandboxbin"
	"stasis/internal/stasistest"
)

// TestRunWithCrashOnImage: `stasis run --image oci:… --episodes 4 --crash`
// on the local provider: every built-in task resolves in the Debian
// image, with verified ledgers, across the crash and the restore.
func TestRunWithCrashOnImage(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	env := append(append([]string{}, stasistest.Env...), sandboxbin.Env+"="+stasistest.StaticBinary(t))
	rep, err := job.Run(ctx, job.Options{
		Tasks: "builtin", N: 4, Harness: "mini", CheckpointAt: 0.4, Crash: true, Image: stasistest.TestImage(t),
		Exe: stasistest.Exe(), ExeEnv: env, TokenDelay: 3 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Episodes) != 4 || rep.Resolved != 4 || rep.Restore == nil {
		var why []string
		for _, e := range rep.Episodes {
			why = append(why, e.ID+" "+e.Task+": "+e.Verdict+" "+e.Reason)
		}
		t.Fatalf("resolved %d of %d:\n%s", rep.Resolved, len(rep.Episodes), strings.Join(why, "\n"))
	}
	for _, e := range rep.Episodes {
		if !e.LedgerVerified || e.Reward != 1 {
			t.Errorf("episode %+v", e)
		}
	}
	left, _ := filepath.Glob(filepath.Join(tmp, "stasis-run-*"))
	if len(left) != 0 {
		t.Fatalf("state left behind: %v", left)
	}
}

// TestRunWithCrashOnImageMicroVM: the same on the microvm provider with
// mini and OpenCode alternating: the guests' root is the Debian image,
// every built-in task resolves (not only the shell ones the initramfs can
// run), and every episode still running at the checkpoint, OpenCode's
// too, resumes in place after the crash.
func TestRunWithCrashOnImageMicroVM(t *testing.T) {
	// It takes 4 to 7 minutes beside other work; 15 were not enough with
	// two cycle soaks and the random sequences beside `make test`.
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Minute)
	defer cancel()
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	rep, err := job.Run(ctx, job.Options{
		Tasks: "builtin", N: 3, Harness: "mixed", Provider: "microvm", CheckpointAt: 0.4, Crash: true, Image: stasistest.TestImage(t),
		Exe: stasistest.Exe(), ExeEnv: stasistest.Env, GuestBinary: stasistest.StaticBinary(t), TokenDelay: 3 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	langs, harnesses := map[string]bool{}, map[string]bool{}
	var why []string
	for _, e := range rep.Episodes {
		why = append(why, e.ID+" "+e.Task+" "+e.Harness+": "+e.Verdict+" "+e.Reason+" ("+e.Resume+")")
		if !e.LedgerVerified || e.Reward != 1 || e.Provider != "microvm" {
			t.Errorf("episode %+v", e)
		}
		langs[strings.SplitN(e.Task, "-", 2)[0]] = true
		harnesses[e.Harness] = true
		if e.Resume == "relaunch" {
			t.Errorf("%s relaunched on the microVM provider: %s", e.ID, e.ResumeWhy)
		}
		// In place under the continuous policy, the guest's clock did not
		// jump: the step stasis made is under a second.
		if e.Resume == "in_place" && (e.ClockStep == nil || *e.ClockStep > 1 || *e.ClockStep < -1) {
			t.Errorf("%s: clock step %v s after an in-place resume, want under 1 s", e.ID, e.ClockStep)
		}
	}
	if len(rep.Episodes) != 3 || rep.Resolved != 3 || rep.Restore == nil {
		t.Fatalf("resolved %d of %d:\n%s", rep.Resolved, len(rep.Episodes), strings.Join(why, "\n"))
	}
	if len(langs) < 2 {
		t.Errorf("only %v tasks ran: the image should run more than shell tasks", langs)
	}
	if !harnesses["opencode"] || !harnesses["mini"] {
		t.Errorf("harnesses %v: want mini and OpenCode", harnesses)
	}
	t.Logf("%s", strings.Join(why, "\n"))
	left, _ := filepath.Glob(filepath.Join(tmp, "stasis-run-*"))
	if len(left) != 0 {
		t.Fatalf("state left behind: %v", left)
	}
}
