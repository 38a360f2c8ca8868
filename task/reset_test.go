package task_test

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"stasis/sandbox"
	"stasis/stasistest"
	"stasis/task"
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
