package job_test

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"stasis/job"
	"stasis/stasistest"
)

func TestMain(m *testing.M) { stasistest.Main(m) }

// The main job with a crash: every episode is checkpointed mid-way, the
// server and the sandboxes are killed, the restore relaunches the episodes
// that were running, and every one of them is resolved with a ledger that
// verifies. Nothing is left running, and the state directory is removed.
func TestRunWithCrash(t *testing.T) {
	t.Cleanup(func() { stasistest.NoChildrenLeft(t) })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	rep, err := job.Run(ctx, job.Options{
		Tasks: "builtin", N: 4, Harness: "mini", CheckpointAt: 0.4, Crash: true,
		Exe: stasistest.Exe(), ExeEnv: stasistest.Env, TokenDelay: 3 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Episodes) != 4 || rep.Resolved != 4 || rep.Restore == nil || rep.Checkpoint.Episodes != 4 {
		t.Fatalf("report: %+v", rep)
	}
	relaunched := 0
	for _, e := range rep.Episodes {
		if !e.LedgerVerified || e.Reward != 1 || e.ModelCalls < 3 {
			t.Errorf("episode %+v", e)
		}
		if e.Resume == "relaunch" {
			relaunched++
		}
	}
	if relaunched == 0 {
		t.Errorf("no episode was relaunched: the checkpoint fell after every episode ended: %+v", rep.Episodes)
	}
	left, _ := filepath.Glob(filepath.Join(tmp, "stasis-run-*"))
	if len(left) != 0 {
		t.Fatalf("state left behind: %v", left)
	}
	if _, err := job.Run(ctx, job.Options{N: 1, Harness: "claude"}); err == nil {
		t.Fatal("an unknown harness ran")
	}
}
