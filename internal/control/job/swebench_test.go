package job_test

import (
	"context"
	"testing"
	"time"

	"stasis/internal/control/job"
	"stasis/internal/control/task"
	"stasis/internal/control/task/tasktest"
	"stasis/internal/stasistest"
)

// stasis run --tasks ROWS.jsonl --repos DIR --crash: a SWE-bench row in
// the datasets' form, in the environment stasis builds for its repository,
// resolved by the scripted model (the row's patch) across a crash and a
// restore, with verified ledgers, per-test results and the environment in
// the report.
func TestRunSWEBenchWithCrash(t *testing.T) {
	tasktest.NeedPythonEnv(t)
	t.Cleanup(func() { stasistest.NoChildrenLeft(t) })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	jsonl, repos := tasktest.SWEBenchRepo(t)
	rep, err := job.Run(ctx, job.Options{
		Tasks: jsonl, Repos: repos, Envs: t.TempDir(), N: 2, Harness: "mini", CheckpointAt: 0.4, Crash: true,
		Exe: stasistest.Exe(), ExeEnv: stasistest.Env, TokenDelay: 3 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Episodes) != 2 || rep.Resolved != 2 || rep.Errors != 0 || rep.Restore == nil {
		t.Fatalf("report: %+v", rep)
	}
	for _, e := range rep.Episodes {
		if !e.LedgerVerified || e.Verdict != task.StatusResolved || e.Task != "acme__calc-7" ||
			e.FailToPass["tests/test_calc.py::test_add"] != task.Passed || e.PassToPass["tests/test_calc.py::test_mul"] != task.Passed ||
			len(e.Environment) < len("venv:") || e.Environment[:5] != "venv:" {
			t.Errorf("episode %+v", e)
		}
	}
}
