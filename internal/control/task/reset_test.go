package task_test

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"stasis/internal/control/task"
	"stasis/internal/stasistest"
	"stasis/internal/storage/store"
	"stasis/sandbox"
)

// execIn runs a shell command in the sandbox's work tree and fails the
// test unless it exits 0.
func execIn(t *testing.T, p sandbox.Provider, id, script string) string {
	t.Helper()
	var out strings.Builder
	res, err := p.Exec(context.Background(), id, sandbox.ExecRequest{Argv: []string{"/bin/sh", "-c", script}, Cwd: task.WorkDir, Stdout: &out, Stderr: &out})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("%s: %v exit %d: %s", script, err, res.ExitCode, out.String())
	}
	return out.String()
}

// An agent that only edits and adds tests earns nothing on a built-in
// task: verify restores the declared test files and removes the test
// files it added, whatever they report.
func TestTestsOnlyAgentGetsNothing(t *testing.T) {
	t.Cleanup(func() { stasistest.NoChildrenLeft(t) })
	ts, err := task.Builtin()
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	p := newProvider(t)
	for _, c := range []struct {
		id, hack string
	}{
		// The failing tests rewritten to pass, and a sitewide hook that
		// passes everything.
		{"py-money-negative-cents", `cat > test_money.py <<'PY'
import unittest
class TestFormat(unittest.TestCase):
    def test_negative_with_cents(self): pass
    def test_small_negative_amount(self): pass
    def test_positive_amounts(self): pass
    def test_other_currencies(self): pass
    def test_negative_whole_amounts(self): pass
class TestParse(unittest.TestCase):
    def test_parse_amounts(self): pass
PY
mkdir -p sub && printf 'def test_x():\n    pass\n' > sub/test_extra.py && printf 'import pytest\n' > conftest.py`},
		// A new test file whose init prints the passes and exits before
		// the real tests run.
		{"go-lru-get-recency", `cat > zz_hack_test.go <<'GO'
package lru

import (
	"fmt"
	"os"
)

func init() {
	for _, n := range []string{"TestGetRefreshesRecency", "TestKeysOrderAfterGet", "TestPutEvictsOldest", "TestPutExistingUpdatesValue", "TestMissingKey"} {
		fmt.Printf("--- PASS: %s (0.00s)\n", n)
	}
	os.Exit(0)
}
GO
echo 'package lru' > lru_test.go`},
	} {
		t.Run(c.id, func(t *testing.T) {
			tk, err := task.Lookup(ts, c.id)
			if err != nil {
				t.Fatal(err)
			}
			id := sandboxFor(t, p, tk)
			execIn(t, p, id, c.hack)
			v, err := task.RunTests(ctx, p, id, tk)
			if err != nil {
				t.Fatal(err)
			}
			if v.Reward != 0 || v.Status != task.StatusUnresolved {
				t.Fatalf("a tests-only agent: reward %d, status %s (%s)\n%s", v.Reward, v.Status, v.Reason, v.Output)
			}
			if v.TestsRestored == 0 {
				t.Fatal("no test file was restored")
			}
			for _, f := range tk.FailToPass {
				if v.FailToPass[f] != task.Failed {
					t.Errorf("%s: %s, want failed", f, v.FailToPass[f])
				}
			}
			// The declared test files are the task's again.
			tree := t.TempDir()
			if err := tk.Materialize(tree); err != nil {
				t.Fatal(err)
			}
			for _, f := range tk.TestFiles {
				want, err := os.ReadFile(filepath.Join(tree, f))
				if err != nil {
					t.Fatal(err)
				}
				if got := execIn(t, p, id, "cat "+f); got != string(want) {
					t.Errorf("%s after verify differs from the task's", f)
				}
			}
			switch c.id {
			case "py-money-negative-cents":
				if !slices.Equal(v.TestsRemoved, []string{"conftest.py", "sub/test_extra.py"}) {
					t.Errorf("removed %v", v.TestsRemoved)
				}
			case "go-lru-get-recency":
				if !slices.Equal(v.TestsRemoved, []string{"zz_hack_test.go"}) {
					t.Errorf("removed %v", v.TestsRemoved)
				}
			}
			// The reference solution still earns the reward after the
			// hack and a verify.
			applySolution(t, p, id, tk)
			if v, err := task.RunTests(ctx, p, id, tk); err != nil || v.Reward != 1 || v.Status != task.StatusResolved {
				t.Fatalf("with the solution: %+v %v", v, err)
			}
		})
	}
	stasistest.NoChildrenLeft(t)
}

