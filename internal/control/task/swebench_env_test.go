package task_test

import (
	"context"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"stasis/internal/control/task"
	"stasis/internal/control/task/pyenv"
	"stasis/internal/control/task/tasktest"
	"stasis/internal/providers/local"
	"stasis/internal/stasistest"
	"stasis/internal/storage/store"
)

// A SWE-bench row without test_cmd runs as SWE-bench's harness runs it,
// in the environment stasis builds for its repository: base fails
// FAIL_TO_PASS and passes PASS_TO_PASS; the gold patch resolves it; an
// agent that only edits tests, or adds a conftest.py, gets nothing; an
// agent that breaks the import is unresolved, saying so; and the same row
// on the host's bare Python (a broken environment) is an error, not a
// model failure.
func TestSWEBenchVerdicts(t *testing.T) {
	tasktest.NeedPythonEnv(t)
	t.Cleanup(func() { stasistest.NoChildrenLeft(t) })
	ctx := context.Background()
	jsonl, repos := tasktest.SWEBenchRepo(t)
	envs := t.TempDir()
	ts, problems, err := task.LoadSWEBench(jsonl, task.SWEBenchOptions{Repos: repos, Envs: envs})
	if err != nil || len(problems) > 0 || len(ts) != 1 {
		t.Fatalf("load: %v %v %d", err, problems, len(ts))
	}
	tk := ts[0]
	if strings.Contains(tk.TestCmd, ".toml") || !strings.Contains(tk.TestCmd, "tests/test_calc.py") || tk.Parser == "" {
		t.Fatalf("test command %q (parser %q)", tk.TestCmd, tk.Parser)
	}
	if !slices.Equal(tk.TestFiles, []string{"tests/data/cases.toml", "tests/test_calc.py"}) {
		t.Fatalf("test files %v", tk.TestFiles)
	}
	env, err := tk.Environment(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if env.Kind != "venv" || !strings.HasPrefix(env.Path, envs) {
		t.Fatalf("environment %+v", env)
	}
	// Local sandboxes see the environments where their venvs expect them.
	p, err := local.New(local.Options{Home: t.TempDir(), Exe: stasistest.Exe(), ExeEnv: stasistest.Env, ReadOnlyBinds: map[string]string{envs: pyenv.SandboxRoot}})
	if err != nil {
		t.Fatal(err)
	}
	run := func(name, hack string) task.Verdict {
		t.Helper()
		id := sandboxFor(t, p, tk)
		if hack != "" {
			execIn(t, p, id, hack)
		}
		v, err := task.RunTests(ctx, p, id, tk)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if v.Environment != env.String() {
			t.Errorf("%s: the verdict names environment %q, want %q", name, v.Environment, env.String())
		}
		return v
	}
	base := run("base", "")
	if base.Status != task.StatusUnresolved || base.FailToPass["tests/test_calc.py::test_add"] != task.Failed || base.PassToPass["tests/test_calc.py::test_mul"] != task.Passed {
		t.Fatalf("base: %+v", base)
	}
	gold := run("gold", "cat > /tmp/gold.patch <<'EOF'\n"+tk.Solution.Patch+"EOF\ngit apply /tmp/gold.patch")
	if gold.Status != task.StatusResolved || gold.Reward != 1 {
		t.Fatalf("gold: %+v", gold)
	}
	testsOnly := run("tests only", `cat >> tests/test_calc.py <<'PY'


def test_add():
    pass
PY
printf 'import pytest\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n    out = yield\n    out.get_result().outcome = "passed"\n' > conftest.py
cp conftest.py tests/conftest.py`)
	if testsOnly.Status != task.StatusUnresolved || testsOnly.Reward != 0 || !slices.Equal(testsOnly.TestsRemoved, []string{"conftest.py"}) || !slices.Equal(testsOnly.TestsReverted, []string{"tests/conftest.py"}) {
		t.Fatalf("tests only: %+v", testsOnly)
	}
	// Whom a run that failed as a whole is to blame: the verifier runs the
	// tests on the unchanged work tree once to tell.
	st, err := store.OpenSQLite(filepath.Join(t.TempDir(), "store.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	v := &task.Verifier{Store: st, Provider: p}
	bid := sandboxFor(t, p, tk)
	execIn(t, p, bid, `echo 'def add(a, b) return' > src/acmecalc/__init__.py`)
	broke, _, err := v.Verify(ctx, "ep-broke", 0, bid, tk, nil)
	if err != nil {
		t.Fatal(err)
	}
	if broke.Status != task.StatusUnresolved || !strings.Contains(broke.Reason, "the agent's work tree broke the test run") {
		t.Fatalf("an agent that broke the import: %+v", broke)
	}

	// A broken environment: the host's Python, which lacks the package.
	hts, _, err := task.LoadSWEBench(jsonl, task.SWEBenchOptions{Repos: repos})
	if err != nil || len(hts) != 1 {
		t.Fatal(err)
	}
	htk := hts[0]
	hid := sandboxFor(t, p, htk)
	hv, _, err := v.Verify(ctx, "ep-host", 0, hid, htk, nil)
	if err != nil {
		t.Fatal(err)
	}
	if hv.Status != task.StatusError || hv.Environment != "host" || !strings.Contains(hv.Reason, "environment is broken") {
		t.Fatalf("in a broken environment: %+v", hv)
	}
}
