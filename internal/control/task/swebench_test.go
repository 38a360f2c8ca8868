package task_test

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"stasis/internal/control/task"
	"stasis/internal/control/task/tasktest"
	"stasis/internal/stasistest"
	"stasis/sandbox"
)

// git and write are tasktest's, under the names these tests use.
var (
	git   = tasktest.Git
	write = tasktest.Write
)

// swebenchFixture makes a clone directory holding acme__calc (a Python
// repository whose add() is wrong at the base commit) and a JSONL file with
// one good instance and several that cannot load.
func swebenchFixture(t *testing.T) (jsonl, repos string) {
	t.Helper()
	repos = t.TempDir()
	repo := filepath.Join(repos, "acme__calc")
	if err := os.MkdirAll(repo, 0o755); err != nil {
		t.Fatal(err)
	}
	git(t, repo, "init", "-q", "-b", "main")
	write(t, repo, "calc.py", "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n")
	write(t, repo, "test_calc.py", "import unittest\n\nimport calc\n\n\nclass T(unittest.TestCase):\n    def test_mul(self):\n        self.assertEqual(calc.mul(2, 3), 6)\n")
	git(t, repo, "add", ".")
	git(t, repo, "commit", "-qm", "calc")
	base := git(t, repo, "rev-parse", "HEAD")
	// The fix and the test patch, as diffs against base.
	write(t, repo, "calc.py", "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n")
	patch := git(t, repo, "diff") + "\n"
	git(t, repo, "checkout", "-q", "calc.py")
	write(t, repo, "test_calc.py", "import unittest\n\nimport calc\n\n\nclass T(unittest.TestCase):\n    def test_mul(self):\n        self.assertEqual(calc.mul(2, 3), 6)\n\n    def test_add(self):\n        self.assertEqual(calc.add(2, 3), 5)\n")
	testPatch := git(t, repo, "diff") + "\n"
	git(t, repo, "checkout", "-q", "test_calc.py")
	// A later commit, so that base is not HEAD.
	write(t, repo, "NEWS", "later\n")
	git(t, repo, "add", "NEWS")
	git(t, repo, "commit", "-qm", "later")

	line := func(m map[string]any) string {
		b, _ := json.Marshal(m)
		return string(b)
	}
	good := map[string]any{
		"instance_id": "acme__calc-1", "repo": "acme/calc", "base_commit": base,
		"problem_statement": "add(2, 3) returns -1 instead of 5.", "patch": patch, "test_patch": testPatch,
		// As the published dataset has them: strings holding JSON lists.
		"FAIL_TO_PASS": `["test_calc.T.test_add"]`, "PASS_TO_PASS": `["test_calc.T.test_mul"]`,
		"test_cmd": "python3 -m unittest -v", "parser": "unittest",
	}
	noRepo := map[string]any{"instance_id": "other__x-2", "repo": "other/x", "base_commit": base, "problem_statement": "p", "FAIL_TO_PASS": []string{"a"}, "PASS_TO_PASS": []string{}}
	noCommit := map[string]any{"instance_id": "acme__calc-3", "repo": "acme/calc", "base_commit": strings.Repeat("0", 40), "problem_statement": "p", "FAIL_TO_PASS": []string{"a"}, "test_cmd": "true", "parser": "lines"}
	badPatch := map[string]any{"instance_id": "acme__calc-4", "repo": "acme/calc", "base_commit": base, "problem_statement": "p", "test_patch": "--- a/nope.py\n+++ b/nope.py\n@@ -1 +1 @@\n-x\n+y\n", "FAIL_TO_PASS": []string{"a"}, "test_cmd": "true", "parser": "lines"}
	noTests := map[string]any{"instance_id": "acme__calc-5", "repo": "acme/calc", "base_commit": base, "problem_statement": "p", "test_patch": testPatch, "FAIL_TO_PASS": "[]", "test_cmd": "true", "parser": "lines"}
	jsonl = filepath.Join(t.TempDir(), "swe.jsonl")
	content := strings.Join([]string{line(good), line(noRepo), line(noCommit), line(badPatch), line(noTests), `{"instance_id": "broken`, line(good)}, "\n") + "\n"
	write(t, filepath.Dir(jsonl), filepath.Base(jsonl), content)
	return jsonl, repos
}