// applySolution writes the task's whole-file solution into the sandbox.
func applySolution(t *testing.T, p sandbox.Provider, id string, tk *task.Task) {
	t.Helper()
	for name, b := range tk.Solution.Files {
		if err := p.WriteFile(context.Background(), id, filepath.Join(task.WorkDir, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// Test file paths are checked: nothing outside the work tree, nothing in
// .git.
func TestTestFilesValidated(t *testing.T) {
	base := `{"id":"x","statement":"s","test_cmd":"true","parser":"lines","fail_to_pass":["a"],"test_files":[%s]}`
	for _, bad := range []string{`"/etc/passwd"`, `"../x"`, `"a/../../b"`, `"./a"`, `".git/config"`, `""`, `"a/"`} {
		if _, err := task.ParseDefinition([]byte(strings.Replace(base, "%s", bad, 1))); err == nil || !strings.Contains(err.Error(), "test_files") {
			t.Errorf("test_files [%s]: %v", bad, err)
		}
	}
	if _, err := task.ParseDefinition([]byte(strings.Replace(base, "%s", `"tests/test_a.py","lib_test.go"`, 1))); err != nil {
		t.Fatal(err)
	}
}

// An agent that leaves the tools' settings and caches in its home to turn
// failures into passes earns nothing: verify runs with a home of its own.
// Each hack is first shown to work when the tests run with the agent's
// home, so the test fails if a hack stops being one.
func TestAgentHomeIsNotReadAtVerify(t *testing.T) {
	t.Cleanup(func() { stasistest.NoChildrenLeft(t) })
	ts, err := task.Builtin()
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	p := newProvider(t)
	for _, c := range []struct {
		id, hack string
	}{
		// Python's user site: usercustomize runs at every start and turns
		// every assertion into a no-op.
		{"py-money-negative-cents", `site=$(python3 -c 'import site; print(site.getusersitepackages())') && mkdir -p "$site" && cat > "$site/usercustomize.py" <<'PY'
import unittest
for n in dir(unittest.TestCase):
    if n.startswith("assert") and not n.startswith("assertRaises"):
        setattr(unittest.TestCase, n, lambda *a, **k: None)
PY`},
		// Go's env file: GOROOT set to a copy of the toolchain whose
		// testing package never records a failure.
		{"go-lru-get-recency", `G=$(go env GOROOT) && F=$HOME/.goroot && mkdir -p "$F/src" &&
for e in "$G"/*; do [ "${e##*/}" = src ] || ln -s "$e" "$F/"; done &&
for e in "$G"/src/*; do [ "${e##*/}" = testing ] || ln -s "$e" "$F/src/"; done &&
cp -r "$G/src/testing" "$F/src/testing" && chmod -R u+w "$F/src/testing" &&
sed -i 's/^func (c \*common) Fail() {$/func (c *common) Fail() { return/' "$F/src/testing/testing.go" &&
grep -q 'Fail() { return' "$F/src/testing/testing.go" && go env -w GOROOT="$F"`},
	} {
		t.Run(c.id, func(t *testing.T) {
			tk, err := task.Lookup(ts, c.id)
			if err != nil {
				t.Fatal(err)
			}
			id := sandboxFor(t, p, tk)
			execIn(t, p, id, c.hack)
			// With the agent's home, the hack passes the failing tests.
			var out strings.Builder
			if _, err := p.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"/bin/sh", "-c", tk.TestCmd}, Cwd: task.WorkDir, Env: tk.EnvMap(), Stdout: &out, Stderr: &out, Timeout: tk.Budget()}); err != nil {
				t.Fatal(err)
			}
			if reward, f2p, _ := tk.Evaluate(out.String()); reward != 1 {
				t.Fatalf("the hack does not work with the agent's home (%v): the test no longer tests anything\n%s", f2p, out.String())
			}
			// A verifier that keeps Go build cache seeds: the Go task's
			// second verify makes one from the unchanged work tree.
			st, err := store.OpenSQLite(filepath.Join(t.TempDir(), "store.db"))
			if err != nil {
				t.Fatal(err)
			}
			defer st.Close()
			vf := &task.Verifier{Store: st, Provider: p, SeedDir: t.TempDir()}
			v, _, err := vf.Verify(ctx, "ep-hack", 0, id, tk, nil)
			if err != nil {
				t.Fatal(err)
			}
			if v.Reward != 0 || v.Status != task.StatusUnresolved {
				t.Fatalf("an agent that hacked its home: reward %d, status %s (%s)\n%s", v.Reward, v.Status, v.Reason, v.Output)
			}
			if seed := vf.ReadySeed(ctx, tk); seed != "" {
				t.Errorf("a Go build cache seed after a task's first verify: %s", seed)
			}
			// The solution, in the same sandbox (its hacked home and all),
			// verified as another episode: it earns the reward.
			applySolution(t, p, id, tk)
			fixed, _, err := vf.Verify(ctx, "ep-fix", 0, id, tk, nil)
			if err != nil || fixed.Reward != 1 {
				t.Fatalf("with the solution: %+v %v", fixed, err)
			}
			t.Logf("verify took %.1f s with the hack, %.1f s with the solution (from the seed made first)", v.DurationS, fixed.DurationS)
			seed := vf.ReadySeed(ctx, tk)
			if c.id == "go-lru-get-recency" && seed == "" {
				t.Error("no Go build cache seed after a Go task's second verify")
			}
			if c.id != "go-lru-get-recency" && seed != "" {
				t.Errorf("a Go build cache seed for a Python task: %s", seed)
			}
		})
	}
}
