package task_test

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"stasis/internal/control/task"
	"stasis/internal/providers/local"
	"stasis/internal/stasistest"
	"stasis/internal/storage/store"
	"stasis/sandbox"
)

func TestMain(m *testing.M) { stasistest.Main(m) }

func newProvider(t *testing.T) *local.Provider {
	t.Helper()
	p, err := local.New(local.Options{Home: t.TempDir(), Exe: stasistest.Exe(), ExeEnv: stasistest.Env})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// sandboxFor makes a sandbox seeded with the task's work tree; the test
// deletes it.
func sandboxFor(t *testing.T, p sandbox.Provider, tk *task.Task) string {
	t.Helper()
	tree := t.TempDir()
	if err := tk.Materialize(tree); err != nil {
		t.Fatal(err)
	}
	info, err := p.Create(context.Background(), sandbox.Spec{Root: tree, Env: tk.EnvMap(), Expiry: time.Now().Add(30 * time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.Delete(context.Background(), info.ID); err != nil {
			t.Error(err)
		}
	})
	return info.ID
}

func TestBuiltinSet(t *testing.T) {
	ts, err := task.Builtin()
	if err != nil {
		t.Fatal(err)
	}
	if len(ts) < 12 {
		t.Fatalf("%d built-in tasks, want at least 12", len(ts))
	}
	langs := map[string]int{}
	for _, tk := range ts {
		langs[tk.Language]++
		if tk.Solution == nil || len(tk.Solution.Files) == 0 {
			t.Errorf("%s: no reference solution", tk.ID)
		}
		if len(tk.PassToPass) == 0 {
			t.Errorf("%s: no PASS_TO_PASS tests", tk.ID)
		}
		for p := range tk.Solution.Files {
			if strings.Contains(p, "test") {
				t.Errorf("%s: the solution changes %s, a test file", tk.ID, p)
			}
		}
	}
	for _, l := range []string{"go", "python", "javascript", "shell"} {
		if langs[l] == 0 {
			t.Errorf("no built-in task in %s", l)
		}
	}
	if _, err := task.Scripts(ts); err != nil {
		t.Fatal(err)
	}
	if _, err := task.Lookup(ts, "no-such-task"); err == nil || !strings.Contains(err.Error(), ts[0].ID) {
		t.Fatalf("Lookup of an unknown id: %v", err)
	}
}

// Every built-in task: its FAIL_TO_PASS tests fail and its PASS_TO_PASS
// tests pass on the original tree (reward 0), and every test passes with
// the reference solution (reward 1), run in a local sandbox as verify runs
// them.
func TestBuiltinTasksFailThenPass(t *testing.T) {
	ts, err := task.Builtin()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { stasistest.NoChildrenLeft(t) }) // after the sandboxes' cleanups
	p := newProvider(t)
	sem := make(chan struct{}, 3)
	var wg sync.WaitGroup
	for _, tk := range ts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			checkTask(t, p, tk)
		}()
	}
	wg.Wait()
}

func checkTask(t *testing.T, p sandbox.Provider, tk *task.Task) {
	ctx := context.Background()
	id := sandboxFor(t, p, tk)
	before, err := task.RunTests(ctx, p, id, tk)
	if err != nil {
		t.Errorf("%s: %v", tk.ID, err)
		return
	}
	if before.Reward != 0 {
		t.Errorf("%s: reward %d on the original tree, want 0", tk.ID, before.Reward)
	}
	for n, o := range before.FailToPass {
		if o != task.Failed {
			t.Errorf("%s: FAIL_TO_PASS %q is %s on the original tree, want failed\n%s", tk.ID, n, o, before.Output)
		}
	}
	for n, o := range before.PassToPass {
		if o != task.Passed {
			t.Errorf("%s: PASS_TO_PASS %q is %s on the original tree, want passed\n%s", tk.ID, n, o, before.Output)
		}
	}
	for path, b := range tk.Solution.Files {
		if err := p.WriteFile(ctx, id, filepath.Join(task.WorkDir, path), b, 0o644); err != nil {
			t.Errorf("%s: %v", tk.ID, err)
			return
		}
	}
	after, err := task.RunTests(ctx, p, id, tk)
	if err != nil {
		t.Errorf("%s: %v", tk.ID, err)
		return
	}
	if after.Reward != 1 || after.ExitCode != 0 {
		t.Errorf("%s: with the reference solution reward %d, exit %d, want 1 and 0: %v %v\n%s", tk.ID, after.Reward, after.ExitCode, after.FailToPass, after.PassToPass, after.Output)
	}
	t.Logf("%s: tests took %.1fs before and %.1fs after the fix", tk.ID, before.DurationS, after.DurationS)
}