func TestSWEBenchLoader(t *testing.T) {
	t.Cleanup(func() { stasistest.NoChildrenLeft(t) })
	jsonl, repos := swebenchFixture(t)
	ts, problems, err := task.LoadSWEBench(jsonl, task.SWEBenchOptions{Repos: repos})
	if err != nil {
		t.Fatal(err)
	}
	if len(ts) != 1 || ts[0].ID != "acme__calc-1" {
		t.Fatalf("loaded %d tasks: %+v", len(ts), ts)
	}
	wants := []string{
		"other__x-2: repository other/x is not here",
		"acme__calc-3: the clone",
		"acme__calc-4: test_patch does not apply",
		"acme__calc-5: task acme__calc-5: fail_to_pass is empty",
		":6: not a SWE-bench instance",
		":7: instance acme__calc-1: already loaded from line 1",
	}
	if len(problems) != len(wants) {
		t.Fatalf("problems: %v", problems)
	}
	for i, w := range wants {
		if !strings.Contains(problems[i].Error(), w) {
			t.Errorf("problem %d: %v, want it to say %q", i, problems[i], w)
		}
	}

	// The work tree: base_commit alone, without test_patch and without
	// the history after it. Verify restores the test patch's files; the
	// tests fail there, and pass once the instance's patch is applied
	// (the scripted model's solution).
	tk := ts[0]
	tree := t.TempDir()
	if err := tk.Materialize(tree); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(tree, "NEWS")); err == nil {
		t.Fatal("the work tree is not at base_commit")
	}
	if b, _ := os.ReadFile(filepath.Join(tree, "test_calc.py")); strings.Contains(string(b), "test_add") {
		t.Fatal("test_patch is applied in the agent's work tree")
	}
	if n := git(t, tree, "rev-list", "--all", "--count"); n != "1" {
		t.Fatalf("the work tree's repository holds %s commits, want base_commit alone", n)
	}
	if !slices.Equal(tk.TestFiles, []string{"test_calc.py"}) {
		t.Fatalf("test files %v", tk.TestFiles)
	}
	ctx := context.Background()
	p := newProvider(t)
	id := sandboxFor(t, p, tk)
	v, err := task.RunTests(ctx, p, id, tk)
	if err != nil || v.Reward != 0 || v.Status != task.StatusUnresolved || v.FailToPass["test_calc.T.test_add"] != task.Failed || v.PassToPass["test_calc.T.test_mul"] != task.Passed {
		t.Fatalf("before the fix: %+v %v", v, err)
	}
	s, err := tk.Script()
	if err != nil {
		t.Fatal(err)
	}
	var fix struct {
		Command string `json:"command"`
	}
	_ = json.Unmarshal(s.Turns[1].ToolCalls[0].Arguments, &fix)
	var out strings.Builder
	res, err := p.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"/bin/sh", "-c", fix.Command}, Stdout: &out, Stderr: &out})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("the script's fix: %v exit %d: %s", err, res.ExitCode, out.String())
	}
	if v, err = task.RunTests(ctx, p, id, tk); err != nil || v.Reward != 1 || v.Status != task.StatusResolved {
		t.Fatalf("after the fix: %+v %v", v, err)
	}

	// A missing file and a missing --repos are errors, not problems.
	if _, _, err := task.LoadSWEBench(filepath.Join(repos, "none.jsonl"), task.SWEBenchOptions{Repos: repos}); err == nil {
		t.Fatal("a missing file loaded")
	}
	if _, _, err := task.LoadSWEBench(jsonl, task.SWEBenchOptions{}); err == nil || !strings.Contains(err.Error(), "--repos") {
		t.Fatalf("no repos: %v", err)
	}
}

// A repository kept as a shallow bundle at base_commit (the way SWE-bench
// repositories are kept small) loads, also from a relative --repos, and
// makes the work tree; a bundle with no heads is a clear error.
func TestSWEBenchShallowBundle(t *testing.T) {
	jsonl, repos := tasktest.SWEBenchRepo(t)
	clone := filepath.Join(repos, "acme__calc")
	var row struct {
		BaseCommit string `json:"base_commit"`
	}
	b, err := os.ReadFile(jsonl)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &row); err != nil {
		t.Fatal(err)
	}
	shallow := t.TempDir()
	git(t, shallow, "init", "-q")
	git(t, shallow, "fetch", "-q", "--depth", "1", "file://"+clone, row.BaseCommit)
	bundles := t.TempDir()
	git(t, shallow, "bundle", "create", "-q", filepath.Join(bundles, "acme__calc.bundle"), "FETCH_HEAD")
	if err := os.WriteFile(filepath.Join(bundles, "junk__x.bundle"), []byte("# v2 git bundle\n\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	rel, err := filepath.Rel(wd, bundles)
	if err != nil {
		t.Fatal(err)
	}
	ts, problems, err := task.LoadSWEBench(jsonl, task.SWEBenchOptions{Repos: rel})
	if err != nil || len(problems) != 0 || len(ts) != 1 {
		t.Fatalf("load from a shallow bundle: %v %v %d", err, problems, len(ts))
	}
	tree := t.TempDir()
	if err := ts[0].Materialize(tree); err != nil {
		t.Fatal(err)
	}
	if got := git(t, tree, "rev-parse", "HEAD"); got != row.BaseCommit {
		t.Fatalf("the work tree is at %s, want %s", got, row.BaseCommit)
	}
	// Loaded again: the clone made beside the bundle is reused.
	if _, problems, err := task.LoadSWEBench(jsonl, task.SWEBenchOptions{Repos: bundles}); err != nil || len(problems) != 0 {
		t.Fatalf("second load: %v %v", err, problems)
	}
	if n, _ := filepath.Glob(filepath.Join(bundles, ".stasis-clones", "acme__calc-*")); len(n) != 1 {
		t.Fatalf("clones beside the bundle: %v", n)
	}
	// A broken bundle names itself.
	line := strings.Replace(string(b), `"repo":"acme/calc"`, `"repo":"junk/x"`, 1)
	bad := filepath.Join(t.TempDir(), "bad.jsonl")
	if err := os.WriteFile(bad, []byte(line), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, problems, _ := task.LoadSWEBench(bad, task.SWEBenchOptions{Repos: bundles}); len(problems) != 1 || !strings.Contains(problems[0].Error(), "junk__x.bundle") {
		t.Fatalf("a broken bundle: %v", problems)
	}
}