// countingTask's test command counts its runs in a file outside the work
// tree and reports one passing test.
func countingTask(t *testing.T) *task.Task {
	t.Helper()
	tk, err := task.ParseDefinition([]byte(`{"id":"count","statement":"count the runs","test_cmd":"echo run >> /tmp/runs; echo 'PASS: t1'; echo 'FAIL: t2'","parser":"lines","fail_to_pass":["t1"],"pass_to_pass":["t2"]}`))
	if err != nil {
		t.Fatal(err)
	}
	tk.Source = task.Source{Kind: "func", Make: func(dst string) error { return os.WriteFile(filepath.Join(dst, "README"), []byte("x\n"), 0o644) }}
	return tk
}

func runs(t *testing.T, p sandbox.Provider, id string) int {
	t.Helper()
	b, err := p.ReadFile(context.Background(), id, "/tmp/runs")
	if err != nil {
		return 0
	}
	return strings.Count(string(b), "run\n")
}

// Capture once: the first verify runs the tests and records the verdict;
// later ones, concurrent, or from a new verifier on the reopened store (a
// server relaunch), return it without running anything.
func TestVerifyCapturesOnce(t *testing.T) {
	ctx := context.Background()
	t.Cleanup(func() { stasistest.NoChildrenLeft(t) })
	p := newProvider(t)
	tk := countingTask(t)
	id := sandboxFor(t, p, tk)
	dbPath := filepath.Join(t.TempDir(), "store.db")
	st, err := store.OpenSQLite(dbPath)
	if err != nil {
		t.Fatal(err)
	}
	v := &task.Verifier{Store: st, Provider: p}

	// Not ended: refused, nothing recorded, nothing run.
	notYet := func(context.Context) error { return os.ErrDeadlineExceeded }
	if _, _, err := v.Verify(ctx, "ep-1", 0, id, tk, notYet); err == nil || !strings.Contains(err.Error(), "has not ended") {
		t.Fatalf("verify before the end: %v", err)
	}
	if n := runs(t, p, id); n != 0 {
		t.Fatalf("tests ran %d times before the harness ended", n)
	}

	var wg sync.WaitGroup
	got := make([]task.Verdict, 4)
	recorded := make([]bool, 4)
	for i := range got {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var err error
			got[i], recorded[i], err = v.Verify(ctx, "ep-1", 0, id, tk, nil)
			if err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if n := runs(t, p, id); n != 1 {
		t.Fatalf("four concurrent verifies ran the tests %d times, want 1", n)
	}
	fresh := 0
	for i := range got {
		if !recorded[i] {
			fresh++
		}
		if got[i].Started != got[0].Started || got[i].Reward != 0 || got[i].FailToPass["t1"] != task.Passed || got[i].PassToPass["t2"] != task.Failed {
			t.Fatalf("verdict %d: %+v", i, got[i])
		}
	}
	if fresh != 1 {
		t.Fatalf("%d verifies reported a fresh run, want 1", fresh)
	}
	if !strings.Contains(got[0].Output, "PASS: t1") {
		t.Fatalf("the output is not kept: %q", got[0].Output)
	}

	// A relaunched server: a new verifier on the reopened store.
	if err := st.Close(); err != nil {
		t.Fatal(err)
	}
	st2, err := store.OpenSQLite(dbPath)
	if err != nil {
		t.Fatal(err)
	}
	defer st2.Close()
	v2 := &task.Verifier{Store: st2, Provider: p}
	again, rec, err := v2.Verify(ctx, "ep-1", 0, id, tk, notYet)
	if err != nil || !rec || !again.Started.Equal(got[0].Started) {
		t.Fatalf("verify after a relaunch: %+v recorded=%v %v", again, rec, err)
	}
	if n := runs(t, p, id); n != 1 {
		t.Fatalf("the tests ran %d times in all, want 1", n)
	}
	// A restore starts attempt 1: it is verified afresh, in its own
	// sandbox state, and attempt 0's verdict stays as it was.
	a1, rec, err := v2.Verify(ctx, "ep-1", 1, id, tk, nil)
	if err != nil || rec || a1.Attempt != 1 || a1.Started.Equal(got[0].Started) {
		t.Fatalf("verify of attempt 1: %+v recorded=%v %v", a1, rec, err)
	}
	if n := runs(t, p, id); n != 2 {
		t.Fatalf("the tests ran %d times in all after attempt 1's verify, want 2", n)
	}
	if a0, ok, err := v2.Recorded(ctx, "ep-1", 0); err != nil || !ok || !a0.Started.Equal(got[0].Started) || a0.Attempt != 0 {
		t.Fatalf("attempt 0's verdict after attempt 1's: %+v %v %v", a0, ok, err)
	}
	// A verdict survives its sandbox.
	if err := p.Delete(ctx, id); err != nil {
		t.Fatal(err)
	}
	if _, rec, err := v2.Verify(ctx, "ep-1", 0, id, tk, nil); err != nil || !rec {
		t.Fatalf("verify after the sandbox is gone: %v %v", rec, err)
	}
	// Another episode in a sandbox that is gone: an error, nothing recorded.
	if _, _, err := v2.Verify(ctx, "ep-2", 0, id, tk, nil); err == nil {
		t.Fatal("verify in a deleted sandbox succeeded")
	}
	if _, ok, _ := v2.Recorded(ctx, "ep-2", 0); ok {
		t.Fatal("a failed verify recorded a verdict")
	}
	stasistest.NoChildrenLeft(t)
}

func TestParsers(t *testing.T) {
	for _, c := range []struct {
		parser, out string
		want        map[string]string
	}{
		{"gotest", "=== RUN   TestA\n--- PASS: TestA (0.00s)\n=== RUN   TestB\n    x_test.go:9: boom\n--- FAIL: TestB (0.01s)\n    --- PASS: TestB/sub (0.00s)\n--- SKIP: TestC (0.00s)\nFAIL\n",
			map[string]string{"TestA": task.Passed, "TestB": task.Failed, "TestB/sub": task.Passed, "TestC": task.Skipped}},
		{"unittest", "test_a (test_m.T.test_a) ... ok\ntest_b (test_m.T.test_b) ... FAIL\ntest_c (test_m.T) ... ERROR\ntest_d (test_m.T.test_d)\nA docstring ... ok\ntest_e (test_m.T.test_e) ... skipped 'why'\n\n======\nFAIL: test_b (test_m.T.test_b)\n",
			map[string]string{"test_m.T.test_a": task.Passed, "test_m.T.test_b": task.Failed, "test_m.T.test_c": task.Failed, "test_m.T.test_d": task.Passed, "test_m.T.test_e": task.Skipped}},
		{"pytest", "PASSED tests/test_x.py::test_a\nFAILED tests/test_x.py::test_b - AssertionError\nERROR tests/test_x.py::test_c\nSKIPPED [1] tests/test_x.py:3: why\n",
			map[string]string{"tests/test_x.py::test_a": task.Passed, "tests/test_x.py::test_b": task.Failed, "tests/test_x.py::test_c": task.Failed}},
		{"tap", "TAP version 13\n# Subtest: a\nok 1 - a\n  ---\n  ...\nnot ok 2 - b c\nok 3 - d # SKIP later\n    ok 1 - nested\n1..3\n# pass 1\n",
			map[string]string{"a": task.Passed, "b c": task.Failed, "d": task.Skipped, "nested": task.Passed}},
		{"lines", "PASS: a\nFAIL: b\nPASS: b\nSKIP: c\nnoise PASS: d\n",
			map[string]string{"a": task.Passed, "b": task.Failed, "c": task.Skipped}},
	} {
		got := task.Parsers[c.parser](c.out)
		if !equal(got, c.want) {
			t.Errorf("%s: got %v, want %v", c.parser, got, c.want)
		}
	}
}

func equal(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

func TestEvaluate(t *testing.T) {
	tk := &task.Task{Parser: "lines", FailToPass: []string{"f"}, PassToPass: []string{"p", "q"}}
	for _, c := range []struct {
		out    string
		reward int
	}{
		{"PASS: f\nPASS: p\nPASS: q\n", 1},
		{"PASS: f\nPASS: p\nSKIP: q\n", 1}, // a skipped PASS_TO_PASS did not break
		{"PASS: f\nPASS: p\n", 0},          // q missing
		{"FAIL: f\nPASS: p\nPASS: q\n", 0},
		{"SKIP: f\nPASS: p\nPASS: q\n", 0},
		{"PASS: f\nFAIL: p\nPASS: q\n", 0},
		{"", 0},
	} {
		if r, _, _ := tk.Evaluate(c.out); r != c.reward {
			t.Errorf("%q: reward %d, want %d", c.out, r, c.reward)
		}
	}
}

func TestParseDefinitionRefusesBadTasks(t *testing.T) {
	for _, c := range []struct{ doc, want string }{
		{`{`, "task.json"},
		{`{"id":"a","statement":"s","test_cmd":"t","parser":"lines","fail_to_pass":["x"],"typo":1}`, "unknown field"},
		{`{"id":"../a","statement":"s","test_cmd":"t","parser":"lines","fail_to_pass":["x"]}`, "id"},
		{`{"id":"a","statement":"","test_cmd":"t","parser":"lines","fail_to_pass":["x"]}`, "statement is empty"},
		{`{"id":"a","statement":"s","test_cmd":"t","parser":"junit","fail_to_pass":["x"]}`, "parser \"junit\""},
		{`{"id":"a","statement":"s","test_cmd":"t","parser":"lines","fail_to_pass":[]}`, "fail_to_pass is empty"},
		{`{"id":"a","statement":"s","test_cmd":"t","parser":"lines","fail_to_pass":["x"],"pass_to_pass":["x"]}`, "listed twice"},
	} {
		if _, err := task.ParseDefinition([]byte(c.doc)); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error with %q", c.doc, err, c.want)
		}
	}
}

// The scripted model's play of a task reads each changed file, writes it,
// runs the tests and answers, with OpenCode's tool names as alternatives.
func TestScript(t *testing.T) {
	ts, _ := task.Builtin()
	tk := ts[0]
	s, err := tk.Script()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(tk.Prompt(), s.Match) {
		t.Fatal("the prompt does not contain the script's match")
	}
	var names []string
	for _, turn := range s.Turns {
		for _, c := range turn.ToolCalls {
			names = append(names, c.Name+"|"+c.Alternatives[0].Name)
		}
	}
	last := s.Turns[len(s.Turns)-1]
	if len(last.ToolCalls) != 0 || last.Content == "" {
		t.Fatalf("the last turn is not an answer: %+v", last)
	}
	want := []string{"run|bash"}
	for range tk.Solution.Files {
		want = append(want, "read_file|read")
	}
	for range tk.Solution.Files {
		want = append(want, "write_file|write")
	}
	want = append(want, "run|bash")
	if strings.Join(names, " ") != strings.Join(want, " ") {
		t.Fatalf("calls %v, want %v", names, want)
	}
	var args map[string]any
	_ = json.Unmarshal(s.Turns[len(s.Turns)-2].ToolCalls[0].Arguments, &args)
	if args["command"] != tk.TestCmd {
		t.Fatalf("the test turn runs %v", args)
	}
	if _, err := (&task.Task{ID: "x"}).Script(); err == nil {
		t.Fatal("a task without a solution has a script")
	}
	ids := make([]string, len(ts))
	for i, x := range ts {
		ids[i] = x.ID
	}
	if !sort.StringsAreSorted(ids) {
		t.Fatalf("Builtin is not sorted: %v", ids)
	}
}

// A work tree from a tarball (gzip'd or not) or a git bundle; a tarball
// entry that would land outside the tree is refused.
func TestSources(t *testing.T) {
	src := t.TempDir()
	if err := os.MkdirAll(filepath.Join(src, "pkg"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(src, "pkg", "a.txt"), []byte("a\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(src, "run.sh"), []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	tgz := filepath.Join(dir, "tree.tar.gz")
	tarball := filepath.Join(dir, "tree.tar")
	bundle := filepath.Join(dir, "tree.bundle")
	for _, c := range [][]string{
		{"tar", "-czf", tgz, "-C", src, "."},
		{"tar", "-cf", tarball, "-C", src, "pkg", "run.sh"},
	} {
		if out, err := exec.Command(c[0], c[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%v: %v %s", c, err, out)
		}
	}
	git(t, src, "init", "-q", "-b", "main")
	git(t, src, "add", ".")
	git(t, src, "commit", "-qm", "tree")
	git(t, src, "bundle", "create", bundle, "main")
	for _, s := range []task.Source{{Kind: "tar", Path: tgz}, {Kind: "tar", Path: tarball}, {Kind: "bundle", Path: bundle, Ref: "main"}, {Kind: "dir", Path: src}} {
		tk := &task.Task{ID: "src", Source: s}
		dst := filepath.Join(t.TempDir(), "tree")
		if err := tk.Materialize(dst); err != nil {
			t.Fatalf("%s: %v", s.Kind, err)
		}
		if b, err := os.ReadFile(filepath.Join(dst, "pkg", "a.txt")); err != nil || string(b) != "a\n" {
			t.Fatalf("%s: %q %v", s.Kind, b, err)
		}
		if st, err := os.Stat(filepath.Join(dst, "run.sh")); err != nil || st.Mode().Perm()&0o100 == 0 {
			t.Fatalf("%s: run.sh lost its exec bit: %v", s.Kind, err)
		}
		if err := tk.Materialize(dst); err == nil || !strings.Contains(err.Error(), "not empty") {
			t.Fatalf("%s: materialize into a full directory: %v", s.Kind, err)
		}
	}
	evil := filepath.Join(dir, "evil.tar")
	if out, err := exec.Command("tar", "-cf", evil, "-C", src, "--transform", "s,^pkg,../escape,", "pkg/a.txt").CombinedOutput(); err != nil {
		t.Fatalf("%v %s", err, out)
	}
	dst := filepath.Join(t.TempDir(), "tree")
	if err := (&task.Task{ID: "evil", Source: task.Source{Kind: "tar", Path: evil}}).Materialize(dst); err == nil || !strings.Contains(err.Error(), "outside the work tree") {
		t.Fatalf("a tarball escaping its tree: %v", err)
	}
	if _, err := os.Stat(filepath.Join(filepath.Dir(dst), "escape")); err == nil {
		t.Fatal("the escaping entry was written")
	}
}
